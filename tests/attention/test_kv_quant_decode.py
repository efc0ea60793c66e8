"""Decode attention over a quantized KV cache on its register paths (csrc/kv_quant.cpp): contexts split into the
fixed 128-key pieces, bf16 queries dotted in bf16 on AVX512-BF16 (isa 4), every isa this machine builds against
the reference over the blocks dequantized; a row's output does not depend on the rows beside it; and the native
decode loop (csrc/decoder.cpp) over a quantized cache equals the layers run one by one."""

from __future__ import annotations

import pytest
import torch

from iterserve.attention import AttentionMetadata, KVCache, kv_quant
from iterserve.attention.cpu import CpuBackend
from iterserve.attention.reference import decode_attention_reference
from iterserve.config import ModelConfig
from iterserve.models.checkpoint import empty_model
from iterserve.models.native_decoder import NativeDecoder
from iterserve.platforms.ops import cpu_kernels

KERNELS = cpu_kernels()
OPS = KERNELS.extension if KERNELS is not None else None
pytestmark = pytest.mark.skipif(OPS is None, reason="the C++ CPU kernels are not built (scripts/setup.sh builds them)")
KINDS = ["fp8_e4m3", "fp8_e5m2", "int8"]


def isas() -> list[int]:
    """The paths built here: 1 scalar, 2 AVX2 + F16C, 3 AVX-512, 4 AVX512-BF16 (bf16 queries)."""
    return list(range(1, OPS.kv_quant_best_isa() + 1))


def random_cache(kind: str, blocks: int, bs: int, kv_heads: int, dim: int, seed: int = 0) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    cache = KVCache.allocate(blocks, bs, kv_heads, dim, torch.float32, "cpu", kv_dtype=kind)
    for pool, scales in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)):
        q, scale = kv_quant.quantize(torch.randn(pool.shape, generator=g) * 2, kind)
        pool.copy_(q)
        if scales is not None and scale is not None:
            scales.copy_(scale)
    return cache


def dequantized(cache: KVCache) -> KVCache:
    return KVCache(kv_quant.dequantize(cache.k, cache.k_scale, torch.float32),
                   kv_quant.dequantize(cache.v, cache.v_scale, torch.float32))


def long_case(cached: list[int], bs: int = 16, blocks_each: int = 20) -> AttentionMetadata:
    """Decodes whose blocks run backwards through the pool: contexts of several 128-key pieces and tails."""
    tables = [[(i + 1) * blocks_each - 1 - b for b in range(blocks_each)] for i in range(len(cached))]
    return AttentionMetadata.build(block_size=bs, block_tables=tables, num_cached=cached,
                                   query_lens=[1] * len(cached), max_decode_query=1, decode_prompts_up_to=1)


def run(q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float, isa: int,
        window: int = 0) -> torch.Tensor:
    out = torch.empty_like(q)
    OPS.paged_decode_quant(out, q, cache.k, cache.v, cache.k_scale, cache.v_scale, meta.decode_block_tables,
                           meta.decode_context_lens, scale, window, isa)
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 1, 128), (4, 4, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_contexts_in_pieces_equal_the_reference_over_the_blocks_dequantized(kind, heads, kv_heads, dim, dtype):
    cached = [300, 129, 1, 257]
    cache = random_cache(kind, 80, 16, kv_heads, dim)
    meta = long_case(cached)
    q = torch.randn(len(cached), heads, dim, generator=torch.Generator().manual_seed(4)).to(dtype)
    scale = dim ** -0.5
    expected = decode_attention_reference(q.float(), dequantized(cache), meta, scale)
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for isa in isas():
        torch.testing.assert_close(run(q, cache, meta, scale, isa).float(), expected, **tol, msg=f"isa {isa}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_output_does_not_depend_on_the_rows_decoded_beside_it(kind, dtype):
    cache = random_cache(kind, 80, 16, 3, 64)
    q = torch.randn(4, 9, 64, generator=torch.Generator().manual_seed(6)).to(dtype)
    batched = long_case([300, 129, 1, 257])
    for isa in isas():
        together = run(q, cache, batched, 0.125, isa)
        for i, n in enumerate([300, 129, 1, 257]):
            table = batched.decode_block_tables[i:i + 1, :20].tolist()
            alone = AttentionMetadata.build(block_size=16, block_tables=table, num_cached=[n], query_lens=[1],
                                            max_decode_query=1, decode_prompts_up_to=1)
            assert torch.equal(run(q[i:i + 1], cache, alone, 0.125, isa), together[i:i + 1]), (isa, i)


@pytest.mark.parametrize("dim", [64, 128])
def test_bf16_widening_is_exact_for_every_stored_value(dim):
    # one key: the output is its V row; every float8 and int8 value the store writes (int8 -127..127, times a
    # float16 scale) is exact in bf16
    for kind, dtype in [("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2), ("int8", torch.int8)]:
        codes = torch.arange(256, dtype=torch.uint8)
        values = codes.view(dtype).float()
        codes = codes[torch.isfinite(values) & ((values != -128) if kind == "int8" else True)]
        for start in range(0, codes.numel() - dim + 1, dim // 2):
            row = codes[start:start + dim].view(dtype).reshape(1, 1, 1, dim)
            scales = torch.full((1, 1, 1), 0.25, dtype=torch.float16) if kind == "int8" else None
            q = torch.zeros(1, 2, dim, dtype=torch.bfloat16)
            for isa in isas():
                out = torch.empty_like(q)
                OPS.paged_decode_quant(out, q, row, row, scales, scales, torch.zeros(1, 1, dtype=torch.long),
                                       torch.ones(1, dtype=torch.long), 1.0, 0, isa)
                want = kv_quant.dequantize(row.view(1, dim), scales.view(1) if scales is not None else None,
                                           torch.float32)
                assert torch.equal(out.float(), want.expand(2, dim)[None]), (kind, isa, start)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_decode_loop_over_a_quantized_cache_equals_the_layers_one_by_one(kind, dtype):
    cfg = ModelConfig(architecture="llama", vocab_size=300, hidden_size=192, intermediate_size=96, num_layers=2,
                      num_heads=6, num_kv_heads=2, head_dim=64, max_position_embeddings=512)
    torch.manual_seed(0)
    model = empty_model(cfg, dtype, torch.device("cpu"))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    results = []
    backend = CpuBackend(KERNELS)
    for decoder in (NativeDecoder(KERNELS), None):
        caches = model.allocate_kv_cache(40, 16, backend, kind)
        for i, c in enumerate(caches):
            filled = random_cache(kind, 40, 16, 2, 64, seed=i)
            for a, b in ((c.k, filled.k), (c.v, filled.v), (c.k_scale, filled.k_scale), (c.v_scale, filled.v_scale)):
                if a is not None and b is not None:
                    a.copy_(b)
        meta = long_case([200, 5, 140], blocks_each=13)
        ids = torch.tensor([3, 77, 250])
        with torch.inference_mode():
            logits = model(ids, torch.tensor([200, 5, 140]), caches, meta, backend, decoder=decoder)
        results.append((logits, [t for c in caches for t in (c.k, c.v, c.k_scale, c.v_scale) if t is not None]))
        if decoder is not None:
            assert decoder._stacks[model] is not None, "the native loop ran"
    (logits, kv), (want_logits, want_kv) = results
    assert torch.equal(logits, want_logits)
    as_bits = [(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 else (a, b)
               for a, b in zip(kv, want_kv, strict=True)]
    assert all(torch.equal(a, b) for a, b in as_bits)

"""The quantized KV cache (kv_cache_dtype fp8_e4m3, fp8_e5m2, int8): the store's numbers against torch's float8
conversion and the int8 formula, the C++ store against the PyTorch one byte for byte, and the C++ decode
attention over quantized blocks against the reference attention over the same blocks dequantized, on every
widening path this machine builds."""

from __future__ import annotations

import pytest
import torch

from iterserve.attention import AttentionMetadata, KVCache, kv_quant
from iterserve.attention.cpu import CpuBackend
from iterserve.attention.reference import ReferenceBackend, decode_attention_reference
from iterserve.platforms.ops import cpu_kernels

KERNELS = cpu_kernels()
OPS = KERNELS.extension if KERNELS is not None else None
needs_ops = pytest.mark.skipif(OPS is None, reason="the C++ CPU kernels are not built (scripts/setup.sh builds them)")
KINDS = ["fp8_e4m3", "fp8_e5m2", "int8"]


def isas() -> list[int]:
    """The widening paths built here: 1 scalar, 2 AVX2 + F16C, 3 AVX-512."""
    return list(range(1, OPS.kv_quant_best_isa() + 1)) if OPS is not None else []


def test_fp8_store_is_torch_float8_after_clamping_to_the_finite_range():
    x = torch.randn(5, 3, 64) * torch.logspace(-6, 5, 64)
    x[0, 0, :4] = torch.tensor([1e6, -1e6, 0.0, -0.0])
    for kind, dtype in [("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)]:
        q, scale = kv_quant.quantize(x, kind)
        assert scale is None and q.dtype == dtype
        limit = kv_quant.FP8_MAX[kind]
        assert torch.equal(q.view(torch.uint8), x.clamp(-limit, limit).to(dtype).view(torch.uint8))
        back = kv_quant.dequantize(q, None, torch.float32)
        assert torch.isfinite(back).all() and back[0, 0, 0] == limit and back[0, 0, 1] == -limit
        assert torch.equal(kv_quant.dequantize(q, None, torch.bfloat16).float(), back)  # widening is exact


def test_int8_store_is_round_x_over_the_rows_float16_amax_over_127():
    x = torch.randn(4, 2, 48, dtype=torch.float64).float()
    x[1, 1] = 0.0  # an all-zero row: a tiny scale, all-zero values
    q, scale = kv_quant.quantize(x, "int8")
    assert q.dtype == torch.int8 and scale is not None and scale.dtype == torch.float16 and scale.shape == (4, 2)
    expected_scale = (x.abs().amax(-1) / 127).half().clamp_min(2 ** -24)
    assert torch.equal(scale, expected_scale)
    assert torch.equal(q, torch.round(x / expected_scale.float()[..., None]).clamp(-127, 127).to(torch.int8))
    assert (q[1, 1] == 0).all()
    back = kv_quant.dequantize(q, scale, torch.float32)
    assert (back - x).abs().max() <= scale.float().max() * 0.51  # half a step, the float16 scale's rounding aside


def test_an_unknown_kv_cache_dtype_is_refused_with_the_accepted_ones():
    with pytest.raises(ValueError, match="auto, fp8, fp8_e4m3, fp8_e5m2, int8"):
        KVCache.allocate(2, 16, 1, 32, torch.float32, "cpu", kv_dtype="fp4")


def random_cache(kind: str, blocks: int, bs: int, kv_heads: int, dim: int, seed: int = 0) -> KVCache:
    """A quantized cache whose every slot holds stored rows of random K/V."""
    g = torch.Generator().manual_seed(seed)
    cache = KVCache.allocate(blocks, bs, kv_heads, dim, torch.float32, "cpu", kv_dtype=kind)
    for pool, scales in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)):
        q, scale = kv_quant.quantize(torch.randn(pool.shape, generator=g) * 2, kind)
        pool.copy_(q)
        if scales is not None and scale is not None:
            scales.copy_(scale)
    return cache


def dequantized(cache: KVCache, dtype: torch.dtype) -> KVCache:
    return KVCache(kv_quant.dequantize(cache.k, cache.k_scale, dtype), kv_quant.dequantize(cache.v, cache.v_scale,
                                                                                          dtype))


@needs_ops
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_store_writes_the_bytes_the_reference_writes(kind, dtype):
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(7, 3, 5, 40, generator=g).to(dtype) * 3  # k and v as strided views of a fused output
    k, v = qkv[:, 0, :2], qkv[:, 1, :2]
    meta = AttentionMetadata.build(block_size=4, block_tables=[[3, 1], [0, 5]], num_cached=[0, 2],
                                   query_lens=[5, 2])
    ref = KVCache.allocate(6, 4, 2, 40, dtype, "cpu", kv_dtype=kind)
    cpu = KVCache.allocate(6, 4, 2, 40, dtype, "cpu", kv_dtype=kind)
    ReferenceBackend().write_kv(k, v, ref, meta)
    CpuBackend(KERNELS).write_kv(k, v, cpu, meta)
    assert torch.equal(ref.k.view(torch.uint8), cpu.k.view(torch.uint8))
    assert torch.equal(ref.v.view(torch.uint8), cpu.v.view(torch.uint8))
    if kind == "int8":
        assert torch.equal(ref.k_scale, cpu.k_scale) and torch.equal(ref.v_scale, cpu.v_scale)


def decode_case(window: int | None = None) -> AttentionMetadata:
    """Four decodes over blocks out of order, contexts with block tails (odd lengths, one of 1 token)."""
    tables = [[7, 3, 11], [5], [0, 9, 2, 14, 8, 1], [4, 6, 10, 12, 13]]
    cached = [8, 0, 22, 16]
    return AttentionMetadata.build(block_size=4, block_tables=tables, num_cached=cached, query_lens=[1, 1, 1, 1],
                                   sliding_window=window, max_decode_query=1, decode_prompts_up_to=1)


@needs_ops
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("heads,kv_heads,dim", [(6, 2, 64), (4, 4, 40), (8, 1, 128)])
@pytest.mark.parametrize("window", [None, 7])
def test_decode_over_quantized_blocks_equals_the_reference_over_them_dequantized(kind, heads, kv_heads, dim, window):
    cache = random_cache(kind, 16, 4, kv_heads, dim)
    meta = decode_case(window)
    assert meta.num_decode_tokens == 4
    q = torch.randn(4, heads, dim, generator=torch.Generator().manual_seed(1))
    scale = dim ** -0.5
    expected = decode_attention_reference(q, dequantized(cache, torch.float32), meta, scale)
    assert torch.allclose(decode_attention_reference(q, cache, meta, scale), expected)  # the reference reads it too
    for isa in isas():
        out = torch.empty_like(q)
        OPS.paged_decode_quant(out, q, cache.k, cache.v, cache.k_scale, cache.v_scale, meta.decode_block_tables,
                               meta.decode_context_lens, scale, window or 0, isa)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5, msg=f"isa {isa}")


@needs_ops
@pytest.mark.parametrize("kind", KINDS)
def test_bf16_decode_over_quantized_blocks_stays_close_to_the_reference(kind):
    cache = random_cache(kind, 16, 4, 2, 64)
    meta = decode_case()
    q = torch.randn(4, 6, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    expected = decode_attention_reference(q.float(), dequantized(cache, torch.float32), meta, 0.125)
    for isa in isas():
        out = torch.empty_like(q)
        OPS.paged_decode_quant(out, q, cache.k, cache.v, cache.k_scale, cache.v_scale, meta.decode_block_tables,
                               meta.decode_context_lens, 0.125, 0, isa)
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@needs_ops
def test_widening_paths_agree_bit_for_bit_on_every_byte():
    # every float8 byte (NaN patterns aside) and every int8 value, through each path
    codes = torch.arange(256, dtype=torch.uint8)
    for kind, dtype in [("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2), ("int8", torch.int8)]:
        vals = codes.view(dtype).float()
        keep = torch.isfinite(vals)
        row = codes[keep]
        n = (row.numel() // 16) * 16  # whole rows of the cache: head_dim a multiple of 16
        pool = row[:n].view(dtype).reshape(1, 1, 1, n)
        scales = torch.full((1, 1, 1), 0.5, dtype=torch.float16) if kind == "int8" else None
        q = torch.zeros(1, 1, n)
        q[0, 0, 0] = 1.0
        for isa in isas():  # one key: the output is its V row, widened
            out = torch.empty_like(q)
            OPS.paged_decode_quant(out, q, pool, pool, scales, scales, torch.zeros(1, 1, dtype=torch.long),
                                   torch.ones(1, dtype=torch.long), 1.0, 0, isa)
            expected = vals[keep][:n] * (0.5 if kind == "int8" else 1.0)
            assert torch.equal(out.view(-1), expected), (kind, isa)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_a_prompt_attends_to_its_kv_as_stored_in_one_chunk_or_two(kind, backend):
    if backend == "cpu" and OPS is None:
        pytest.skip("the C++ CPU kernels are not built")
    be = CpuBackend(KERNELS) if backend == "cpu" else ReferenceBackend()
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(21, n, 32, generator=g) for n in (4, 2, 2))
    one = KVCache.allocate(8, 4, 2, 32, torch.float32, "cpu", kv_dtype=kind)
    two = KVCache.allocate(8, 4, 2, 32, torch.float32, "cpu", kv_dtype=kind)
    table = [[6, 1, 3, 0, 7, 2]]
    whole = be.forward(q, k, v, one, AttentionMetadata.build(block_size=4, block_tables=table, num_cached=[0],
                                                             query_lens=[21]), 0.2)
    first = be.forward(q[:9], k[:9], v[:9], two, AttentionMetadata.build(block_size=4, block_tables=table,
                                                                         num_cached=[0], query_lens=[9]), 0.2)
    rest = be.forward(q[9:], k[9:], v[9:], two, AttentionMetadata.build(block_size=4, block_tables=table,
                                                                        num_cached=[9], query_lens=[12]), 0.2)
    torch.testing.assert_close(torch.cat([first, rest]), whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_copying_blocks_copies_their_scales(kind):
    cache = random_cache(kind, 4, 4, 2, 16)
    cache.copy_blocks(torch.tensor([1, 2]), torch.tensor([3, 0]))
    for pool, scales in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)):
        assert torch.equal(pool[3].view(torch.uint8), pool[1].view(torch.uint8))
        assert torch.equal(pool[0].view(torch.uint8), pool[2].view(torch.uint8))
        if kind == "int8":
            assert scales is not None and torch.equal(scales[3], scales[1]) and torch.equal(scales[0], scales[2])

"""The native decode loop (models/native_decoder.py, csrc/decoder.cpp) against the same kernels called layer by
layer from Python: the same logits and the same K/V written, to the bit, for every linear method and family."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from iterserve.attention import AttentionMetadata
from iterserve.attention.cpu import CpuBackend
from iterserve.attention.reference import gather_rows
from iterserve.config import ModelConfig
from iterserve.distributed.parallel_state import ParallelState
from iterserve.models.checkpoint import empty_model
from iterserve.models.cpu_linear import MeasuredChooser, PackedLinear
from iterserve.models.linear import DENSE, LinearMethod, process_weights
from iterserve.models.llama import LlamaModel
from iterserve.models.native_decoder import NativeDecoder
from iterserve.platforms.ops import cpu_kernels
from iterserve.quantization.gguf_weight import from_stored
from iterserve.quantization.model import quantize_model
from tests.quantization.gguf_fixtures import random_blocks

OPS = cpu_kernels()
pytestmark = pytest.mark.skipif(OPS is None, reason="the C++ CPU kernels are not built (scripts/setup.sh builds them)")


def tiny(**kw) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=3,
                num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256)
    return ModelConfig(**(base | kw))


CONFIGS = {
    "llama-gqa": tiny(),
    "mistral-sliding-window": tiny(architecture="mistral", sliding_window=6),
    "qwen2-qkv-bias": tiny(architecture="qwen2", attention_bias=True, tie_word_embeddings=True),
    "qwen3-qk-norm": tiny(architecture="qwen3", qk_norm=True, head_dim=32),
    # Gemma 3's layer order, norms and GELU; a local layer (its window, its RoPE) between two global ones
    "gemma3-local-global": tiny(architecture="gemma3", qk_norm=True, sliding_window=6, tie_word_embeddings=True,
                                extra={"layer_types": ["full_attention", "sliding_attention", "full_attention"],
                                       "query_pre_attn_scalar": 20.0, "rope_local_base_freq": 500.0,
                                       "final_logit_softcapping": None}),
}


def model_with(cfg: ModelConfig, method: str, dtype: torch.dtype) -> LlamaModel:
    if method == "gguf":  # an MLP of 256 inputs: its down projection in K-quant super-blocks
        cfg = dataclasses.replace(cfg, intermediate_size=256)
    torch.manual_seed(0)
    model = empty_model(cfg, dtype, torch.device("cpu"))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    if method == "int8":
        quantize_model(model, "int8")
    elif method == "gguf":
        gguf_blocks(model)
        quantize_model(model, "gguf")
    else:
        packed = MeasuredChooser([PackedLinear(OPS)])  # one candidate: every layer takes it
        process_weights(model, (lambda layer: DENSE) if method == "dense" else packed)
    return model


def gguf_blocks(model: LlamaModel) -> None:
    """Every linear layer in stored GGUF blocks, as a Q4_K_M file mixes them: two parts of different types each
    (K-quants where the inputs are whole super-blocks), as loading a fused layer from a file leaves them."""
    for i, layer in enumerate(model.layers):
        for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            n, k = proj.weight.shape
            types = ["Q4_K", "Q6_K", "Q5_K", "Q3_K", "Q2_K", "IQ4_XS"] if k % 256 == 0 else ["Q5_0", "Q8_0", "Q5_1",
                                                                                              "IQ4_NL"]
            parts = [(types[(i + j) % len(types)], rows) for j, rows in enumerate((n // 2, n - n // 2))]
            proj.__dict__["weight_blocks"] = {
                j: from_stored(random_blocks(t, rows, k, seed=100 * i + j, scale=0.2), t, rows, k)
                for j, (t, rows) in enumerate(parts)}


def decode_step(model: LlamaModel, decoder: NativeDecoder | None, seed: int = 1, window_pool: bool = False):
    """One step of three decodes (contexts 9, 1 and 20 over blocks out of order) and a sequence verifying 3
    speculated tokens, with ``decoder`` (None: the layers one by one): its logits and every layer's K and V cache
    after it. ``window_pool``: the windowed layers read tables of their own (hybrid SWA memory), the blocks a
    window behind each sequence's first query at the null block 0."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    caches = model.allocate_kv_cache(24, 4)
    for c in caches:
        c.k.normal_(generator=g)
        c.v.normal_(generator=g)
    tables = [[7, 3, 11], [5], [0, 9, 2, 14, 8, 1], [4, 6, 10, 12]]
    cached, qlens = [8, 1, 19, 10], [1, 1, 1, 3]
    window_tables = [[0 if (i + 1) * 4 <= c - cfg.sliding_window + 1 else 23 - b for i, b in enumerate(t)]
                     for t, c in zip(tables, cached)] if window_pool else None
    meta = AttentionMetadata.build(block_size=4, block_tables=tables, num_cached=cached, query_lens=qlens,
                                   sliding_window=None if window_pool else cfg.sliding_window, max_decode_query=3,
                                   window_tables=window_tables)
    assert meta.num_decode_tokens == 6 and not meta.prefills
    ids = torch.randint(0, cfg.vocab_size, (6,), generator=g)
    positions = torch.tensor([8, 1, 19, 10, 11, 12])
    logits = model(ids, positions, caches, meta, CpuBackend(OPS), decoder=decoder)
    return logits, [c.k for c in caches] + [c.v for c in caches]


@pytest.mark.parametrize("family", CONFIGS)
@pytest.mark.parametrize("method,dtype", [("dense", torch.float32), ("packed", torch.float32),
                                          ("packed", torch.bfloat16), ("int8", torch.float32),
                                          ("gguf", torch.float32), ("gguf", torch.bfloat16)])
def test_native_decode_loop_equals_the_layers_one_by_one(family, method, dtype):
    model = model_with(CONFIGS[family], method, dtype)
    native = NativeDecoder(OPS)
    logits, kv = decode_step(model, native)
    assert native._stacks[model] is not None, "the native loop ran"
    want_logits, want_kv = decode_step(model, None)
    assert torch.equal(logits, want_logits)
    assert all(torch.equal(a, b) for a, b in zip(kv, want_kv, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma3_native_loop_over_a_window_pool_equals_the_layers_one_by_one(dtype):
    model = model_with(CONFIGS["gemma3-local-global"], "packed", dtype)
    logits, kv = decode_step(model, NativeDecoder(OPS), window_pool=True)
    want_logits, want_kv = decode_step(model, None, window_pool=True)
    assert torch.equal(logits, want_logits)
    assert all(torch.equal(a, b) for a, b in zip(kv, want_kv, strict=True))


def test_a_step_with_a_prompt_chunk_runs_the_layers_in_python():
    model = model_with(CONFIGS["llama-gqa"], "packed", torch.float32)
    decoder = NativeDecoder(OPS)
    caches = model.allocate_kv_cache(8, 4)
    meta = AttentionMetadata.build(block_size=4, block_tables=[[0, 1], [2, 3]], num_cached=[4, 0],
                                   query_lens=[1, 5])
    x = torch.zeros(6, 64)
    cos = sin = torch.zeros(6, 1, 16)
    assert decoder(model, x, cos, sin, caches, meta) is None
    assert model not in decoder._stacks  # nothing built for a step it does not run


class PythonOnly(LinearMethod):
    name = "python-only"

    def apply(self, layer, x):
        return torch.nn.functional.linear(x, layer.weight, layer.bias)


def test_no_native_loop_for_a_method_without_a_kernel_or_a_sharded_model():
    model = model_with(CONFIGS["llama-gqa"], "dense", torch.float32)
    model.layers[1].mlp.down_proj.method = PythonOnly()
    assert model.native_stack() is None
    logits, _ = decode_step(model, NativeDecoder(OPS))  # the layers run in Python, still correct
    want, _ = decode_step(model, None)
    assert torch.equal(logits, want)
    model.layers[1].mlp.down_proj.method = DENSE
    assert model.native_stack() is not None
    model.parallel = ParallelState(rank=0, world_size=2)
    assert model.native_stack() is None


@pytest.mark.parametrize("family", CONFIGS)
def test_a_step_with_short_prompts_runs_natively_and_attends_them_as_the_prefill_path_does(family):
    """A decode, a fresh 5-token prompt and a 4-token chunk after 6 cached tokens: under the backend's limit
    the prompts are attended as decodes, in the native loop, and give the prefill path's logits and K/V."""
    model = model_with(CONFIGS[family], "packed", torch.float32)
    cfg = model.config
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, (10,), generator=g)
    positions = torch.tensor([8, 0, 1, 2, 3, 4, 6, 7, 8, 9])
    tables, cached, qlens = [[7, 3, 11], [5, 2], [0, 9, 4]], [8, 0, 6], [1, 5, 4]
    results = []
    for limit in (CpuBackend.decode_prompts_up_to, 0):
        backend, decoder = CpuBackend(OPS), NativeDecoder(OPS)
        backend.decode_prompts_up_to = limit
        caches = model.allocate_kv_cache(12, 4)
        for c in caches:
            c.k.normal_(generator=torch.Generator().manual_seed(4))
            c.v.normal_(generator=torch.Generator().manual_seed(5))
        meta = AttentionMetadata.build(block_size=4, block_tables=tables, num_cached=cached, query_lens=qlens,
                                       sliding_window=cfg.sliding_window, decode_prompts_up_to=limit)
        logits = model(ids, positions, caches, meta, backend, torch.tensor([0, 5, 9]), decoder=decoder)
        results.append((logits, [c.k for c in caches] + [c.v for c in caches], meta, decoder))
    (native, native_kv, meta, decoder), (spans, spans_kv, span_meta, _) = results
    assert meta.num_decode_tokens == 10 and decoder._stacks[model] is not None
    assert span_meta.num_decode_tokens == 1 and len(span_meta.prefills) == 2
    torch.testing.assert_close(native, spans, atol=1e-4, rtol=1e-4)
    for a, b in zip(native_kv, spans_kv, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_keys_in_groups_where_the_backend_reads_them_so_give_the_logits_of_keys_in_rows():
    """bf16 with head_dim 32 and blocks of 16: on a CPU with AVX512-BF16 the backend keeps K in key groups. A
    prompt, a chunk after its cached prefix (read back through the prefill path's gather) and decodes in the
    native loop give the logits of the same model over K in rows, and the same K."""
    model = model_with(tiny(head_dim=32), "packed", torch.bfloat16)
    cfg = model.config
    backend = CpuBackend(OPS)
    backend.decode_prompts_up_to = 0  # prompt chunks through the prefill path
    grouped, rows = model.allocate_kv_cache(8, 16, backend), model.allocate_kv_cache(8, 16)
    expect_groups = bool(OPS.extension.keys_in_groups(torch.bfloat16, 32, 16))
    assert backend.ops.keys_in_groups(torch.bfloat16, 32, 16) == expect_groups
    assert all(c.k.dim() == (6 if expect_groups else 4) and c.v.dim() == 4 for c in grouped)
    g = torch.Generator().manual_seed(6)
    tables = [[5, 2], [0, 7, 3]]
    steps = [([0, 0], [20, 9]), ([20, 9], [1, 21]), ([21, 30], [1, 1])]  # (cached, query lengths) per step
    logits = {}
    for name, caches in (("groups", grouped), ("rows", rows)):
        for c in caches:
            c.k.zero_()
            c.v.zero_()
        logits[name] = []
        g.manual_seed(6)
        for cached, qlens in steps:
            meta = AttentionMetadata.build(block_size=16, block_tables=tables, num_cached=cached, query_lens=qlens,
                                           decode_prompts_up_to=0)
            ids = torch.randint(0, cfg.vocab_size, (sum(qlens),), generator=g)
            positions = torch.cat([torch.arange(c, c + n) for c, n in zip(cached, qlens)])
            logits[name].append(model(ids, positions, caches, meta, backend, decoder=NativeDecoder(OPS)))
    for a, b in zip(logits["groups"], logits["rows"], strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    table_rows = torch.tensor([5, 2, 0, 7, 3]) * cfg.num_kv_heads
    for a, b in zip(grouped, rows, strict=True):
        assert torch.equal(gather_rows(a.k, table_rows), gather_rows(b.k, table_rows))
        assert torch.equal(a.v, b.v)

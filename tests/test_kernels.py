"""The C++ CPU kernels (iterserve.kernels) against the PyTorch reference paths they replace.

These load the build directly, so they also run under ITERSERVE_CPU_KERNELS=0 (which only keeps the
model on the reference path); they skip only when no build exists for this source.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from iterserve import kernels
from iterserve.attention import AttentionMetadata, KVCache
from iterserve.attention.reference import ReferenceBackend, decode_attention_reference
from iterserve.config import ModelConfig
from iterserve.models.llama import RMSNorm, RotaryEmbedding
from iterserve.platforms.ops import REFERENCE, CpuOps, apply_rope

OPS = kernels.ops or kernels.load_build()
needs_build = pytest.mark.skipif(
    OPS is None, reason="the C++ CPU kernels are not built for this source: run `iterserve build-kernels` "
                        "(scripts/setup.sh does)")

# bf16 rounds the kernel's float32 result once: about 2^-8 relative.
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


def decode_case(ratio: int, block_size: int, dtype: torch.dtype, window: int | None, head_dim: int, seed: int,
                contexts: list[int] | None = None, kv_heads: int = 2):
    """A decode batch with ragged contexts (by default including a 1-token one) over scattered blocks."""
    g = torch.Generator().manual_seed(seed)
    contexts = contexts or [1, 2, block_size, block_size + 1, 77, 3 * block_size + 5]
    tables, nxt = [], 0
    total = sum(-(-c // block_size) for c in contexts) + 3
    perm = torch.randperm(total, generator=g).tolist()
    for c in contexts:
        n = -(-c // block_size)
        tables.append(perm[nxt:nxt + n])
        nxt += n
    cache = KVCache.allocate(total, block_size, kv_heads, head_dim, torch.float32, "cpu")
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    # Built by hand: a 1-token context never reaches decode in the engine, but the kernel must handle it.
    width = max(len(t) for t in tables)
    empty = torch.zeros(0, dtype=torch.long)
    meta = AttentionMetadata(
        slot_mapping=empty, slot_blocks=empty, slot_offsets=empty, block_size=block_size, sliding_window=window,
        num_decode_tokens=len(contexts), decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        decode_context_lens=torch.tensor(contexts),
    )
    q = torch.randn(len(contexts), kv_heads * ratio, head_dim, generator=g)
    return q, cache, meta


def low_precision(q: torch.Tensor, cache: KVCache, dtype: torch.dtype) -> tuple[torch.Tensor, KVCache]:
    """The case's query and K/V cache in `dtype`."""
    return q.to(dtype), KVCache(cache.k.to(dtype), cache.v.to(dtype))


def group_keys(k: torch.Tensor) -> torch.Tensor:
    """A K pool [blocks, kv_heads, block_size, D] in key groups, as ``KVCache.allocate(keys_in_groups=True)``
    lays it out: each 16 keys' dimension pairs side by side."""
    blocks, heads, block_size, dim = k.shape
    return k.view(blocks, heads, block_size // 16, 16, dim // 2, 2).transpose(3, 4).contiguous()


KEY_GROUPS = OPS is not None and OPS.keys_in_groups(torch.bfloat16, 64, 16)


def float_reference(q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The reference attention in float32 over the values the kernel reads (rounded to their dtype)."""
    return decode_attention_reference(q.float(), KVCache(cache.k.float(), cache.v.float()), meta, scale)


@needs_build
@pytest.mark.parametrize("ratio", [1, 3, 4])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_decode_matches_reference(ratio, block_size, dtype, window):
    head_dim = 36 if ratio == 3 else 64  # 36 is no multiple of the vector width: exercises the tails
    q, cache, meta = decode_case(ratio, block_size, dtype, window, head_dim, seed=ratio * 100 + block_size)
    expected = decode_attention_reference(q, cache, meta, head_dim**-0.5)  # float32, from the same values
    q, cache = low_precision(q, cache, dtype)
    if dtype != torch.float32:
        expected = float_reference(q, cache, meta, head_dim**-0.5)
    out = torch.full_like(q, float("nan"))
    OPS.paged_decode(out, q, cache.k, cache.v, meta.decode_block_tables, meta.decode_context_lens,
                     head_dim**-0.5, window or 0)
    torch.testing.assert_close(out.float(), expected, **TOL[dtype])


@needs_build
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 9: more heads than the blocked loops; (4, 128) and (6, 128): a bf16 group's scores on k-pairs where the
# CPU has AVX512-BF16, and a group too wide for them.
@pytest.mark.parametrize("ratio,head_dim", [(3, 64), (9, 32), (2, 36), (4, 128), (6, 128)])
def test_paged_decode_batch_of_many_tasks_a_chunk(dtype, ratio, head_dim):
    """Enough (sequence, head) tasks that each thread's chunks hold several, each asking for the next one's
    first tile; contexts cut tiles of every length, from one key up."""
    contexts = [1, 17, 40, 129, 33, 64, 5, 200, 16, 90, 3, 47]
    q, cache, meta = decode_case(ratio, 16, torch.float32, None, head_dim, seed=7, contexts=contexts)
    q, cache = low_precision(q, cache, dtype)
    expected = float_reference(q, cache, meta, head_dim**-0.5)
    out = torch.full_like(q, float("nan"))
    OPS.paged_decode(out, q, cache.k, cache.v, meta.decode_block_tables, meta.decode_context_lens,
                     head_dim**-0.5, 0)
    torch.testing.assert_close(out.float(), expected, **TOL[dtype])


@needs_build
@pytest.mark.parametrize("contexts", [[300], [200, 1], [130, 5, 64]])
@pytest.mark.parametrize("window", [None, 150])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_splits_a_small_batch_long_context_and_merges_it(contexts, window, dtype):
    """Fewer (sequence, KV head) pairs than the pool wants: contexts are cut into pieces, some empty for
    the shorter sequences, and the pieces' softmaxes merged; the result is the one-pass attention."""
    q, cache, meta = decode_case(3, 16, torch.float32, window, 64, seed=sum(contexts), contexts=contexts, kv_heads=1)
    q, cache = low_precision(q, cache, dtype)
    out = torch.full_like(q, float("nan"))
    OPS.paged_decode(out, q, cache.k, cache.v, meta.decode_block_tables, meta.decode_context_lens, 0.125, window or 0)
    expected = float_reference(q, cache, meta, 0.125)
    torch.testing.assert_close(out.float(), expected, **TOL[dtype])


@needs_build
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_reads_strided_queries(dtype):
    """Queries are views into the fused QKV output; the kernel must honour their row stride (bf16 scores on
    k-pairs read the query where it lies)."""
    q, cache, meta = decode_case(3, 16, torch.float32, None, 64, seed=7)
    q, cache = low_precision(q, cache, dtype)
    qkv = torch.randn(q.shape[0], q.shape[1] * q.shape[2] + 100).to(dtype)
    strided = qkv[:, :q.shape[1] * q.shape[2]].view(q.shape)
    strided.copy_(q)
    out = torch.empty_like(q)
    OPS.paged_decode(out, strided, cache.k, cache.v, meta.decode_block_tables, meta.decode_context_lens, 0.125, 0)
    expected = float_reference(q, cache, meta, 0.125)
    torch.testing.assert_close(out.float(), expected, **TOL[dtype])


@needs_build
@pytest.mark.parametrize("ratio,head_dim,block_size,window,contexts,kv_heads", [
    (3, 64, 16, None, None, 2),  # SmolLM2's group
    (1, 128, 32, 5, None, 2),  # windows that start inside a group of 16 keys
    (12, 96, 16, None, None, 1),  # more heads than one pass scores (8)
    (3, 64, 16, 150, [300], 1),  # a small batch's context split across threads, the window mid-group
    (8, 32, 16, None, [1, 17, 40, 129, 33, 64, 5, 200, 16, 90, 3, 47], 2),  # many tasks, tiles of every length
])
def test_paged_decode_reads_keys_in_groups(ratio, head_dim, block_size, window, contexts, kv_heads):
    """bf16 K in key groups (where the CPU has AVX512-BF16) gives the attention of the same keys in rows; the
    queries are strided views, as split from the QKV output."""
    q, cache, meta = decode_case(ratio, block_size, torch.float32, window, head_dim, seed=ratio + head_dim,
                                 contexts=contexts, kv_heads=kv_heads)
    q, cache = low_precision(q, cache, torch.bfloat16)
    strided = torch.zeros(q.shape[0], q[0].numel() + 64, dtype=q.dtype)[:, :q[0].numel()].view(q.shape)
    strided.copy_(q)
    out = torch.full_like(q, float("nan"))
    args = (out, strided, group_keys(cache.k), cache.v, meta.decode_block_tables, meta.decode_context_lens,
            head_dim**-0.5, window or 0)
    if not KEY_GROUPS:
        with pytest.raises(RuntimeError, match="AVX512-BF16"):
            OPS.paged_decode(*args)
        return
    OPS.paged_decode(*args)
    torch.testing.assert_close(out.float(), float_reference(q, cache, meta, head_dim**-0.5), **TOL[torch.bfloat16])


@needs_build
def test_write_kv_into_key_groups():
    """Each token's K lands, pair by pair, where the key-group layout keeps it; V as in rows."""
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(40, 2 * 2 * 32 + 5, generator=g).bfloat16()
    k, v = kv[:, :64].view(40, 2, 32), kv[:, 64:128].view(40, 2, 32)
    meta = AttentionMetadata.build(block_size=16, block_tables=[[3, 1], [6, 0, 2]], num_cached=[9, 14],
                                   query_lens=[20, 20])
    rows = KVCache(torch.zeros(8, 2, 16, 32, dtype=torch.bfloat16), torch.zeros(8, 2, 16, 32, dtype=torch.bfloat16))
    grouped = KVCache(group_keys(rows.k), rows.v.clone())
    if not KEY_GROUPS:
        with pytest.raises(RuntimeError, match="AVX512-BF16"):
            OPS.write_kv(k, v, grouped.k, grouped.v, meta.slot_blocks, meta.slot_offsets)
        return
    OPS.write_kv(k, v, rows.k, rows.v, meta.slot_blocks, meta.slot_offsets)
    OPS.write_kv(k, v, grouped.k, grouped.v, meta.slot_blocks, meta.slot_offsets)
    assert torch.equal(grouped.k, group_keys(rows.k)) and torch.equal(grouped.v, rows.v)
    assert rows.k.abs().sum() > 0


@needs_build
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_index_put(dtype):
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(5, 2 * 2 * 16 + 7, generator=g).to(dtype)
    k = kv[:, :32].view(5, 2, 16)  # strided views, as split from the QKV output
    v = kv[:, 32:64].view(5, 2, 16)
    meta = AttentionMetadata.build(block_size=4, block_tables=[[3, 1], [6]], num_cached=[2, 1], query_lens=[3, 2])
    got = KVCache.allocate(8, 4, 2, 16, dtype, "cpu")
    want = KVCache.allocate(8, 4, 2, 16, dtype, "cpu")
    OPS.write_kv(k, v, got.k, got.v, meta.slot_blocks, meta.slot_offsets)
    want.k[meta.slot_blocks, :, meta.slot_offsets] = k
    want.v[meta.slot_blocks, :, meta.slot_offsets] = v
    assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
    assert got.k.abs().sum() > 0


def reference(norm, x, residual=None):
    """``norm`` on the PyTorch path, as with ITERSERVE_CPU_KERNELS=0."""
    return norm(x, ReferenceBackend(), residual)


@needs_build
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_fused_residual_add(dtype):
    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(100, 1e-5)
    norm.weight.data = torch.rand(100, generator=g) + 0.5
    norm.to(dtype)
    x, residual = (torch.randn(7, 100, generator=g).to(dtype) for _ in range(2))
    torch.testing.assert_close(OPS.rms_norm(x, norm.weight, norm.eps), reference(norm, x), **TOL[dtype])
    want_out, want_res = reference(norm, x.clone(), residual.clone())
    got_x, got_res = x.clone(), residual.clone()
    OPS.fused_add_rms_norm(got_x, got_res, norm.weight, norm.eps)
    assert torch.equal(got_res, want_res)  # the residual stream is the same rounded sum
    torch.testing.assert_close(got_x, want_out, **TOL[dtype])


@needs_build
def test_rms_norm_of_strided_heads():
    """q/k norms (Qwen3) normalise [tokens, heads, D] views of the QKV output."""
    norm = RMSNorm(16, 1e-6)
    norm.weight.data.uniform_(0.5, 1.5)
    qkv = torch.randn(5, 3 * 16 + 8)
    q = qkv[:, :48].view(5, 3, 16)
    torch.testing.assert_close(OPS.rms_norm(q, norm.weight, norm.eps), reference(norm, q),
                               **TOL[torch.float32])


@needs_build
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_matches_apply_rope(dtype):
    g = torch.Generator().manual_seed(2)
    config = ModelConfig(architecture="llama", vocab_size=10, hidden_size=6 * 24, intermediate_size=8, num_layers=1,
                         num_heads=6, num_kv_heads=2, head_dim=24, max_position_embeddings=64)
    rotary = RotaryEmbedding(config)
    positions = torch.tensor([0, 5, 63, 17])
    cos, sin = rotary(positions, dtype)
    qkv = torch.randn(4, (6 + 2 + 2) * 24, generator=g).to(dtype)
    q, k = qkv[:, :144].view(4, 6, 24), qkv[:, 144:192].view(4, 2, 24)  # strided, as split from QKV
    want_q, want_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    v_before = qkv[:, 192:].clone()
    OPS.rope_(q, k, cos[:, 0], sin[:, 0])
    torch.testing.assert_close(q, want_q, **TOL[dtype])
    torch.testing.assert_close(k, want_k, **TOL[dtype])
    assert torch.equal(qkv[:, 192:], v_before)


@needs_build
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    x = (torch.randn(9, 2 * 100, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    gate, up = x.split(100, dim=-1)
    want = (F.silu(gate.float()) * up.float()).to(dtype)
    torch.testing.assert_close(OPS.silu_and_mul(x), want, **TOL[dtype])


def test_missing_build_falls_back_with_one_log_line(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(kernels, "BUILD_DIR", tmp_path)
    with caplog.at_level("WARNING", logger="iterserve.kernels"):
        assert kernels.load_build() is None
    assert [r.getMessage() for r in caplog.records] == [
        "iterserve CPU kernels are not built for this source (run scripts/setup.sh); the PyTorch reference path runs"]


def test_env_var_forces_the_reference_path(monkeypatch):
    monkeypatch.setenv(kernels.ENV_VAR, "0")
    assert kernels._load() is None


@needs_build
def test_argmax_rows_is_torch_argmax():
    """The first index of each row's maximum, ties and NaN as torch.argmax takes them."""
    torch.manual_seed(0)
    x = torch.randn(12, 1000)
    x[1, 10] = x[1, 500] = 100.0  # a tie: the first
    x[2, 7] = x[2, 900] = float("nan")  # NaN is the largest: the first NaN
    x[2, 3] = 1e30
    x[3] = float("-inf")
    x[4] = 0.0
    x[5, 999] = 1e9  # the last element
    for t in (x, torch.randn(3, 5), torch.randn(1, 1), torch.randn(70, 49152), torch.randn(8, 40)[:, ::2].contiguous()):
        assert torch.equal(OPS.argmax_rows(t), t.argmax(dim=-1))
    with pytest.raises(RuntimeError, match="float32"):
        OPS.argmax_rows(x.to(torch.bfloat16))


@needs_build
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_op_set_computes_the_reference_op_sets_values(dtype):
    """What a layer gets from the op set, kernels or reference: the same norms, rotation and activation, and the
    argmax of rows the kernel does not take (bf16, strided) left to torch."""
    g = torch.Generator().manual_seed(4)
    cpu = CpuOps(OPS)
    x, residual = (torch.randn(5, 64, generator=g).to(dtype) for _ in range(2))
    weight = torch.randn(64, generator=g).to(dtype)
    torch.testing.assert_close(cpu.rms_norm(x, weight, 1e-5), REFERENCE.rms_norm(x, weight, 1e-5), **TOL[dtype])
    want_normed, want_residual = REFERENCE.fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
    got_normed, got_residual = cpu.fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
    assert torch.equal(got_residual, want_residual)
    torch.testing.assert_close(got_normed, want_normed, **TOL[dtype])
    q, k = torch.randn(5, 4, 16, generator=g).to(dtype), torch.randn(5, 2, 16, generator=g).to(dtype)
    cos, sin = torch.randn(5, 1, 16, generator=g).to(dtype), torch.randn(5, 1, 16, generator=g).to(dtype)
    for got, want in zip(cpu.rotary(q.clone(), k.clone(), cos, sin), REFERENCE.rotary(q, k, cos, sin), strict=True):
        torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(cpu.silu_and_mul(x), REFERENCE.silu_and_mul(x), **TOL[dtype])
    logits = torch.randn(6, 40, generator=g)
    for t in (logits.to(dtype), logits[:, ::2]):
        assert torch.equal(cpu.argmax_rows(t), t.argmax(dim=-1))
    assert REFERENCE.keys_in_groups(torch.bfloat16, 32, 16) is False and REFERENCE.best_isa() == 0


def test_every_op_is_one_registered_torch_op():
    """The kernels register one way: ``ops.X`` is the dispatcher's ``torch.ops.iterserve.X``, whose schema marks
    the arguments it writes, and an op that does not exist says so."""
    assert OPS.rms_norm is torch.ops.iterserve.rms_norm.default
    assert "Tensor(a!) out" in str(OPS.paged_decode._schema)
    assert OPS.threads() >= 1
    with pytest.raises(AttributeError, match="no op 'no_such_op'"):
        _ = OPS.no_such_op
    with pytest.raises(RuntimeError, match="Expected a value of type 'float' for argument 'eps'"):
        OPS.rms_norm(torch.ones(2, 4), torch.ones(4), "eps")


@needs_build
def test_decoder_stack_rejects_a_malformed_layer():
    """DecoderStack takes a layer's norms, then its four linear layers; anything else is a clear error."""
    stack = OPS.DecoderStack(2, 1, 4, 1e-5, 0.5, False)
    w, norm = torch.ones(16, 8), torch.ones(8)
    with pytest.raises(RuntimeError, match="add_linear needs a layer with room"):
        stack.add_linear(0, [w], 16, [0], None)
    with pytest.raises(RuntimeError, match="QK-norm needs both weights"):
        stack.add_layer(norm, norm, torch.ones(4), None, None, None, 0)
    stack.add_layer(norm, norm, None, None, None, None, 0)
    with pytest.raises(RuntimeError, match="unknown linear kind 7"):
        stack.add_linear(7, [w], 16, [0], None)
    with pytest.raises(RuntimeError, match="one weight and one param"):
        stack.add_linear(0, [w, w], 16, [0], None)
    with pytest.raises(RuntimeError, match="a type id and a row count per part"):
        stack.add_linear(3, [w], 16, [12], None)
    with pytest.raises(RuntimeError, match="the last layer lacks its linear layers"):
        stack.add_layer(norm, norm, None, None, None, None, 0)
    gemma = OPS.DecoderStack(2, 1, 4, 1e-5, 0.5, True)
    with pytest.raises(RuntimeError, match="a Gemma 3 layer needs its q/k norms and its norms around the MLP"):
        gemma.add_layer(norm, norm, torch.ones(4), torch.ones(4), norm, None, 6)

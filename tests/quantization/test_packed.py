"""Packed quantized weights: lossless repacking of GGUF blocks, int8 quantization, and the C++ matmul
(every kernel this machine builds) against dequantize-then-matmul."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from iterserve import kernels
from iterserve.formats.gguf.tensors import from_gguf
from iterserve.quantization import packed as P
from tests.op_sets import use_kernels

OPS = kernels.ops or kernels.load_build()
needs_build = pytest.mark.skipif(
    OPS is None, reason="the C++ CPU kernels are not built for this source: run `iterserve build-kernels`")
ISAS = {1: "scalar", 2: "avx2", 3: "avx512_vnni"}
BUILT_ISAS = [i for i in ISAS if OPS is not None and i <= P.best_isa()]

GGUF_TYPES = ["Q4_0", "Q4_1", "Q8_0"]


def gguf_weight(fmt: str, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """A random weight quantized by the gguf package: its raw blocks and their float values."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).numpy() * 0.05
    qtype = gguf.GGMLQuantizationType[fmt]
    raw = gguf.quants.quantize(w, qtype)
    return raw, torch.from_numpy(gguf.quants.dequantize(raw, qtype).copy())


def packed_weight(fmt: str, n: int, k: int, seed: int = 0) -> tuple[P.PackedWeight, torch.Tensor]:
    if fmt == "int8":
        w = P.pack(P.quantize_int8(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05))
        return w, P.dequantize(w)
    raw, ref = gguf_weight(fmt, n, k, seed)
    return P.pack(from_gguf(raw, fmt, n, k)), ref


@pytest.mark.parametrize("fmt", GGUF_TYPES)
@pytest.mark.parametrize("n,k", [(16, 32), (17, 64), (40, 96), (3, 576)])
def test_gguf_blocks_repack_without_loss(fmt, n, k):
    raw, ref = gguf_weight(fmt, n, k)
    blocks = from_gguf(raw, fmt, n, k)
    assert torch.equal(blocks.dequantize(), ref)
    w = P.pack(blocks)
    assert w.bits == (8 if fmt == "Q8_0" else 4) and w.fmt == fmt
    assert torch.equal(P.dequantize(w), ref)
    rows = torch.tensor([[n - 1, 0], [n // 2, n - 1]])
    torch.testing.assert_close(P.dequantize(w, rows=rows), ref[rows], rtol=1e-6, atol=1e-6)  # the C++ op may fuse


@needs_build
@pytest.mark.parametrize("fmt", GGUF_TYPES + ["int8"])
def test_row_lookup_op_matches_unpacking(fmt, monkeypatch):
    w, ref = packed_weight(fmt, 40, 70 if fmt == "int8" else 64)
    rows = torch.tensor([[39, 0, 16], [17, 17, 31]])
    use_kernels(monkeypatch, OPS)
    fast = P.dequantize(w, torch.bfloat16, rows=rows)
    assert fast.shape == (2, 3, w.k) and fast.dtype == torch.bfloat16
    torch.testing.assert_close(fast, ref[rows].to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="row 40 is outside a weight of 40 rows"):
        P.dequantize(w, rows=torch.tensor([40]))
    use_kernels(monkeypatch, None)
    torch.testing.assert_close(P.dequantize(w, torch.bfloat16, rows=rows), fast)


def test_packed_bytes_match_the_file():
    """Q4_1 keeps the file's 20 bytes per 32 weights; 8-bit blocks carry 4 more (their offset)."""
    q41, _ = packed_weight("Q4_1", 64, 128)
    q80, _ = packed_weight("Q8_0", 64, 128)
    assert q41.nbytes == 64 * 128 // 32 * 20
    assert q80.nbytes == 64 * 128 // 32 * 36


@pytest.mark.parametrize("n,k", [(8, 32), (33, 70), (5, 1)])
def test_int8_quantization_rounds_each_weight_to_its_block_scale(n, k):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    w[0, :] = 0  # an all-zero block has scale 0 and stays exact
    back = P.dequantize(P.pack(P.quantize_int8(w)))
    assert back.shape == (n, k)
    blocks = -(-k // 32)
    amax = F.pad(w.abs(), (0, blocks * 32 - k)).view(n, blocks, 32).amax(-1)
    step = (amax / 127).repeat_interleave(32, dim=1)[:, :k]
    assert torch.all((back - w).abs() <= step * 0.5 + 1e-3 * step + 1e-12)
    assert torch.equal(back[0], torch.zeros(k))


def test_unknown_gguf_type_and_ragged_rows_are_refused():
    raw, _ = gguf_weight("Q8_0", 4, 32)
    with pytest.raises(ValueError, match="IQ2_XXS is not kept in blocks"):
        from_gguf(raw, "IQ2_XXS", 4, 32)
    with pytest.raises(ValueError, match="not a whole number of blocks"):
        from_gguf(raw, "Q8_0", 4, 33)


def integer_activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows whose every block of 32 holds integers in [-127, 127] with a 127 in it: the kernel's int8
    quantization of them is exact, so its result must equal the float reference to rounding."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-127, 128, (m, k), generator=g).float()
    x[:, ::32] = 127
    return x


@needs_build
@pytest.mark.parametrize("isa", BUILT_ISAS, ids=lambda i: ISAS[i])
@pytest.mark.parametrize("fmt", GGUF_TYPES + ["int8"])
@pytest.mark.parametrize("m", [1, 3, 64])
@pytest.mark.parametrize("n,k", [(17, 64), (40, 96), (64, 256)])
def test_kernel_equals_dequantize_then_matmul(isa, fmt, m, n, k):
    w, ref_w = packed_weight(fmt, n, k, seed=m)
    x = integer_activations(m, k, seed=n)
    out = torch.ops.iterserve.qgemm(x, w.data, w.n, w.bits, isa)
    torch.testing.assert_close(out, x @ ref_w.T, rtol=1e-5, atol=1e-3)


@needs_build
@pytest.mark.parametrize("isa", BUILT_ISAS, ids=lambda i: ISAS[i])
@pytest.mark.parametrize("fmt", ["Q4_1", "int8"])
def test_kernel_on_float_activations_is_within_int8_rounding(isa, fmt):
    """Real activations lose about 1/254 of a block's largest value to int8: the result stays within 1%."""
    k = 70 if fmt == "int8" else 96  # int8 pads a ragged last block
    w, ref_w = packed_weight(fmt, 48, k)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(3))
    ref = x @ ref_w.T
    out = torch.ops.iterserve.qgemm(x, w.data, w.n, w.bits, isa)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2


@needs_build
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_keeps_the_activation_dtype(dtype):
    w, ref_w = packed_weight("Q4_0", 20, 64)
    x = integer_activations(5, 64, seed=0)
    out = torch.ops.iterserve.qgemm(x.to(dtype), w.data, w.n, w.bits, 0)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), (x @ ref_w.T), rtol=1e-2, atol=1e-2)


@needs_build
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float_out_gives_the_sums_before_rounding(dtype):
    """The LM head's logits: float32 sums that the activation dtype's output rounds, bit for bit."""
    w, _ = packed_weight("Q4_0", 20, 64)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    logits = P.linear(x, w, float_out=True)
    assert logits.dtype == torch.float32 and torch.equal(logits.to(dtype), P.linear(x, w))
    assert not torch.equal(logits, logits.to(dtype).float())


@needs_build
def test_kernel_refuses_mismatched_shapes():
    w, _ = packed_weight("Q4_1", 32, 64)
    with pytest.raises(RuntimeError, match="x has 96 inputs"):
        torch.ops.iterserve.qgemm(torch.zeros(2, 96), w.data, w.n, w.bits, 0)
    with pytest.raises(RuntimeError, match="w's last dimension must be"):
        torch.ops.iterserve.qgemm(torch.zeros(2, 64), w.data, w.n, 8, 0)
    with pytest.raises(RuntimeError, match="isa 9 is not built"):
        torch.ops.iterserve.qgemm(torch.zeros(2, 64), w.data, w.n, w.bits, 9)


@needs_build
def test_linear_uses_the_kernel_and_falls_back_to_dequantize(monkeypatch):
    w, ref_w = packed_weight("Q8_0", 24, 64)
    x = integer_activations(6, 64, seed=2).view(2, 3, 64)
    use_kernels(monkeypatch, OPS)
    fast = P.linear(x, w)
    use_kernels(monkeypatch, None)
    slow = P.linear(x, w)
    assert fast.shape == slow.shape == (2, 3, 24)
    torch.testing.assert_close(slow, F.linear(x, ref_w))
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-3)


def test_block_weights_slice_and_fuse_like_the_float_weight():
    """What loading a fused, sharded layer does to blocks matches doing it to the float weight."""
    (raw_a, ref_a), (raw_b, ref_b) = gguf_weight("Q4_1", 24, 96, 0), gguf_weight("Q4_1", 8, 96, 1)
    a, b = from_gguf(raw_a, "Q4_1", 24, 96), from_gguf(raw_b, "Q4_1", 8, 96)
    fused = P.BlockWeight.cat([a.rows(slice(4, 20)), b])
    assert torch.equal(P.dequantize(P.pack(fused)), torch.cat([ref_a[4:20], ref_b]))
    assert torch.equal(a.columns(32, 64).dequantize(), ref_a[:, 32:96])
    assert torch.equal(a.padded_rows(30).dequantize()[24:], torch.zeros(6, 96))
    with pytest.raises(ValueError, match="split only at multiples of 32"):
        a.columns(16, 32)
    with pytest.raises(ValueError, match="different bit widths"):
        P.BlockWeight.cat([a, P.quantize_int8(ref_b)])

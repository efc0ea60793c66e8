"""GGUF tensors kept as stored (K-quants, Q5_0/Q5_1, IQ4_NL/IQ4_XS and the 32-blocks beside them): row lookups
equal gguf-py's dequantized values exactly, and the C++ matmul (every kernel built here) equals
dequantize-then-matmul."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from iterserve.formats.gguf.tensors import from_gguf
from iterserve.formats.gguf.types import STORED_TYPES
from iterserve.quantization import gguf_weight as G
from iterserve.quantization import packed as P
from tests.op_sets import use_kernels
from tests.quantization.gguf_fixtures import STORED, filled_blocks, random_blocks, reference
from tests.quantization.test_packed import BUILT_ISAS, ISAS, OPS, integer_activations, needs_build


def block_of(type_name: str) -> int:
    return STORED_TYPES[type_name][0]


def weight(type_name: str, n: int, k: int, seed: int = 0) -> tuple[G.GGUFWeight, torch.Tensor]:
    raw = random_blocks(type_name, n, k, seed)
    return G.from_stored(raw, type_name, n, k), reference(raw, type_name)


@pytest.mark.parametrize("fmt", STORED)
def test_dequantize_is_gguf_exactly(fmt, monkeypatch):
    w, ref = weight(fmt, 19, 512)
    assert w.fmt == fmt and w.shape == (19, 512) and w.nbytes == random_blocks(fmt, 19, 512).size
    rows = torch.tensor([[18, 0], [7, 7]])
    use_kernels(monkeypatch, None)  # gguf-py's own dequantize: the CUDA path
    assert torch.equal(G.dequantize(w), ref)
    assert torch.equal(G.dequantize(w, rows=rows), ref[rows])
    if OPS is not None:
        use_kernels(monkeypatch, OPS)  # the C++ decoder
        assert torch.equal(P.dequantize(w, rows=rows), ref[rows])
        assert torch.equal(P.dequantize(w, rows=torch.arange(19)), ref)
        assert torch.equal(P.dequantize(w, torch.bfloat16, rows=rows), ref[rows].to(torch.bfloat16))
        with pytest.raises(RuntimeError, match="row 19 is outside a weight of 19 rows"):
            P.dequantize(w, rows=torch.tensor([19]))


def scaled_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T).float()


@needs_build
@pytest.mark.parametrize("isa", BUILT_ISAS, ids=lambda i: ISAS[i])
@pytest.mark.parametrize("fmt", STORED)
@pytest.mark.parametrize("m", [1, 3, 17, 33])
@pytest.mark.parametrize("tiled", [False, True], ids=["rows", "tiled"])
def test_kernel_equals_dequantize_then_matmul(isa, fmt, m, tiled, monkeypatch):
    """Integer activations quantize to int8 exactly: the kernel then matches the float product to rounding;
    40 columns are two tiles and a ragged third, 768 inputs three super-blocks (K) or 24 blocks."""
    use_kernels(monkeypatch, OPS)
    k = 768 if block_of(fmt) == 256 else 96
    w, ref = weight(fmt, 40, k, seed=m)
    if tiled:
        w = w.tiled()
    x = integer_activations(m, k, seed=3)
    expected = scaled_reference(x, ref)
    out = P.linear(x, w, isa)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@needs_build
@pytest.mark.parametrize("isa", BUILT_ISAS, ids=lambda i: ISAS[i])
def test_fused_parts_of_different_types_multiply_in_one_call(isa, monkeypatch):
    use_kernels(monkeypatch, OPS)
    parts = [weight(fmt, n, 256, seed=i) for i, (fmt, n) in enumerate([("Q4_K", 20), ("Q4_K", 12), ("Q6_K", 17),
                                                                        ("Q8_0", 3), ("Q5_0", 16)])]
    fused = G.GGUFWeight.cat([w for w, _ in parts])
    assert [p.type_name for p in fused.parts] == ["Q4_K", "Q6_K", "Q8_0", "Q5_0"] and fused.n == 68
    assert fused.fmt == "Q4_K+Q5_0+Q6_K+Q8_0"
    ref = torch.cat([r for _, r in parts])
    x = integer_activations(5, 256, seed=1)
    expected = scaled_reference(x, ref)
    for w in (fused, fused.tiled()):
        torch.testing.assert_close(P.linear(x, w.to("cpu"), isa), expected, rtol=1e-5,
                                   atol=1e-5 * expected.abs().max().item())
        assert torch.equal(P.dequantize(w), ref)


@needs_build
@pytest.mark.parametrize("isa", BUILT_ISAS, ids=lambda i: ISAS[i])
@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K", "Q5_0"])
def test_kernel_on_float_activations_is_within_int8_rounding(isa, fmt, monkeypatch):
    use_kernels(monkeypatch, OPS)
    w, ref = weight(fmt, 48, 512)
    x = torch.randn(2, 3, 512, generator=torch.Generator().manual_seed(3))
    expected = F.linear(x, ref)
    for dtype in (torch.float32, torch.bfloat16):
        out = P.linear(x.to(dtype), w, isa)
        assert out.shape == (2, 3, 48) and out.dtype == dtype
        assert ((out.float() - expected).norm() / expected.norm()).item() < 1e-2


@needs_build
def test_float_out_gives_the_sums_before_rounding(monkeypatch):
    """The LM head's logits (a Q6_K output.weight, as in Q4_K_M files): float32 sums, rounded as without it."""
    use_kernels(monkeypatch, OPS)
    w, _ = weight("Q6_K", 48, 512)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    logits = P.linear(x, w, float_out=True)
    assert logits.dtype == torch.float32 and torch.equal(logits.bfloat16(), P.linear(x, w))
    assert not torch.equal(logits, logits.bfloat16().float())


@pytest.mark.parametrize("fmt,padded", [("Q2_K", 84), ("Q3_K", 112), ("Q4_K", 144), ("Q5_K", 176), ("Q6_K", 212),
                                        ("Q5_0", 24), ("Q5_1", 24), ("Q8_0", 36), ("IQ4_NL", 20), ("IQ4_XS", 136)])
def test_tiles_hold_the_rows_bytes(fmt, padded, monkeypatch):
    """Tiling lays the bytes out again (blocks padded to whole dwords, rows to 16) and gives them back exactly."""
    w, ref = weight(fmt, 37, 512)
    t = w.tiled()
    blocks = 512 // block_of(fmt)
    assert t.parts[0].raw.shape == (3, blocks, 16 * padded) and t.parts[0].tiled_rows == 37 and t.n == 37
    assert t.nbytes == 3 * blocks * 16 * padded
    assert torch.equal(t.parts[0].untiled().raw, w.parts[0].raw)
    use_kernels(monkeypatch, None)
    assert torch.equal(G.dequantize(t), ref)
    assert torch.equal(G.dequantize(t, rows=torch.tensor([36, 2])), ref[[36, 2]])
    assert weight("Q4_0", 4, 256)[0].tiled().parts[0].tiled_rows is None  # no tiled decoder: rows stay
    if OPS is not None:  # the C++ lookup reads a row out of its tile
        use_kernels(monkeypatch, OPS)
        ids = torch.tensor([[36, 2], [0, 17]])
        assert torch.equal(G.dequantize(t, torch.bfloat16, rows=ids), ref[ids].to(torch.bfloat16))
        with pytest.raises(RuntimeError, match="row 37 is outside a weight of 37 rows"):
            G.dequantize(t, rows=torch.tensor([37]))


def test_without_the_kernel_linear_dequantizes(monkeypatch):
    w, ref = weight("Q3_K", 8, 256)
    x = torch.randn(3, 256)
    use_kernels(monkeypatch, None)
    torch.testing.assert_close(P.linear(x, w), F.linear(x, ref))


def test_slices_match_the_float_weight():
    """What loading a fused or sharded layer does to the blocks matches doing it to the float weight."""
    w, ref = weight("Q4_K", 24, 512)
    assert torch.equal(G.dequantize(w.rows(slice(4, 20))), ref[4:20])
    assert torch.equal(G.dequantize(w.rows(torch.tensor([3, 1, 2]))), ref[[3, 1, 2]])
    assert torch.equal(G.dequantize(w.columns(256, 256).to("cpu")), ref[:, 256:])
    assert torch.equal(G.dequantize(w.padded_rows(30))[24:], torch.zeros(6, 512))
    with pytest.raises(ValueError, match="Q4_K weights split only at multiples of 256 inputs, not \\[128, 384\\)"):
        w.columns(128, 256)
    with pytest.raises(ValueError, match="sliced through its parts"):
        G.GGUFWeight.cat([w, weight("Q6_K", 2, 512)[0]]).rows(slice(0, 3))


def test_bad_data_is_refused_at_load():
    raw = random_blocks("Q4_K", 4, 512)
    with pytest.raises(ValueError, match="a \\[4, 512\\] Q4_K tensor takes 1152 bytes, the file holds 1000"):
        from_gguf(raw.reshape(-1)[:1000], "Q4_K", 4, 512)
    with pytest.raises(ValueError, match="a \\[4, 512\\] Q4_0 tensor takes 1152 bytes, the file holds 1000"):
        from_gguf(np.zeros(1000, np.uint8), "Q4_0", 4, 512)
    with pytest.raises(ValueError, match="a Q6_K row of 320 weights is not a whole number of blocks of 256"):
        from_gguf(raw, "Q6_K", 4, 320)
    with pytest.raises(ValueError, match="GGUF type IQ3_S is not kept in blocks; kept types: Q4_0, Q4_1, Q5_0"):
        from_gguf(raw, "IQ3_S", 4, 512)


@needs_build
def test_kernel_refuses_a_weight_that_does_not_fit():
    raw = torch.from_numpy(random_blocks("Q4_K", 4, 512))
    kgemm = torch.ops.iterserve.kgemm
    with pytest.raises(RuntimeError, match="rows of 288 bytes, 768 inputs of type id 12 take 432"):
        kgemm(torch.zeros(1, 768), [raw], [12], [4], 0)
    with pytest.raises(RuntimeError, match="rows of 144 bytes, 256 inputs of type id 14 take 210"):
        kgemm(torch.zeros(1, 256), [raw[:, :144].contiguous()], [14], [4], 0)
    with pytest.raises(RuntimeError, match="type id 21 is not one kgemm decodes"):
        kgemm(torch.zeros(1, 512), [raw], [21], [4], 0)
    with pytest.raises(RuntimeError, match="weight 0 does not hold 5 rows"):
        kgemm(torch.zeros(1, 512), [raw], [12], [5], 0)
    tiled = G.GGUFPart(raw, "Q4_K").tiled().raw
    with pytest.raises(RuntimeError, match="weight 0 does not hold 17 rows"):
        kgemm(torch.zeros(1, 512), [tiled], [12], [17], 0)
    with pytest.raises(RuntimeError, match="a tiled weight's lookup needs its row count"):
        torch.ops.iterserve.krows(tiled, 12, torch.tensor([0]), 512, torch.float32)
    with pytest.raises(RuntimeError, match="row 16 is outside a weight of 16 rows"):
        torch.ops.iterserve.krows(tiled, 12, torch.tensor([16]), 512, torch.float32, 16)


@needs_build
@pytest.mark.parametrize("isa", BUILT_ISAS, ids=lambda i: ISAS[i])
@pytest.mark.parametrize("fmt", STORED)
def test_a_rows_result_does_not_depend_on_the_row_count(isa, fmt, monkeypatch):
    """Up to 32 rows decode in registers, 8 a pass, more decode a tile once (AVX-512): each row's output is the
    same bits."""
    use_kernels(monkeypatch, OPS)
    k = 768 if block_of(fmt) == 256 else 608
    w = weight(fmt, 40, k, seed=5)[0].tiled()
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(2)).bfloat16()
    alone = torch.cat([P.linear(x[i:i + 1], w, isa) for i in range(40)])
    assert torch.equal(P.linear(x, w, isa), alone)
    assert torch.equal(P.linear(x[:11], w, isa), alone[:11])
    assert torch.equal(P.linear(x[:27], w, isa), alone[:27])


@needs_build
@pytest.mark.parametrize("isa", BUILT_ISAS, ids=lambda i: ISAS[i])
@pytest.mark.parametrize("fmt", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q8_0", "IQ4_NL", "IQ4_XS"])
def test_the_largest_codes_and_scales_do_not_overflow_the_integer_sums(isa, fmt, monkeypatch):
    """Blocks at their extremes against inputs of 127 (one sign, then the other, then alternating): the 16-bit sums
    the kernels add before widening, and the 32-bit sums after, must not wrap."""
    use_kernels(monkeypatch, OPS)
    k = 512
    x = torch.full((3, k), 127.0)
    x[1] = -127
    x[2, ::2] = -127
    for fill in (0xFF, 0x80, 0x7F):
        raw = filled_blocks(fmt, 24, k, fill)
        w = G.from_stored(raw, fmt, 24, k)
        expected = scaled_reference(x, reference(raw, fmt))
        for layout, m in itertools.product((w, w.tiled()), (1, 3)):
            torch.testing.assert_close(P.linear(x[:m], layout, isa), expected[:m], rtol=1e-5,
                                       atol=1e-5 * expected.abs().max().item())

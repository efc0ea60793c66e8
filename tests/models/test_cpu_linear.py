"""The packed linear kernel (csrc/linear.cpp) against F.linear, and the choice of methods by measurement."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from iterserve import kernels
from iterserve.models.cpu_linear import MeasuredChooser, PackedLinear
from iterserve.models.linear import DENSE, LinearBase, LinearMethod, process_weights
from tests.models.test_llama import FAMILIES, hf_pair, run_ours

OPS = kernels.ops or kernels.load_build()
needs_build = pytest.mark.skipif(OPS is None, reason="the C++ CPU kernels are not built for this source")

# Shapes with tails: K and N not multiples of the vector width (8/16) nor of AMX's 32-element k-steps.
SHAPES = [(1, 1), (7, 15), (33, 17), (64, 40), (100, 130), (576, 960), (64, 1600)]  # the last: chunks of two groups
ROWS = [1, 2, 3, 5, 8, 9, 16, 17, 64]


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """F.linear in float64 from the same rounded inputs: what every path approximates."""
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, k: int) -> None:
    # float32 sums k products in another order; bf16/fp16 round the float32 result once at the end.
    scale = want.abs() + k**0.5
    tol = {torch.float32: 5e-6, torch.bfloat16: 2**-8, torch.float16: 2**-10}[dtype]
    err = ((got.double() - want) / scale).abs().max().item()
    assert err <= tol, f"relative error {err:.3g} > {tol:.3g}"


@needs_build
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(dtype, k, n, bias):
    g = torch.Generator().manual_seed(k * 1000 + n)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    packed = OPS.pack_linear_weight(w)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=g).to(dtype)
        for amx_min_rows in (1, 1 << 30):  # AMX tiles (where built) and the vector path
            got = OPS.packed_linear(x, packed, n, b, amx_min_rows)
            assert got.shape == (rows, n) and got.dtype == dtype
            close(got, reference(x, w, b), dtype, k)


@needs_build
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float_out_gives_the_sums_before_rounding(dtype):
    """The LM head's logits (``float_out``): the float32 sums the bf16/fp16 output rounds, bit for bit, on the vector
    path and AMX tiles, and within float32's error of the exact products; a row alone as in a batch."""
    g = torch.Generator().manual_seed(3)
    k, n = 576, 1000
    w, b = torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    packed = OPS.pack_linear_weight(w)
    x = torch.randn(9, k, generator=g).to(dtype)
    for amx_min_rows in (1, 1 << 30):
        logits = OPS.packed_linear(x, packed, n, b, amx_min_rows, True)
        assert logits.dtype == torch.float32
        assert torch.equal(logits.to(dtype), OPS.packed_linear(x, packed, n, b, amx_min_rows))
        close(logits, reference(x, w, b), torch.float32, k)
        assert torch.equal(OPS.packed_linear(x[4:5], packed, n, b, amx_min_rows, True), logits[4:5])


@needs_build
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_alone_or_in_any_batch(dtype):
    """Each row's sums run in one order whatever the other rows: batching never changes a greedy token."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(130, 100, generator=g).to(dtype)
    packed = OPS.pack_linear_weight(w)
    x = torch.randn(20, 100, generator=g).to(dtype)
    alone = torch.cat([OPS.packed_linear(x[i:i + 1], packed, 130, None, 1 << 30) for i in range(20)])
    for rows in (2, 3, 8, 9, 13, 20):  # over 8 rows the weight is taken a tile at a time, row groups in turn
        batched = torch.cat([OPS.packed_linear(x[i:i + rows], packed, 130, None, 1 << 30) for i in range(0, 20, rows)
                             if i + rows <= 20])
        assert torch.equal(batched, alone[:len(batched)])


@needs_build
def test_packed_linear_refuses_a_weight_packed_for_another_shape():
    packed = OPS.pack_linear_weight(torch.randn(40, 64))
    with pytest.raises(RuntimeError, match="packed for another shape"):
        OPS.packed_linear(torch.randn(2, 32), packed, 40, None, 8)
    with pytest.raises(RuntimeError, match="packed for another shape"):
        OPS.packed_linear(torch.randn(2, 64), packed, 80, None, 8)


@needs_build
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_packed_method_gives_back_the_exact_weight(dtype):
    with torch.device("meta"):
        layer = LinearBase(100, 130, bias=False)
    layer.weight = torch.nn.Parameter(torch.randn(130, 100).to(dtype), requires_grad=False)
    method = PackedLinear(OPS)
    method.process_weights(layer)
    layer.method = method
    assert torch.equal(layer.dense_weight(), layer.weight)


@needs_build
@pytest.mark.parametrize("family", ["llama2-mha-untied", "qwen2-qkv-bias", "smollm2-tied"])
def test_a_model_on_the_packed_kernel_matches_transformers(family):
    hf, ours = hf_pair(FAMILIES[family])
    process_weights(ours, lambda layer: PackedLinear(OPS))
    linears = [m for m in ours.modules() if isinstance(m, LinearBase)]
    # The packed copy replaces the plain weight, except the LM head's when the embedding shares it.
    assert all(m.weight.is_meta != (m.weight is ours.embed_tokens.weight) for m in linears)
    ids = torch.randint(0, ours.config.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    got = run_ours(ours, ids, [7, 3, 1, 1])
    torch.testing.assert_close(got, hf(ids[None]).logits[0], atol=2e-5, rtol=1e-4)


@needs_build
def test_a_bf16_model_on_the_packed_kernel_gives_logits_not_rounded_to_bf16():
    """The LM head hands back its float32 sums: the logits of a bf16 model are not on bf16's grid."""
    _, ours = hf_pair(FAMILIES["smollm2-tied"])
    ours = ours.to(torch.bfloat16)
    process_weights(ours, lambda layer: PackedLinear(OPS))
    ids = torch.randint(0, ours.config.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    logits = run_ours(ours, ids, [7, 3, 1, 1])
    assert logits.dtype == torch.float32 and not torch.equal(logits, logits.bfloat16().float())
    x = torch.randn(3, ours.config.hidden_size).to(torch.bfloat16)
    assert torch.equal(ours.lm_head(x).bfloat16(), ours.lm_head.matmul(x))  # the same sums, rounded


class Slow(LinearMethod):
    """F.linear plus a fixed delay: the measurement must see it lose."""

    name = "slow"

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.002)
        return F.linear(x, layer.weight, layer.bias)


def test_the_chooser_keeps_the_fastest_method_and_measures_each_shape_once():
    _, ours = hf_pair(FAMILIES["llama2-mha-untied"])
    chooser = MeasuredChooser([Slow(), DENSE])
    chosen = process_weights(ours, chooser)
    assert set(chosen.values()) == {"dense"}
    # qkv and gate_up are both 64 -> 192 here: 64->192, o 64->64, down 96->64, lm_head 64->320
    assert len(chooser.measured) == 4
    report = chooser.report()
    assert len(report) == len(chooser.measured) and all(line.endswith("-> dense") for line in report)

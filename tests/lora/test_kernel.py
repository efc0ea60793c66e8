"""csrc/linear.cpp's lora_add_: each row gets its own adapter's ``(x @ A.T) @ B.T`` on packed weights, whatever
the other rows of the call, and bad weights are refused with a message."""

from __future__ import annotations

import pytest
import torch

from iterserve import kernels

OPS = kernels.ops
pytestmark = pytest.mark.skipif(OPS is None, reason="the C++ CPU kernels are not built (scripts/setup.sh builds them)")

K, N = 72, 200  # neither a multiple of the vector width; N spans two of the expand's block groups
RANKS = [3, None, 16, 40]  # slot 1: an adapter that leaves this layer alone
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}


def weights(dtype: torch.dtype) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    g = torch.Generator().manual_seed(0)
    a = [None if r is None else (torch.randn(r, K, generator=g) * 0.3).to(dtype) for r in RANKS]
    b = [None if r is None else (torch.randn(N, r, generator=g) * 0.3).to(dtype) for r in RANKS]
    return a, b


def packed(ws: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    assert OPS is not None
    return [None if w is None else OPS.pack_linear_weight(w) for w in ws]


def reference(out: torch.Tensor, x: torch.Tensor, a, b, slots: list[int]) -> torch.Tensor:
    """In float64, rounding each product to the dtype as the kernel does."""
    want = out.clone()
    for r, s in enumerate(slots):
        if s >= 0 and a[s] is not None:
            shrunk = (x[r].double() @ a[s].double().T).to(x.dtype)
            want[r] = out[r] + (shrunk.double() @ b[s].double().T).to(x.dtype)
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 150])  # one register tile, a short one, several tasks of rows per slot
def test_each_row_gets_its_own_adapters_product(dtype, rows):
    assert OPS is not None
    g = torch.Generator().manual_seed(rows)
    x, out = torch.randn(rows, K, generator=g).to(dtype), torch.randn(rows, N, generator=g).to(dtype)
    slots = torch.randint(-1, len(RANKS), (rows,), generator=g)  # -1: the base model; slot 1: no weights here
    a, b = weights(dtype)
    want = reference(out, x, a, b, slots.tolist())
    got = OPS.lora_add_(out.clone(), x, packed(a), packed(b), slots)
    torch.testing.assert_close(got, want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    untouched = [r for r, s in enumerate(slots.tolist()) if s in (-1, 1)]
    assert torch.equal(got[untouched], out[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_alone_or_in_any_batch(dtype):
    assert OPS is not None
    g = torch.Generator().manual_seed(1)
    x, out = torch.randn(40, K, generator=g).to(dtype), torch.randn(40, N, generator=g).to(dtype)
    slots = torch.tensor([2, 3, 0] * 13 + [3])
    a, b = packed(weights(dtype)[0]), packed(weights(dtype)[1])
    batch = OPS.lora_add_(out.clone(), x, a, b, slots)
    for r in (0, 1, 2, 39):
        alone = OPS.lora_add_(out[r:r + 1].clone(), x[r:r + 1], a, b, slots[r:r + 1])
        assert torch.equal(alone[0], batch[r])
    every_row_slot_2 = OPS.lora_add_(out.clone(), x, a, b, torch.full((40,), 2))
    assert torch.equal(OPS.lora_add_(out.clone(), x, [a[2]], [b[2]], None), every_row_slot_2)  # no slots: slot 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_that_do_not_fit_are_refused(dtype):
    assert OPS is not None
    a, b = packed(weights(dtype)[0]), packed(weights(dtype)[1])
    x, out = torch.randn(2, K).to(dtype), torch.randn(2, N).to(dtype)
    with pytest.raises(RuntimeError, match="A or B alone"):
        OPS.lora_add_(out, x, [a[0]], [None], None)
    with pytest.raises(RuntimeError, match="packed by pack_linear_weight for this layer's shape"):
        OPS.lora_add_(torch.randn(2, N + 16).to(dtype), x, [a[0]], [b[0]], None)
    with pytest.raises(RuntimeError, match="another in_features"):
        OPS.lora_add_(out, torch.randn(2, K + 40).to(dtype), [a[0]], [b[0]], None)
    with pytest.raises(RuntimeError, match="one slot per row"):
        OPS.lora_add_(out, x, [a[0]], [b[0]], torch.zeros(3, dtype=torch.long))

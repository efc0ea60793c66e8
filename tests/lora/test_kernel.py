"""csrc/lora.cpp's lora_add_: each row gets its own adapter's ``(x @ A.T) @ B.T`` on packed weights, whatever
the other rows of the call; a fused layer's B by its parts' blocks gives the bits of the whole block-diagonal B;
bad weights are refused with a message."""

from __future__ import annotations

import pytest
import torch

from iterserve import kernels
from iterserve.lora.adapter import BlockOfB, LoRAWeights
from iterserve.lora.batch import PackedStack, pack_weights

OPS = kernels.ops
pytestmark = pytest.mark.skipif(OPS is None, reason="the C++ CPU kernels are not built (scripts/setup.sh builds them)")

K, N = 72, 200  # neither a multiple of the vector width; N spans two of the expand's block groups
RANKS = [3, None, 16, 40]  # slot 1: an adapter that leaves this layer alone
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}
# a fused layer of three parts: output rows and ranks neither multiples of the vector width nor even
FUSED_ROWS, FUSED_RANKS = [37, 19, 44], [3, 5, 4]


def weights(dtype: torch.dtype) -> list[LoRAWeights | None]:
    g = torch.Generator().manual_seed(0)
    return [None if r is None else LoRAWeights((torch.randn(r, K, generator=g) * 0.3).to(dtype),
                                               (torch.randn(N, r, generator=g) * 0.3).to(dtype)) for r in RANKS]


def fused(dtype: torch.dtype, seed: int) -> LoRAWeights:
    """A fused layer's share of an adapter: A stacked, B block-diagonal."""
    g = torch.Generator().manual_seed(seed)
    b = torch.zeros(sum(FUSED_ROWS), sum(FUSED_RANKS))
    parts = []
    for i, (rows, rank) in enumerate(zip(FUSED_ROWS, FUSED_RANKS, strict=True)):
        out0, rank0 = sum(FUSED_ROWS[:i]), sum(FUSED_RANKS[:i])
        b[out0:out0 + rows, rank0:rank0 + rank] = torch.randn(rows, rank, generator=g) * 0.3
        parts.append(BlockOfB(out0, out0 + rows, rank0, rank0 + rank))
    a = torch.randn(sum(FUSED_RANKS), K, generator=g) * 0.3
    return LoRAWeights(a.to(dtype), b.to(dtype), tuple(parts))


def add(out: torch.Tensor, x: torch.Tensor, stack: PackedStack, slots: torch.Tensor | None) -> torch.Tensor:
    assert OPS is not None
    return OPS.lora_add_(out.clone(), x, stack.a, stack.b, stack.parts, slots)


def reference(out: torch.Tensor, x: torch.Tensor, ws: list[LoRAWeights | None], slots: list[int]) -> torch.Tensor:
    """In float64, rounding each product to the dtype as the kernel does."""
    want = out.clone()
    for r, s in enumerate(slots):
        w = ws[s] if s >= 0 else None
        if w is not None:
            shrunk = (x[r].double() @ w.a.double().T).to(x.dtype)
            want[r] = out[r] + (shrunk.double() @ w.b.double().T).to(x.dtype)
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 150])  # one register tile, a short one, several tasks of rows per slot
def test_each_row_gets_its_own_adapters_product(dtype, rows):
    assert OPS is not None
    g = torch.Generator().manual_seed(rows)
    x, out = torch.randn(rows, K, generator=g).to(dtype), torch.randn(rows, N, generator=g).to(dtype)
    slots = torch.randint(-1, len(RANKS), (rows,), generator=g)  # -1: the base model; slot 1: no weights here
    ws = weights(dtype)
    got = add(out, x, pack_weights(OPS, ws), slots)
    torch.testing.assert_close(got, reference(out, x, ws, slots.tolist()), rtol=TOLERANCE[dtype],
                               atol=TOLERANCE[dtype])
    untouched = [r for r, s in enumerate(slots.tolist()) if s in (-1, 1)]
    assert torch.equal(got[untouched], out[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 9, 150])
def test_a_fused_layers_parts_give_the_whole_block_diagonal_products_bits(dtype, rows):
    assert OPS is not None
    g = torch.Generator().manual_seed(rows)
    n = sum(FUSED_ROWS)
    x, out = torch.randn(rows, K, generator=g).to(dtype), torch.randn(rows, n, generator=g).to(dtype)
    slots = torch.randint(-1, 3, (rows,), generator=g)
    ws: list[LoRAWeights | None] = [fused(dtype, 1), None, fused(dtype, 2)]
    by_parts = pack_weights(OPS, ws)
    assert len(by_parts.b) == 6 and by_parts.parts[4:8] == [0, 4, 37, 19]  # rank 3 padded to 4: starts even
    whole = pack_weights(OPS, [None if w is None else LoRAWeights(w.a, w.b) for w in ws])
    got = add(out, x, by_parts, slots)
    assert torch.equal(got, add(out, x, whole, slots))
    torch.testing.assert_close(got, reference(out, x, ws, slots.tolist()), rtol=TOLERANCE[dtype],
                               atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_alone_or_in_any_batch(dtype):
    assert OPS is not None
    g = torch.Generator().manual_seed(1)
    x, out = torch.randn(40, K, generator=g).to(dtype), torch.randn(40, N, generator=g).to(dtype)
    slots = torch.tensor([2, 3, 0] * 13 + [3])
    stack = pack_weights(OPS, weights(dtype))
    batch = add(out, x, stack, slots)
    for r in (0, 1, 2, 39):
        alone = add(out[r:r + 1], x[r:r + 1], stack, slots[r:r + 1])
        assert torch.equal(alone[0], batch[r])
    every_row_slot_2 = add(out, x, stack, torch.full((40,), 2))
    assert torch.equal(add(out, x, pack_weights(OPS, [weights(dtype)[2]]), None), every_row_slot_2)  # no slots: 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_that_do_not_fit_are_refused(dtype):
    assert OPS is not None
    one = pack_weights(OPS, [weights(dtype)[0]])
    a, b, parts = one.a, one.b, one.parts
    x, out = torch.randn(2, K).to(dtype), torch.randn(2, N).to(dtype)
    with pytest.raises(RuntimeError, match="A or B alone"):
        OPS.lora_add_(out, x, a, [], [], None)
    with pytest.raises(RuntimeError, match="A or B alone"):
        OPS.lora_add_(out, x, [None], b, parts, None)
    with pytest.raises(RuntimeError, match="four numbers per B part"):
        OPS.lora_add_(out, x, a, b, parts[:3], None)
    with pytest.raises(RuntimeError, match="not packed by pack_linear_weight for its 200 output columns"):
        OPS.lora_add_(torch.randn(2, N - 16).to(dtype), x, a, b, parts, None)
    with pytest.raises(RuntimeError, match="not packed by pack_linear_weight for its 216 output columns"):
        OPS.lora_add_(torch.randn(2, N + 16).to(dtype), x, a, b, [0, 0, 0, N + 16], None)
    with pytest.raises(RuntimeError, match="another in_features"):
        OPS.lora_add_(out, torch.randn(2, K + 40).to(dtype), a, b, parts, None)
    with pytest.raises(RuntimeError, match="one slot per row"):
        OPS.lora_add_(out, x, a, b, parts, torch.zeros(3, dtype=torch.long))
    with pytest.raises(RuntimeError, match="overlap in out's columns"):
        OPS.lora_add_(torch.randn(2, 2 * N).to(dtype), x, a, b * 2, parts + [0, 0, N - 1, N], None)
    odd = parts[:1] + [1] + parts[2:]
    if b[0].dim() == 4:  # bf16 k-pairs: a part's ranks start at an even column
        with pytest.raises(RuntimeError, match="bf16 k-pairs need an even one"):
            OPS.lora_add_(out, x, a, b, odd, None)
    else:
        OPS.lora_add_(out, x, a, b, odd, None)

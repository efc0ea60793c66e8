"""The step's LoRA products, by the C++ kernel (csrc/linear.cpp's lora_add_) and by torch ops: each adapter's
``x @ A.T @ B.T`` lands on its own rows only."""

from __future__ import annotations

import pytest
import torch

from iterserve import kernels
from iterserve.lora import LoRARequest
from iterserve.lora.adapter import LoRAAdapter, LoRAWeights
from iterserve.lora.batch import LayerStack, LoRABatch, PackedStack
from iterserve.models.linear import LinearBase
from tests.op_sets import use_kernels


@pytest.fixture(params=["kernels", "torch"], autouse=True)
def path(request, monkeypatch) -> str:
    """Each test on both paths: the kernels' (where built) and torch's."""
    if request.param == "kernels" and kernels.ops is None:
        pytest.skip("the C++ CPU kernels are not built (scripts/setup.sh builds them)")
    if request.param == "torch":
        use_kernels(monkeypatch, None)
    return request.param


def adapter(layer: LinearBase, lora_id: int, rank: int) -> LoRAAdapter:
    g = torch.Generator().manual_seed(lora_id)
    w = LoRAWeights(torch.randn(rank, layer.in_features, generator=g),
                    torch.randn(layer.out_features, rank, generator=g))
    return LoRAAdapter(LoRARequest(f"a{lora_id}", lora_id, "/x"), rank, 1.0, {layer: w})


def test_rows_get_their_own_adapter():
    layer, other = LinearBase(6, 5, bias=False), LinearBase(6, 5, bias=False)
    a, b = adapter(layer, 1, 2), adapter(layer, 2, 3)
    c = adapter(other, 3, 2)  # targets another layer: adds nothing here
    x = torch.randn(7, 6)
    query_lens = [2, 1, 3, 1]  # rows 0-1: a, 2: base, 3-5: b, 6: c
    batch = LoRABatch.build([a, None, b, c], query_lens, torch.device("cpu"))
    assert batch is not None
    out = batch.add(layer, x, layer(x))
    want = layer(x)
    want[0:2] += x[0:2] @ a.weights[layer].a.T @ a.weights[layer].b.T
    want[3:6] += x[3:6] @ b.weights[layer].a.T @ b.weights[layer].b.T
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(layer(x, batch), want)  # the layer's forward takes the step's rows


def test_one_adapter_for_every_row_and_none():
    layer = LinearBase(4, 3, bias=False)
    a = adapter(layer, 1, 2)
    batch = LoRABatch.build([a, a], [2, 2], torch.device("cpu"))
    assert batch is not None and batch.row_slots is None  # no mask when every row shares it
    assert LoRABatch.build([None, None], [2, 2], torch.device("cpu")) is None


def test_stacks_are_kept_for_the_same_adapters(path):
    layer = LinearBase(4, 3, bias=False)
    a, b = adapter(layer, 1, 2), adapter(layer, 2, 3)
    x, stacks = torch.randn(3, 4), {}
    first = LoRABatch.build([b, a], [1, 2], torch.device("cpu"), stacks)
    assert first is not None
    first.add(layer, x, layer(x))
    stack = stacks[layer]
    if path == "torch":
        assert isinstance(stack, LayerStack) and stack.layout == (0, 0, 1, 1, 1)  # by id: a's 2 columns, b's 3
    else:
        assert isinstance(stack, PackedStack) and len(stack.a) == 2  # by id: a's, then b's
        assert torch.equal(stack.a[0], kernels.ops.pack_linear_weight(a.weights[layer].a))
    second = LoRABatch.build([a, None, b], [1, 1, 1], torch.device("cpu"), stacks)
    assert second is not None
    out = second.add(layer, x, layer(x))
    assert stacks[layer] is stack
    want = layer(x)
    want[0] += x[0] @ a.weights[layer].a.T @ a.weights[layer].b.T
    want[2] += x[2] @ b.weights[layer].a.T @ b.weights[layer].b.T
    torch.testing.assert_close(out, want)

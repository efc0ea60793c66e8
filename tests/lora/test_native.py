"""A step with LoRA rows in the native decode loop (csrc/decoder.cpp) against the same step's layers called one
by one from Python: the same logits and the same K/V, to the bit, for each linear method."""

from __future__ import annotations

import pytest
import torch

from iterserve.lora import LoRARequest
from iterserve.lora.adapter import LoRAAdapter, LoRAWeights
from iterserve.lora.batch import LoRABatch
from iterserve.models.llama import LlamaModel
from iterserve.models.native_decoder import NativeDecoder
from tests.attention.test_cpu import CONFIGS, OPS, decode_step, model_with

pytestmark = pytest.mark.skipif(OPS is None, reason="the C++ CPU kernels are not built (scripts/setup.sh builds them)")


def random_adapter(model: LlamaModel, lora_id: int, rank: int, skip: str) -> LoRAAdapter:
    """An adapter on every linear layer of the decoder except those named ``skip``."""
    g = torch.Generator().manual_seed(lora_id)
    weights = {}
    for name, layer in model.layers.named_modules():
        if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")) and not name.endswith(skip):
            a = torch.randn(rank, layer.in_features, generator=g) * 0.2
            b = torch.randn(layer.out_features, rank, generator=g) * 0.2
            weights[layer] = LoRAWeights(a.to(layer.weight.dtype), b.to(layer.weight.dtype))
    return LoRAAdapter(LoRARequest(f"a{lora_id}", lora_id, "/x"), rank, 1.0, weights)


def lora_step(model: LlamaModel, decoder: NativeDecoder | None, batch: LoRABatch | None):
    forward = model.forward

    def with_lora(*args, **kwargs):
        return forward(*args, None, batch, **kwargs)

    model.forward = with_lora  # type: ignore[method-assign]
    try:
        return decode_step(model, decoder)
    finally:
        del model.forward


@pytest.mark.parametrize("family", ["llama-gqa", "qwen3-qk-norm"])
@pytest.mark.parametrize("method,dtype", [("dense", torch.float32), ("packed", torch.float32),
                                          ("packed", torch.bfloat16), ("int8", torch.float32)])
def test_native_loop_with_lora_rows_equals_the_layers_one_by_one(family, method, dtype):
    model = model_with(CONFIGS[family], method, dtype)
    a, b = random_adapter(model, 1, 4, "o_proj"), random_adapter(model, 2, 8, "gate_up_proj")
    # decode_step's sequences: 1, 1, 1 and 3 rows; the second on the base model
    batch = LoRABatch.build([a, None, b, a], [1, 1, 1, 3], torch.device("cpu"))
    native = NativeDecoder(OPS)
    logits, kv = lora_step(model, native, batch)
    assert native._stacks[model] is not None, "the native loop ran"
    want_logits, want_kv = lora_step(model, None, batch)
    assert torch.equal(logits, want_logits)
    assert all(torch.equal(x, y) for x, y in zip(kv, want_kv, strict=True))
    base_logits, _ = lora_step(model, native, None)
    assert torch.equal(base_logits[1], logits[1]) and not torch.equal(base_logits[0], logits[0])

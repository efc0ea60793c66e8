"""The linear-method seam: every linear layer multiplies through its method, chosen once after loading."""

from __future__ import annotations

import pytest
import torch

from iterserve.models.linear import DENSE, LinearBase, LinearMethod, process_weights
from iterserve.models.loader import load_model
from tests.models.test_llama import FAMILIES, hf_pair, run_ours

SMOL = "random:smollm2-135m?num_layers=2&vocab_size=4800"


class TransposedLinear(LinearMethod):
    """Keeps its own ``[in, out]`` copy of the weight and counts its calls: a stand-in for a packed format."""

    name = "transposed"

    def __init__(self) -> None:
        self.calls = 0

    def process_weights(self, layer: LinearBase) -> None:
        layer.weight_t = layer.weight.detach().t().contiguous()

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out = x @ layer.weight_t
        return out if layer.bias is None else out + layer.bias


class Refuses(LinearMethod):
    name = "refuses"

    def supports(self, layer: LinearBase) -> bool:
        return False

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("never applied")


def test_load_model_gives_every_linear_layer_a_method():
    model = load_model(SMOL, "float32", "cpu").model
    linears = {n: m for n, m in model.named_modules() if isinstance(m, LinearBase)}
    assert len(linears) == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the LM head
    assert all(m.method is not None for m in linears.values())


@pytest.mark.parametrize("family", ["llama2-mha-untied", "qwen2-qkv-bias", "smollm2-tied"])
def test_a_plugged_in_method_serves_every_layer_and_matches_transformers(family):
    hf, ours = hf_pair(FAMILIES[family])
    method = TransposedLinear()
    chosen = process_weights(ours, lambda layer: method)
    assert set(chosen.values()) == {"transposed"} and len(chosen) == 2 * 4 + 1
    ids = torch.randint(0, ours.config.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    got = run_ours(ours, ids, [7, 3, 1, 1])
    assert method.calls == 4 * len(chosen)  # four steps, every layer through the method
    want = hf(ids[None]).logits[0]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_a_method_that_cannot_serve_a_layer_is_refused_by_name():
    _, ours = hf_pair(FAMILIES["llama2-mha-untied"])
    with pytest.raises(ValueError, match="'refuses' cannot serve layer 'layers.0.self_attn.qkv_proj'"):
        process_weights(ours, lambda layer: Refuses())


def test_layers_start_on_the_dense_reference():
    _, ours = hf_pair(FAMILIES["llama2-mha-untied"])
    assert all(m.method is DENSE for m in ours.modules() if isinstance(m, LinearBase))

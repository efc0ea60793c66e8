"""How a linear layer multiplies: the seam between the model's layers and the matmul kernels.

Every linear layer (:class:`LinearBase`, the base of the sharded layers of :mod:`iterserve.distributed.layers`:
q/k/v, o, gate/up, down, the LM head) holds a :class:`LinearMethod`, in the shape vLLM gives its own:
``process_weights(layer)`` runs once after the weights are loaded (to pre-pack or re-lay them out for a kernel,
or to quantize them), and ``apply(layer, x)`` computes ``x @ W^T (+ bias)`` at run time. The layer never calls
a matmul itself, so a new weight format (packed for a BLAS, quantized blocks) is one new method, not an edit
of every layer.

:func:`process_weights` walks a loaded model and gives each layer its method: the one a
:class:`MethodChooser` picked for the layer's shape and dtype (on a CPU,
:func:`iterserve.models.cpu_linear.default_chooser` measures them). The layer and its method live in one
module because each names the other.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from iterserve.models.native_decoder import LinearKind, NativeLinear, NativeLoRA
from iterserve.quantization.packed import QuantizedWeight

logger = logging.getLogger(__name__)


class LinearDelta(Protocol):
    """What a step adds to some rows of a linear layer's output (each request's LoRA adapter:
    :class:`iterserve.lora.batch.LoRABatch`), passed explicitly with the step's activations."""

    def add(self, layer: LinearBase, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (``layer``'s product of ``x``) with the step's additions to its rows."""
        ...

    def native(self, layers: list[LinearBase]) -> NativeLoRA | None:
        """The tensors with which a native decode loop makes the same additions to ``layers``, in order; None
        where it cannot (the layers then run in Python)."""
        ...


class LinearMethod:
    """One way to compute a linear layer; stateless: whatever it prepares lives on the layer."""

    name: str = ""
    keeps_weight: bool = True
    """False when ``apply`` reads only what ``process_weights`` made: the plain weight is then released
    (unless another module shares it, as a tied embedding does), so the model holds one copy of it."""

    def supports(self, layer: LinearBase) -> bool:
        """Whether this method can serve ``layer`` (its dtype, device, shape) on this machine."""
        return True

    def process_weights(self, layer: LinearBase) -> None:
        """Prepare the layer's weights once, after loading (pack, re-lay out, quantize); nothing by default."""

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        """``x [rows, in_features] -> [rows, out_features]``: ``x @ layer.weight^T``, plus the bias if any."""
        raise NotImplementedError

    def logits(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        """``apply`` in float32, for the LM head: a method whose kernel accumulates in float32 returns its sums
        unrounded (bf16's steps of 0.125 at a logit of 25 tie close candidates); by default ``apply``'s, widened."""
        return self.apply(layer, x).float()

    def dense_weight(self, layer: LinearBase) -> torch.Tensor:
        """The layer's ``[out, in]`` weight as ``F.linear`` takes it, rebuilt from the method's own format
        if it released the plain one (for inspection and tests, not for the hot path)."""
        return layer.weight

    def native(self, layer: LinearBase) -> NativeLinear | None:
        """How the native decode loop (:mod:`iterserve.models.native_decoder`) multiplies this layer in C++, or
        None where it cannot (a method with no C++ kernel: the step then runs the layers in Python)."""
        return None


class DenseLinear(LinearMethod):
    """``F.linear`` on the plain ``[out, in]`` weight: the reference every other method must match."""

    name = "dense"

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)

    def native(self, layer: LinearBase) -> NativeLinear | None:
        if not layer.weight.is_cpu:
            return None
        return NativeLinear(LinearKind.DENSE, [layer.weight], layer.out_features, layer.bias)


DENSE = DenseLinear()

MethodChooser = Callable[["LinearBase"], LinearMethod]
"""Picks the method of one layer (called once per layer, after loading)."""


def dense_chooser(layer: LinearBase) -> LinearMethod:
    return DENSE


def process_weights(model: nn.Module, choose: MethodChooser) -> dict[str, str]:
    """Give every linear layer of ``model`` its method (``choose``'s pick) and let the method prepare the
    weights; returns ``{layer name: method name}`` (also logged) so a run can say which kernels it used."""
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    chosen: dict[str, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            method = choose(module)
            if not method.supports(module):
                raise ValueError(f"linear method {method.name!r} cannot serve layer {name!r}")
            module.method = method
            method.process_weights(module)
            if not method.keeps_weight and uses[id(module.weight)] == 1:
                module.release_weight()
            chosen[name] = method.name
    if chosen:
        counts: dict[str, int] = {}
        for m in chosen.values():
            counts[m] = counts.get(m, 0) + 1
        logger.info("linear methods: %s", ", ".join(f"{m} x{n}" for m, n in sorted(counts.items())))
    return chosen


class LinearBase(nn.Linear):
    """A linear layer whose product is computed by its :class:`LinearMethod` (``F.linear`` until
    :func:`process_weights` gives it another): the one place kernels plug in."""

    method: LinearMethod = DENSE
    qweight: QuantizedWeight | None = None  # the weight in quantized blocks (iterserve.quantization), if it is

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's ``x @ W^T (+ bias)``, before any communication."""
        return self.method.apply(self, x)

    def dense_weight(self) -> torch.Tensor:
        """This rank's ``[out, in]`` weight, whatever format the method keeps it in."""
        return self.method.dense_weight(self)

    def release_weight(self) -> None:
        """Drop the plain weight's memory once the method holds its own copy; its shape and dtype stay."""
        w = self.weight
        self.weight = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)

    def forward(self, x: torch.Tensor, delta: LinearDelta | None = None) -> torch.Tensor:
        out = self.matmul(x)
        return out if delta is None else delta.add(self, x, out)

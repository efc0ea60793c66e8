"""The attention backend: how one layer's attention, and the fused operations around it, are computed.

A backend is chosen once, for the device the model runs on (:func:`iterserve.attention.selector.select_backend`),
and travels with each step's :class:`~iterserve.attention.metadata.AttentionMetadata` as an argument of
the model's forward pass; no layer reads a global to decide. Three exist:

* :class:`~iterserve.attention.reference.ReferenceBackend`: PyTorch only, the ground truth the others are
  tested against, and what runs without the C++ kernels (``ITERSERVE_CPU_KERNELS=0``);
* :class:`~iterserve.attention.cpu.CpuBackend`: the C++ CPU kernels (:mod:`iterserve.kernels`);
* :class:`~iterserve.attention.cuda.CudaBackend`: CUDA tensors, decode attention through PyTorch's SDPA.

Besides attention a backend computes the decoder's other fused operations (RMSNorm with the residual
add, RoPE, SiLU-and-multiply), so that the kernel-or-reference choice is made in this one place; the CPU
backend can also run a decode step's whole layer stack in one native call (``decode_layers``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import ModuleType
from typing import Any, Protocol

import torch

from iterserve.attention.metadata import AttentionMetadata, KVCache

# A step's LoRA weights for a native decode loop: for every linear layer (qkv, o, gate/up and down of each
# decoder layer in turn) each adapter's packed A (None where that adapter leaves the layer alone, empty lists
# where all do), then the packed parts of their B and what each covers, and each row's adapter (None: all rows
# have the step's one adapter) (:meth:`iterserve.lora.batch.LoRABatch.native`).
NativeLoRA = tuple[list[list[torch.Tensor | None]], list[list[torch.Tensor]], list[list[int]], torch.Tensor | None]


class AttentionBackend(ABC):
    """One way of computing a decoder layer's attention and its fused operations."""

    name: str
    decode_prompts_up_to: int = 0
    """Prompt chunks of sequences holding at most this many tokens are attended like decodes, each token over
    its own prefix, by the decode kernel instead of the prefill path (:meth:`AttentionMetadata.build`)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """Write this step's K/V (``[num_tokens, kv_heads, head_dim]``) into the cache, then attend; returns
        ``[num_tokens, num_heads, head_dim]`` for the queries ``q``."""

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of the last dimension, normalised in float32 and cast back before the weight."""

    @abstractmethod
    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual + x`` (the new residual stream) and its RMSNorm: ``(normed, new_residual)``."""

    @abstractmethod
    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` and ``k`` rotated by RoPE (rotate-half convention); ``cos``/``sin`` are ``[tokens, 1, head_dim]``."""

    @abstractmethod
    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a ``[tokens, 2 * width]`` tensor holding ``[gate | up]``."""

    def keys_in_groups(self, dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
        """Whether this backend reads a K cache of this kind in key groups (:meth:`KVCache.allocate`)."""
        return False

    def decode_layers(self, model: NativeDecoderModel, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      kv_caches: list[KVCache], meta: AttentionMetadata,
                      lora: NativeLoRA | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """All of ``model``'s decoder layers for a step whose every token is a decode, in one native call:
        ``(output, residual)`` as the last layer returns them; None where this backend has no such loop for
        the step or the model (the layers then run one by one). ``lora``: the step's LoRA rows."""
        return None


class NativeDecoderModel(Protocol):
    """A model that can hand its layers to a backend's native decode loop."""

    def native_decoder(self, ops: ModuleType) -> Any:
        """The loop built from ``ops`` (the kernels' extension), or None where a layer has no native kernel."""

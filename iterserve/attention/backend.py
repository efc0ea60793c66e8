"""The attention backend: how one layer writes its K/V into the paged cache and attends.

A backend is chosen once, for the device the model runs on (:func:`iterserve.attention.selector.select_backend`),
and travels with each step's :class:`~iterserve.attention.metadata.AttentionMetadata` as an argument of
the model's forward pass; no layer reads a global to decide. Three exist:

* :class:`~iterserve.attention.reference.ReferenceBackend`: PyTorch only, the ground truth the others are
  tested against, and what runs without the C++ kernels (``ITERSERVE_CPU_KERNELS=0``);
* :class:`~iterserve.attention.cpu.CpuBackend`: the C++ CPU kernels (:mod:`iterserve.kernels`);
* :class:`~iterserve.attention.cuda.CudaBackend`: CUDA tensors, decode attention through PyTorch's SDPA.

Each carries the op set of its device (:mod:`iterserve.platforms.ops`), where the layers find the fused
operations around attention (RMSNorm with the residual add, RoPE, SiLU-and-multiply): the kernel-or-reference
choice is made there, once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from iterserve.attention.metadata import AttentionMetadata, KVCache
from iterserve.platforms.ops import ReferenceOps


class AttentionBackend(ABC):
    """One way of writing a layer's K/V and attending."""

    name: str
    ops: ReferenceOps
    """The op set of this backend's device: the layers' norms, RoPE and activation."""
    decode_prompts_up_to: int = 0
    """Prompt chunks of sequences holding at most this many tokens are attended like decodes, each token over
    its own prefix, by the decode kernel instead of the prefill path (:meth:`AttentionMetadata.build`)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """Write this step's K/V (``[num_tokens, kv_heads, head_dim]``) into the cache, then attend; returns
        ``[num_tokens, num_heads, head_dim]`` for the queries ``q``."""

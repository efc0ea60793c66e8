"""The one choice of attention backend, made once for the device a model runs on."""

from __future__ import annotations

import torch

from iterserve import kernels
from iterserve.attention.backend import AttentionBackend
from iterserve.attention.cpu import CpuBackend
from iterserve.attention.cuda import CudaBackend
from iterserve.attention.reference import ReferenceBackend
from iterserve.platforms.invariance import batch_invariant


def select_backend(device: torch.device | str, dtype: torch.dtype | None = None) -> AttentionBackend:
    """CUDA tensors get :class:`CudaBackend`; CPU tensors the C++ kernels when they are built and not turned
    off (``ITERSERVE_CPU_KERNELS=0``), batch-invariant for a model in ``dtype`` where
    :func:`~iterserve.platforms.invariance.batch_invariant` asks; everything else the PyTorch reference."""
    kind = torch.device(device).type
    if kind == "cuda":
        return CudaBackend()
    if kind == "cpu" and kernels.ops is not None:
        return CpuBackend(kernels.ops, batch_invariant=dtype is not None and batch_invariant(dtype))
    return ReferenceBackend()

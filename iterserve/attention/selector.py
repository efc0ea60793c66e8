"""The one choice of attention backend, made once for the device a model runs on."""

from __future__ import annotations

import torch

from iterserve import kernels
from iterserve.attention.backend import AttentionBackend
from iterserve.attention.cpu import CpuBackend
from iterserve.attention.cuda import CudaBackend
from iterserve.attention.reference import ReferenceBackend


def select_backend(device: torch.device | str) -> AttentionBackend:
    """CUDA tensors get :class:`CudaBackend`; CPU tensors the C++ kernels when they are built and not turned
    off (``ITERSERVE_CPU_KERNELS=0``); everything else the PyTorch reference."""
    kind = torch.device(device).type
    if kind == "cuda":
        return CudaBackend()
    if kind == "cpu" and kernels.ops is not None:
        return CpuBackend(kernels.ops)
    return ReferenceBackend()

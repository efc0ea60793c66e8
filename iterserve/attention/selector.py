"""The one choice of attention backend, made once for the device a model runs on."""

from __future__ import annotations

import torch

from iterserve.attention.backend import AttentionBackend
from iterserve.attention.cpu import CpuBackend
from iterserve.attention.cuda import CudaBackend
from iterserve.attention.reference import ReferenceBackend
from iterserve.platforms.invariance import batch_invariant
from iterserve.platforms.ops import CpuOps, ops_for


def select_backend(device: torch.device | str, dtype: torch.dtype | None = None) -> AttentionBackend:
    """CUDA tensors get :class:`CudaBackend`; CPU tensors the C++ kernels where the device's op set is theirs
    (:mod:`iterserve.platforms.ops`), batch-invariant for a model in ``dtype`` where
    :func:`~iterserve.platforms.invariance.batch_invariant` asks; everything else the PyTorch reference."""
    ops = ops_for(device)
    if torch.device(device).type == "cuda":
        return CudaBackend()
    if isinstance(ops, CpuOps):
        return CpuBackend(ops, batch_invariant=dtype is not None and batch_invariant(dtype))
    return ReferenceBackend()

"""Switching the CPU's op set (iterserve.platforms.ops) for one test: the kernels' path or the reference."""

from __future__ import annotations

from types import ModuleType

import pytest

from iterserve.platforms import ops


def use_kernels(monkeypatch: pytest.MonkeyPatch, extension: ModuleType | None) -> None:
    """CPU tensors get the kernels of ``extension`` (the loaded build), or the PyTorch reference for None, as
    a process with ``ITERSERVE_CPU_KERNELS=0`` would."""
    monkeypatch.setattr(ops, "CPU", ops.CpuOps(extension) if extension is not None else ops.REFERENCE)

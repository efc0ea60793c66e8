"""Where this process sits in a tensor-parallel group: passed explicitly to every layer that splits.

The default, ``ParallelState()``, is one rank alone: the layers then hold whole weights and run no
collective, so the single-process engine pays nothing for the option.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelState:
    """``rank`` of ``world_size``; ``group`` carries the forward pass's collectives (None when alone)."""

    rank: int = 0
    world_size: int = 1
    group: Any = None  # torch.distributed.ProcessGroup

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.world_size}")

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (the one collective of a row-parallel layer)."""
        if self.is_parallel:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dimension on rank 0; an empty tensor elsewhere."""
        if not self.is_parallel:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else x.new_empty(0)

    def shard_range(self, size: int) -> tuple[int, int]:
        """This rank's rows ``[start, start + n)`` of ``size`` rows split evenly (``size`` divides)."""
        n = size // self.world_size
        return self.rank * n, n

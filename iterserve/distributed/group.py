"""Joining a tensor-parallel group, on one node (ranks the engine starts) or under torchrun.

Two process groups: the default one carries the forward pass's all-reduces and gathers (NCCL on CUDA, gloo
on CPU) with a bounded timeout, so a rank that stops answering fails the step instead of hanging it; a gloo
group with no practical timeout carries each step's inputs from rank 0, so that workers may wait for the
next step as long as the engine idles (rank 0's own side of it is bounded once the workers are ready). A
rank that dies closes its sockets, which fails gloo collectives at once; the timeouts are the bound when a
rank hangs instead.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from iterserve.distributed.parallel_state import ParallelState

COLLECTIVE_TIMEOUT = timedelta(seconds=60)  # a forward-pass collective or the start-up rendezvous
STEP_WAIT_TIMEOUT = timedelta(days=365)  # a worker waiting for rank 0's next step
# Rank 0 sending a step: the workers take it as soon as their previous forward pass ends, so a longer wait
# means a worker hangs.
STEP_SEND_TIMEOUT = COLLECTIVE_TIMEOUT


@dataclass(frozen=True)
class Launch:
    """How this process joins: its rank, the group's size, and where the ranks meet."""

    rank: int
    world_size: int
    init_method: str  # tcp://host:port, or env:// under torchrun
    local_rank: int = 0
    local_world_size: int = 1  # ranks on this node (they share its cores)


def torchrun_launch(environ: Mapping[str, str] | None = None) -> Launch | None:
    """The launch torchrun describes in the environment (RANK, WORLD_SIZE, LOCAL_RANK, ...), or None."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" not in env or "RANK" not in env:
        return None
    world = int(env["WORLD_SIZE"])
    return Launch(rank=int(env["RANK"]), world_size=world, init_method="env://",
                  local_rank=int(env.get("LOCAL_RANK", "0")), local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)))


def rank_device(device: str | None, local_rank: int) -> str:
    """This rank's device: its own GPU (``cuda:LOCAL_RANK``) where CUDA is used, else the CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return f"cuda:{local_rank}" if device.startswith("cuda") else device


def share_cores(local_world_size: int) -> None:
    """Give this rank its share of the node's cores, so that N ranks do not oversubscribe them."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))


def join_group(launch: Launch, device: str) -> tuple[ParallelState, Any]:
    """Join the group (blocks until every rank has); returns this rank's state and the step group."""
    if dist.is_initialized():
        raise ValueError("this process already belongs to a torch.distributed group: one tensor-parallel "
                         "engine per process (close the other first)")
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=launch.init_method, rank=launch.rank,
                            world_size=launch.world_size, timeout=COLLECTIVE_TIMEOUT)
    group = dist.group.WORLD
    steps = dist.new_group(backend="gloo", timeout=STEP_WAIT_TIMEOUT)
    return ParallelState(launch.rank, launch.world_size, group), steps


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

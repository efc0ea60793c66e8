"""Rank 0's side of tensor parallelism: start the workers, send each step's inputs, watch the workers.

On one node the engine starts ``tensor_parallel_size - 1`` worker processes itself (``python -m
iterserve.distributed.worker``: plain subprocesses, because the server's engine core is a daemonic process,
which multiprocessing forbids to have children); under torchrun they are the launcher's other ranks. The
scheduler, the block manager and the sampler run here only; each step's :class:`StepInputs` are broadcast
and every rank runs the forward pass on its shard.

A worker that dies makes the next step (or the one in flight) raise :class:`TensorParallelError` naming
it; so does any failure inside a step, since the ranks are then out of step, and a worker that hangs
(its step not taken within ``STEP_SEND_TIMEOUT``, a collective not answered within the group's timeout).
The engine does not go on.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from iterserve.config import EngineConfig
from iterserve.distributed.group import (
    STEP_SEND_TIMEOUT,
    Launch,
    join_group,
    leave_group,
    rank_device,
    share_cores,
    torchrun_launch,
)
from iterserve.distributed.parallel_state import ParallelState
from iterserve.engine.model_runner import StepInputs
from iterserve.errors import TensorParallelError

logger = logging.getLogger(__name__)

DEATH_WAIT_S = 2.0  # after a failed collective: how long to wait for a worker's exit to show


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_command(config: EngineConfig, launch: Launch) -> list[str]:
    """The command line of a worker this engine starts (its config travels as JSON)."""
    return [sys.executable, "-m", "iterserve.distributed.worker", "--rank", str(launch.rank),
            "--world-size", str(launch.world_size), "--init-method", launch.init_method,
            "--parent-pid", str(os.getpid()), "--config", json.dumps(dataclasses.asdict(config))]


class Executor:
    """Holds the group from rank 0's side; see :meth:`start`."""

    def __init__(self, parallel: ParallelState, steps: Any, workers: dict[int, subprocess.Popen[bytes]],
                 device: str, threads: int) -> None:
        self.parallel = parallel
        self.device = device
        self._steps = steps
        self._workers = workers
        self._threads = threads  # this process's torch threads before its share of the cores
        self._error: TensorParallelError | None = None
        self._closed = False
        atexit.register(self.close)

    @classmethod
    def start(cls, config: EngineConfig) -> Executor:
        """Join (under torchrun) or start (one node) the group of ``config.tensor_parallel_size`` ranks as
        rank 0. Call :meth:`ready` once this rank's shard is loaded."""
        tp = config.tensor_parallel_size
        launch = torchrun_launch()
        workers: dict[int, subprocess.Popen[bytes]] = {}
        if launch is not None:
            if launch.world_size != tp:
                raise ValueError(f"torchrun started {launch.world_size} ranks but tensor_parallel_size is {tp}; "
                                 "give --tensor-parallel-size the launcher's total number of processes")
            if launch.rank != 0:
                raise ValueError(f"rank {launch.rank} runs a worker, not the engine")
        else:
            launch = Launch(0, tp, f"tcp://127.0.0.1:{_free_port()}", 0, tp)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                [str(Path(__file__).resolve().parents[2]), *filter(None, [os.environ.get("PYTHONPATH")])])}
            for rank in range(1, tp):
                cmd = worker_command(config, dataclasses.replace(launch, rank=rank, local_rank=rank))
                workers[rank] = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
        threads = torch.get_num_threads()
        share_cores(launch.local_world_size)
        device = rank_device(config.device, launch.local_rank)
        try:
            parallel, steps = join_group(launch, device)
        except Exception:
            torch.set_num_threads(threads)
            for proc in workers.values():
                proc.kill()
            raise
        logger.info("tensor parallelism: rank 0 of %d (%s, %s)", tp, device,
                    "torchrun" if not workers else f"workers {[p.pid for p in workers.values()]}")
        return cls(parallel, steps, workers, device, threads)

    def ready(self) -> None:
        """Wait until every rank has loaded its shard (a worker that failed to is reported here); from then
        on a worker that hangs, alive but answering nothing, fails the next step instead of blocking rank 0
        in the step broadcast for good."""
        self._guard(lambda: dist.barrier(group=self._steps))
        self._steps.set_timeout(STEP_SEND_TIMEOUT)

    def execute(self, inputs: StepInputs, forward: Callable[[StepInputs], torch.Tensor]) -> torch.Tensor:
        """Send ``inputs`` to the workers, then run this rank's forward pass; the logits."""

        def step() -> torch.Tensor:
            dist.broadcast_object_list([inputs], src=0, group=self._steps)
            return forward(inputs)

        return self._guard(step)

    def _guard(self, fn: Callable[[], Any]) -> Any:
        if self._error is not None:
            raise self._error
        self._check_workers()
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - any failure mid-step leaves the ranks out of step
            deadline = time.monotonic() + DEATH_WAIT_S
            while time.monotonic() < deadline and not self._dead_workers():
                time.sleep(0.05)
            self._check_workers()
            self._error = TensorParallelError(f"a tensor-parallel step failed ({type(e).__name__}: {e}); the "
                                              "ranks are out of step and the engine cannot continue")
            raise self._error from e

    def _dead_workers(self) -> list[tuple[int, subprocess.Popen[bytes]]]:
        return [(rank, p) for rank, p in self._workers.items() if p.poll() is not None]

    def _check_workers(self) -> None:
        dead = self._dead_workers()
        if dead:
            rank, proc = dead[0]
            self._error = TensorParallelError(
                f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {proc.returncode}; "
                "the engine cannot continue without its shard")
            raise self._error

    @property
    def worker_pids(self) -> dict[int, int]:
        return {rank: p.pid for rank, p in self._workers.items()}

    def abort(self) -> None:
        """Stop the workers at once: rank 0 could not start, and they may be waiting in a collective."""
        self._error = self._error or TensorParallelError("rank 0 stopped the tensor-parallel group")
        self.close()

    def close(self, timeout: float = 10.0) -> None:
        """Tell the workers to exit and wait for them, leave the group; after a failure the workers may
        be stuck in a collective, so they are killed at once."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self._error is None:
            try:
                dist.broadcast_object_list([None], src=0, group=self._steps)
            except Exception:  # noqa: BLE001 - a worker already gone; the others are killed below
                logger.warning("could not tell the tensor-parallel workers to stop")
        else:
            timeout = 0.0
        deadline = time.monotonic() + timeout
        for proc in self._workers.values():
            try:
                proc.wait(max(0.01, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
                proc.wait(5)
        leave_group()
        torch.set_num_threads(self._threads)

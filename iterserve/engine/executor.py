"""The executor: what runs the model for :class:`~iterserve.engine.core.EngineCore`, one step at a time.

EngineCore schedules and keeps every request's state; each step it hands the scheduled sequences to its
executor, which runs them through the model on its :class:`Worker` (or workers) and returns the samples.
Two executors run the real model: :class:`UniProcExecutor`, one worker in this process, and
:class:`MultiprocExecutor`, tensor parallelism with this process as rank 0. Another executor (a cost model
on a virtual clock, say) plugs in by implementing :class:`Executor`.

Under tensor parallelism the engine starts ``tensor_parallel_size - 1`` worker processes itself on one
node (``python -m iterserve.cli.worker``: plain subprocesses, because the server's engine core is a
daemonic process, which multiprocessing forbids to have children); under torchrun they are the launcher's
other ranks. The scheduler, the block manager and the sampler run on rank 0 only; each step's
:class:`StepInputs` are broadcast and every rank runs the forward pass on its shard.

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
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from iterserve.config import EngineConfig, ModelConfig
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
from iterserve.engine.capacity import Capacity
from iterserve.engine.sampler import SampleResult
from iterserve.engine.scheduler import ScheduledSeq
from iterserve.engine.sequence import Sequence
from iterserve.engine.worker import Worker
from iterserve.errors import TensorParallelError
from iterserve.lora.request import LoRARequest
from iterserve.models.loader import LoadedModel, load_model_info
from iterserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DEATH_WAIT_S = 2.0  # after a failed collective: how long to wait for a worker's exit to show


class Executor(ABC):
    """Runs the model for an engine core: what the model is, how much KV cache it has, and one step at a time.

    The attributes are what the core needs before the first step: the model's shape, its tokenizer (None
    when it has none) and name, the KV pool's :class:`Capacity`, the dtype of the weights and KV cache, and
    the device a seeded request's sampling generator lives on.
    """

    model_config: ModelConfig
    tokenizer: Tokenizer | None
    model_name: str
    capacity: Capacity
    dtype: torch.dtype
    device: torch.device
    worker: Worker  # this process's worker, where the executor has one

    @abstractmethod
    def execute_model(self, scheduled: list[ScheduledSeq], block_copies: list[tuple[int, int]],
                      window_copies: list[tuple[int, int]] | None = None) -> SampleResult:
        """One step: copy ``block_copies`` and ``window_copies`` (copy-on-write in the full and the windowed
        layers' pools), run the forward pass of ``scheduled``, sample."""

    def add_lora(self, lora: LoRARequest) -> None:
        """Load (or find loaded) and check the LoRA adapter a new request names; ValueError if it cannot run."""
        raise ValueError(f"{type(self).__name__} runs no LoRA adapters")

    def propose_drafts(self, seqs: list[Sequence], limits: list[int],
                       block_copies: list[tuple[int, int]]) -> list[list[int]]:
        """Speculative decoding's draft model: after ``block_copies``, up to ``limits[i]`` drafts for ``seqs[i]``."""
        raise ValueError(f"{type(self).__name__} runs no draft model")

    @abstractmethod
    def close(self) -> None:
        """Release what the executor holds (its worker processes)."""

    def abort(self) -> None:
        """The engine core could not start: stop at once."""
        self.close()

    def _use(self, worker: Worker) -> None:
        """Describe the model and the KV pool of this process's worker."""
        self.worker = worker
        loaded = worker.loaded
        self.model_config, self.tokenizer, self.model_name = loaded.config, loaded.tokenizer, loaded.name
        self.capacity = worker.capacity
        self.dtype = loaded.model.dtype
        self.device = worker.runner.device


class UniProcExecutor(Executor):
    """The whole model in this process, on one worker."""

    def __init__(self, worker: Worker) -> None:
        self._use(worker)

    def execute_model(self, scheduled: list[ScheduledSeq], block_copies: list[tuple[int, int]],
                      window_copies: list[tuple[int, int]] | None = None) -> SampleResult:
        return self.worker.execute_model(scheduled, block_copies, window_copies)

    def add_lora(self, lora: LoRARequest) -> None:
        self.worker.runner.add_lora(lora)

    def propose_drafts(self, seqs: list[Sequence], limits: list[int],
                       block_copies: list[tuple[int, int]]) -> list[list[int]]:
        return self.worker.propose_drafts(seqs, limits, block_copies)

    def close(self) -> None:
        """Nothing to release: the model and its KV cache go with the worker."""


def start_executor(config: EngineConfig, loaded: LoadedModel | None = None) -> Executor:
    """The executor ``config`` asks for: tensor parallelism over ``tensor_parallel_size`` ranks, else one
    worker in this process (on ``loaded``, a model already in memory, when given)."""
    if config.tensor_parallel_size == 1:
        return UniProcExecutor(Worker(config, loaded) if loaded is not None else Worker.load(config, config.device))
    if loaded is not None:
        raise ValueError("loaded= shares one process's whole model; it cannot be combined with "
                         "tensor_parallel_size > 1, where each rank loads its shard")
    # a model that does not split is refused here, before any worker starts to find out alone
    load_model_info(config.model)[0].tensor_parallel_shard(config.tensor_parallel_size)
    return MultiprocExecutor.start(config)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_command(config: EngineConfig, launch: Launch) -> list[str]:
    """The command line of a worker this engine starts (its config travels as JSON)."""
    return [sys.executable, "-m", "iterserve.cli.worker", "--rank", str(launch.rank),
            "--world-size", str(launch.world_size), "--init-method", launch.init_method,
            "--parent-pid", str(os.getpid()), "--config", json.dumps(dataclasses.asdict(config))]


class MultiprocExecutor(Executor):
    """Tensor parallelism from rank 0's side: this process's :class:`Worker` holds the first shard, the
    other ranks run in worker processes; see :meth:`start`."""

    def __init__(self, parallel: ParallelState, steps: Any, workers: dict[int, subprocess.Popen[bytes]],
                 threads: int) -> None:
        self.parallel = parallel
        self._steps = steps
        self._workers = workers
        self._threads = threads  # this process's torch threads before its share of the cores
        self._error: TensorParallelError | None = None
        self._closed = False
        atexit.register(self.close)

    @classmethod
    def start(cls, config: EngineConfig) -> MultiprocExecutor:
        """Join (under torchrun) or start (one node) the group of ``config.tensor_parallel_size`` ranks as
        rank 0, load this rank's shard, and wait until every rank has loaded its own."""
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
        executor = cls(parallel, steps, workers, threads)
        try:
            executor._use(Worker.load(config, device, parallel))
            executor._ready()
        except BaseException:
            executor.abort()
            raise
        return executor

    def _ready(self) -> None:
        """Wait until every rank has loaded its shard (a worker that failed to is reported here); from then
        on a worker that hangs, alive but answering nothing, fails the next step instead of blocking rank 0
        in the step broadcast for good."""
        self._guard(lambda: dist.barrier(group=self._steps))
        self._steps.set_timeout(STEP_SEND_TIMEOUT)

    def execute_model(self, scheduled: list[ScheduledSeq], block_copies: list[tuple[int, int]],
                      window_copies: list[tuple[int, int]] | None = None) -> SampleResult:
        """Prepare the step's inputs here, send them to the workers, run this rank's forward pass, sample here."""
        runner = self.worker.runner
        prepared = runner.prepare(scheduled, block_copies, window_copies)

        def step() -> torch.Tensor:
            dist.broadcast_object_list([prepared.inputs], src=0, group=self._steps)
            return runner.forward(prepared.inputs)

        return runner.sample(prepared, self._guard(step))

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

"""A worker: one rank's shard of the model, the KV pool sized for it, and the runner that drives them.

The executor holds this process's worker (rank 0, or the only one). Under tensor parallelism every other rank
is a worker process started by the engine on one node (``python -m iterserve.cli.worker``) or by the CLI
under torchrun: :func:`run_worker` loads its shard, then runs the forward pass on every step rank 0 sends.
It has no scheduler, no sampler and no HTTP; it ends when rank 0 says so, when rank 0 goes away (its
collectives fail, or its parent process is gone), or on any error.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from iterserve import kernels
from iterserve.config import EngineConfig
from iterserve.distributed.group import Launch, join_group, leave_group, rank_device, share_cores
from iterserve.distributed.parallel_state import ParallelState
from iterserve.engine.capacity import Capacity
from iterserve.engine.model_runner import ModelRunner, StepInputs
from iterserve.engine.sampler import SampleResult
from iterserve.engine.scheduler import ScheduledSeq
from iterserve.engine.sequence import Sequence
from iterserve.engine.spec_decode.draft import load_draft
from iterserve.lora.manager import LoRAManager
from iterserve.models.loader import LoadedModel, load_model
from iterserve.platforms.malloc import release_free_heap, tune_allocator

logger = logging.getLogger(__name__)


class Worker:
    """``loaded`` is this rank's shard (the whole model with one rank); the KV pool is sized from it."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel) -> None:
        if loaded.model.device.type == "cpu":
            prepare_cpu()
        self.loaded = loaded
        spec = config.speculative_config
        self.draft = load_draft(spec.model, loaded, config.seed, spec.quantization) if spec and spec.model else None
        self.capacity = Capacity.of(config, loaded.config, loaded.model.dtype.itemsize,
                                    self.draft.config if self.draft else None)
        lora = LoRAManager(loaded.model, config.max_loras, config.max_lora_rank) if config.enable_lora else None
        self.runner = ModelRunner(loaded.model, self.capacity.num_blocks, config.block_size, config.seed,
                                  self.draft.model if self.draft else None, config.kv_cache_dtype, lora,
                                  self.capacity.window_blocks)

    @classmethod
    def load(cls, config: EngineConfig, device: str | None, parallel: ParallelState | None = None) -> Worker:
        """Load ``config.model`` (the shard ``parallel`` names) onto ``device``."""
        on_cpu = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cpu")
        if on_cpu:
            prepare_cpu()  # before loading: the linear methods are timed on the threads they will run on
        # under tensor parallelism rank 0 alone draws the load's progress
        progress = config.load_progress and (parallel is None or parallel.rank == 0)
        loaded = load_model(config.model, config.dtype, device, config.seed, parallel=parallel,
                            quantization=config.quantization, progress=progress)
        if on_cpu:
            release_free_heap()  # memory held is the weights', not the load's transients
        return cls(config, loaded)

    def execute_model(self, scheduled: list[ScheduledSeq], block_copies: list[tuple[int, int]],
                      window_copies: list[tuple[int, int]] | None = None) -> SampleResult:
        """One whole step in this process: inputs, forward pass, samples."""
        return self.runner.execute(scheduled, block_copies, window_copies)[1]

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """The forward pass of inputs prepared elsewhere (on rank 0)."""
        return self.runner.forward(inputs)

    def propose_drafts(self, seqs: list[Sequence], limits: list[int],
                       block_copies: list[tuple[int, int]]) -> list[list[int]]:
        """The draft model's next tokens for decoding sequences (speculative decoding)."""
        return self.runner.propose_drafts(seqs, limits, block_copies)


def prepare_cpu() -> None:
    """A CPU worker's process set-up: glibc's malloc tuning (the ``iterserve`` command's, so that ``LLM``
    users get it too) and the C++ kernels' thread pool in place of torch's OpenMP team
    (:func:`iterserve.kernels.run_on_pool`). Both are idempotent."""
    tune_allocator()
    kernels.run_on_pool()


def run_worker(config: EngineConfig, launch: Launch) -> int:
    """Join the group as ``launch.rank`` and serve steps until rank 0 sends the end; the exit status."""
    share_cores(launch.local_world_size)
    device = rank_device(config.device, launch.local_rank)
    parallel, steps = join_group(launch, device)
    try:
        worker = Worker.load(config, device, parallel)
        logger.info("tensor-parallel rank %d of %d ready on %s", launch.rank, launch.world_size, device)
        dist.barrier(group=steps)
        while True:
            box: list[StepInputs | None] = [None]
            dist.broadcast_object_list(box, src=0, group=steps)
            inputs = box[0]
            if inputs is None:
                return 0
            worker.forward(inputs)
    finally:
        leave_group()

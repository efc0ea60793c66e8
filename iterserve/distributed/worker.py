"""A tensor-parallel worker: load this rank's shard, then run the forward pass on every step rank 0 sends.

Started by the engine on one node (``python -m iterserve.distributed.worker``), or by the CLI for every rank
but 0 under torchrun. It has no scheduler, no sampler and no HTTP; it ends when rank 0 says so, when rank 0
goes away (its collectives fail, or its parent process is gone), or on any error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time

import torch.distributed as dist

from iterserve import kernels
from iterserve.config import EngineConfig
from iterserve.distributed.group import Launch, join_group, leave_group, rank_device, share_cores
from iterserve.engine.core import Capacity
from iterserve.engine.model_runner import ModelRunner, StepInputs
from iterserve.models.loader import load_model

logger = logging.getLogger(__name__)

PARENT_CHECK_S = 1.0


def run_worker(config: EngineConfig, launch: Launch) -> int:
    """Join the group as ``launch.rank`` and serve steps until rank 0 sends the end; the exit status."""
    share_cores(launch.local_world_size)
    device = rank_device(config.device, launch.local_rank)
    if device == "cpu":
        kernels.run_on_pool()
    parallel, steps = join_group(launch, device)
    try:
        loaded = load_model(config.model, config.dtype, device, config.seed, parallel=parallel)
        capacity = Capacity.of(config, loaded.config, loaded.model.dtype.itemsize)
        runner = ModelRunner(loaded.model, capacity.num_blocks, config.block_size, config.seed)
        logger.info("tensor-parallel rank %d of %d ready on %s", launch.rank, launch.world_size, device)
        dist.barrier(group=steps)
        while True:
            box: list[StepInputs | None] = [None]
            dist.broadcast_object_list(box, src=0, group=steps)
            inputs = box[0]
            if inputs is None:
                return 0
            runner.forward(inputs)
    finally:
        leave_group()


def _exit_with_parent(parent: int) -> None:
    """A worker the engine started ends when the engine's process does, whatever its collectives do."""
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    os._exit(1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--init-method", required=True)
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--config", required=True, help="the EngineConfig as JSON")
    args = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when its workers stop
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s rank{args.rank} %(name)s: %(message)s")
    threading.Thread(target=_exit_with_parent, args=(args.parent_pid,), daemon=True).start()
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    config = EngineConfig(**{k: v for k, v in json.loads(args.config).items() if k in fields})
    launch = Launch(args.rank, args.world_size, args.init_method, args.rank, args.world_size)
    return run_worker(config, launch)


if __name__ == "__main__":
    sys.exit(main())

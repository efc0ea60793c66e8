"""A tensor-parallel worker process's command line (``python -m iterserve.cli.worker``), as the engine
starts it on one node: its rank, the group's size, where the ranks meet and the engine's config as JSON.
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

from iterserve.config import EngineConfig
from iterserve.distributed.group import Launch
from iterserve.engine.worker import run_worker

PARENT_CHECK_S = 1.0


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

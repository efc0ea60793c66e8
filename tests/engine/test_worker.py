"""A CPU worker sets its process up for the forward pass: malloc tuning, and the kernels' thread pool in place of
torch's OpenMP team. Checked in a fresh process, since both settings are process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import iterserve
from iterserve import kernels

ROOT = Path(iterserve.__file__).resolve().parents[1]

PROBE = """
import json, os, torch
torch.set_num_threads(2)
from iterserve import kernels
from iterserve.config import EngineConfig
from iterserve.engine.worker import Worker
before = torch.get_num_threads()
Worker.load(EngineConfig(model="random:smollm2-135m?num_layers=1&vocab_size=512", dtype="float32",
                         num_kv_blocks=8), "cpu")
again = Worker.load(EngineConfig(model="random:smollm2-135m?num_layers=1&vocab_size=512", dtype="float32",
                                 num_kv_blocks=8), "cpu")
print(json.dumps({"torch": torch.get_num_threads(), "pool": kernels.ops.threads() if kernels.ops else None,
                  "before": before, "malloc": os.environ.get("MALLOC_MMAP_MAX_")}))
"""


def _probe(extra_env: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(PYTHONPATH=str(ROOT), **extra_env)
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, check=True,
                         timeout=300).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(kernels.ops is None, reason="the C++ CPU kernels are not built (or are turned off)")
def test_a_cpu_worker_gives_the_threads_to_the_kernels_pool_and_tunes_malloc():
    got = _probe({})
    # the pool keeps the count torch had before the first worker, also when a second worker is built
    assert got == {"torch": 1, "pool": got["before"], "before": 2, "malloc": "0"}


def test_without_the_kernels_torch_keeps_its_threads():
    got = _probe({"ITERSERVE_CPU_KERNELS": "0"})
    assert got == {"torch": 2, "pool": None, "before": 2, "malloc": "0"}

"""Process-wide settings are explicit: allocator tuning is the CLI's and a CPU worker's (tests/engine/test_worker.py),
never a side effect of building a model or its runner, and importing the chart module leaves matplotlib's backend
alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import iterserve

ROOT = Path(iterserve.__file__).resolve().parents[1]


def _run(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True,
                          timeout=300).stdout.strip()


def test_building_a_model_runner_leaves_the_allocator_alone(monkeypatch):
    import ctypes

    from iterserve.engine.model_runner import ModelRunner
    from iterserve.models.loader import load_model

    opened = []
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: opened.append(a))  # what mallopt would go through
    for name in list(os.environ):
        if name.startswith("MALLOC_"):
            monkeypatch.delenv(name)
    model = load_model("random:smollm2-135m?num_layers=1", "float32", "cpu").model
    ModelRunner(model, 4, 16)
    assert opened == [] and not any(name.startswith("MALLOC_") for name in os.environ)


def test_the_cli_tunes_its_own_process_and_the_processes_it_starts():
    out = _run(
        "import os, subprocess, sys\n"
        "from iterserve.cli.main import main\n"
        "main(['plan', '--list-gpus', '--json'])\n"
        "child = 'import os; print(os.environ[\"MALLOC_MMAP_MAX_\"], os.environ[\"MALLOC_TRIM_THRESHOLD_\"])'\n"
        "print(subprocess.run([sys.executable, '-c', child], capture_output=True, text=True).stdout.strip())\n"
    )
    assert out.splitlines()[-1] == f"0 {1 << 30}"


def test_a_value_the_user_set_wins(monkeypatch):
    from iterserve.platforms.malloc import tune_allocator

    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", str(1 << 28))
    monkeypatch.delenv("MALLOC_MMAP_MAX_", raising=False)
    tune_allocator()
    assert os.environ["MALLOC_TRIM_THRESHOLD_"] == str(1 << 28) and os.environ["MALLOC_MMAP_MAX_"] == "0"


def test_importing_the_charts_keeps_the_matplotlib_backend(tmp_path):
    out = _run(
        "import matplotlib\n"
        "matplotlib.use('svg')\n"
        "import iterserve.bench.charts as charts\n"
        "print(matplotlib.get_backend())\n"
        f"charts.throughput_latency_chart([charts.Series('a', [1.0, 2.0], [3.0, 4.0], ['x', 'y'], knee=1)], "
        f"{str(tmp_path / 'c.png')!r}, xlabel='x', ylabel='y', title='t')\n"
        "print(matplotlib.get_backend())\n"
    )
    assert out.splitlines() == ["svg", "svg"]
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"

"""bench load: every policy is offered the same arrivals at each load (fractions of the measured capacity),
every request is served, and the report and chart say so; timings are never asserted."""

from __future__ import annotations

import json

import pytest

from iterserve.bench.machine import MachineMonitor
from iterserve.bench.offered_load import sweep_offered_load
from iterserve.bench.workloads import WorkloadSpec, make_workload
from iterserve.cli.main import main
from iterserve.config import EngineConfig
from iterserve.models.loader import load_model

TINY = "random:smollm2-135m?num_layers=1"


@pytest.fixture(scope="module")
def loaded():
    return load_model(TINY, dtype="float32", device="cpu")


def test_every_policy_serves_every_request_at_every_load(loaded):
    spec = WorkloadSpec(num_prompts=8, input_len="uniform:4:12", output_len="uniform:1:6", seed=1)
    requests = make_workload(spec, tokenizer=None, vocab_size=loaded.config.vocab_size)
    config = EngineConfig(model=TINY, dtype="float32", device="cpu", num_kv_blocks=64, max_num_seqs=4,
                          max_batch_wait=0.01)
    monitor = MachineMonitor(probe=lambda: 0.01, loadavg=lambda: 0.2, cpu_count=2, others=lambda: 0.0)
    result = sweep_offered_load(loaded, config, requests, ["static", "dynamic", "continuous"], [0.5, 2.0],
                                monitor=monitor, use_tqdm=False)
    total = sum(r.output_len for r in requests)
    assert result["total_output_tokens"] == total and result["capacity_request_rate"] > 0
    points = {(p["mode"], p["load"]): p for p in result["points"]}
    assert len(points) == 6
    for (_mode, load), p in points.items():
        assert p["request_rate"] == pytest.approx(load * result["capacity_request_rate"])
        assert p["output_throughput"] > 0 and p["p99_ttft_ms"] >= p["p50_ttft_ms"] > 0
        assert p["mean_running"] <= 4
    with pytest.raises(ValueError, match="offered loads"):
        sweep_offered_load(loaded, config, requests, ["continuous"], [0.0])
    with pytest.raises(ValueError, match="unknown mode"):
        sweep_offered_load(loaded, config, requests, ["eager"], [1.0])


def test_cli_prints_the_capacity_and_every_point_and_writes_its_folder(tmp_path, capsys):
    out = tmp_path / "new"
    rc = main(["--log-level", "WARNING", "bench", "load", "--model", TINY, "--dtype", "float32", "--num-prompts", "6",
               "--input-len", "uniform:4:12", "--output-len", "uniform:1:5", "--max-num-seqs", "4", "--loads", "0.5,1",
               "--modes", "static,continuous", "--disable-tqdm", "--allow-busy", "--chart", str(out / "load.png"),
               "--output-json", str(out / "load.json")])
    assert rc == 0
    text = capsys.readouterr().out
    assert "capacity: continuous batching, all 6 at once:" in text and "p99 TTFT ms" in text
    data = json.loads((out / "load.json").read_text())
    assert [(p["mode"], p["load"]) for p in data["points"]] == [("static", 0.5), ("static", 1.0),
                                                                 ("continuous", 0.5), ("continuous", 1.0)]
    assert data["machine"]["cpu"] and (out / "load.png").read_bytes()[:4] == b"\x89PNG"

"""Offered load: one workload arriving at a rate, through each batching policy, in-process.

``bench throughput`` queues every request at once and so measures how much work a policy packs into a
step. A server's requests arrive over time instead, and then a policy trades throughput against the
time a request waits for its first token: the more load, the more a batch holds, the longer the queue.
This benchmark first measures the engine's capacity (the workload all at once under continuous
batching, in requests/s), then offers each policy the same arrivals (Poisson, ``--workload-seed``)
at fractions of that capacity and reports the output tokens/s it served and its TTFT percentiles.
Offering load as a fraction of this machine's own capacity keeps the sweep meaningful on a machine
of any speed: 1.0 is as many requests a second as continuous batching serves flat out.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from iterserve.bench.machine import MachineMonitor
from iterserve.bench.serve import arrival_offsets
from iterserve.bench.step_counts import StepCounts
from iterserve.bench.throughput import ENGINE_MODES, Timed, run_engine_mode, warm_up
from iterserve.bench.workloads import Request
from iterserve.config import EngineConfig
from iterserve.models.loader import LoadedModel

LOAD_PERCENTILES = [50.0, 99.0]


@dataclass
class LoadPointResult:
    """One policy at one offered load: counts, then wall-clock medians over the repeats."""

    mode: str
    load: float  # offered requests/s over the capacity
    request_rate: float  # offered requests/s
    num_steps: int
    mean_running: float
    output_throughput: float  # output tokens/s from the first arrival to the last token (median)
    request_throughput: float
    p50_ttft_ms: float
    p99_ttft_ms: float
    median_tpot_ms: float
    output_throughput_runs: list[float] = field(default_factory=list)
    p99_ttft_ms_runs: list[float] = field(default_factory=list)


def _point(mode: str, load: float, rate: float, n_req: int,
           runs: list[tuple[StepCounts, Timed, int]]) -> LoadPointResult:
    counts = runs[0][0]  # the same arrivals in every repeat; the steps they make depend on the timing
    latency = [t.latency or {} for _, t, _ in runs]
    throughput = [n_out / t.elapsed_s for _, t, n_out in runs]
    return LoadPointResult(
        mode=mode, load=load, request_rate=rate, num_steps=counts.num_steps, mean_running=counts.mean_running,
        output_throughput=statistics.median(throughput),
        request_throughput=statistics.median(n_req / t.elapsed_s for _, t, _ in runs),
        p50_ttft_ms=statistics.median(x["p50_ttft_ms"] for x in latency),
        p99_ttft_ms=statistics.median(x["p99_ttft_ms"] for x in latency),
        median_tpot_ms=statistics.median(x["median_tpot_ms"] for x in latency),
        output_throughput_runs=throughput, p99_ttft_ms_runs=[x["p99_ttft_ms"] for x in latency],
    )


def sweep_offered_load(
    loaded: LoadedModel, config: EngineConfig, requests: list[Request], modes: list[str], loads: list[float], *,
    repeats: int = 1, burstiness: float = 1.0, seed: int = 0, monitor: MachineMonitor | None = None,
    use_tqdm: bool = True,
) -> dict[str, Any]:
    """The capacity, then every mode at every offered load (``repeats`` times, interleaved); JSON-ready."""
    unknown = [m for m in modes if m not in ENGINE_MODES]
    if unknown or not modes:
        raise ValueError(f"unknown mode(s) {', '.join(unknown) or '(none)'}; use {', '.join(ENGINE_MODES)}")
    if not loads or not all(x > 0 and math.isfinite(x) for x in loads):
        raise ValueError(f"offered loads must be positive fractions of the capacity, got {loads}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    requests, prompts = warm_up(loaded, config, requests, None)
    monitor = monitor or MachineMonitor()
    monitor.sample()
    with tempfile.TemporaryDirectory() as tmp:
        def run(mode: str, arrivals: list[float] | None, name: str) -> tuple[StepCounts, Timed, int]:
            trace = str(Path(tmp) / f"{name}.jsonl")
            return run_engine_mode(loaded, config, mode, requests, prompts, step_trace=trace,
                                   percentiles=LOAD_PERCENTILES, arrivals=arrivals, use_tqdm=use_tqdm)

        capacity_runs = [run("continuous", None, f"capacity-{rep}") for rep in range(repeats)]
        capacity = statistics.median(len(requests) / t.elapsed_s for _, t, _ in capacity_runs)
        runs: dict[tuple[str, float], list[tuple[StepCounts, Timed, int]]] = {}
        for rep in range(repeats):
            for load in loads:
                arrivals = arrival_offsets(len(requests), load * capacity, burstiness, seed)
                for mode in modes:
                    runs.setdefault((mode, load), []).append(run(mode, arrivals, f"{mode}-{load}-{rep}"))
            monitor.sample()
    points = [_point(mode, load, load * capacity, len(requests), runs[(mode, load)])
              for mode in modes for load in loads]
    check = monitor.check
    return {
        "benchmark": "load", "model": loaded.name, "dtype": str(loaded.model.dtype).removeprefix("torch."),
        "engine": dataclasses.asdict(dataclasses.replace(config, step_trace=None)),
        "num_requests": len(requests), "total_output_tokens": capacity_runs[0][2], "repeats": repeats,
        "burstiness": burstiness, "capacity_request_rate": capacity,
        "capacity_output_throughput": statistics.median(n / t.elapsed_s for _, t, n in capacity_runs),
        "capacity_steps": capacity_runs[0][0].num_steps,
        "machine": check.to_dict(), "busy_warning": check.warning(),
        "points": [dataclasses.asdict(p) for p in points],
    }

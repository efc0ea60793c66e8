"""The discrete-event loop: bench serve's client in front of the real :class:`EngineCore` on a virtual clock.

Each simulated load point builds an :class:`~iterserve.engine.core.EngineCore` (the server's, with its
scheduler, block manager, request states, token timestamps and step trace) over a
:class:`~iterserve.simulate.executor.CostModelExecutor`, both on one
:class:`~iterserve.simulate.executor.VirtualClock`. Each iteration hands the core the requests that
reached it by now and runs one ``EngineCore.step``: the executor moves the clock on by the cost model's
time for the step and samples a filler token per sequence, and the core stamps the tokens and
finishes each request at its workload output length (``max_tokens`` with ``ignore_eos``).

This module is the client's side. Arrivals follow ``bench serve``: gamma-distributed send times
(:func:`arrival_offsets`, same seed, same workload) and an optional cap on requests in flight, a
request waiting for a free slot being sent the moment the client sees the last token of one in flight.
A request is checked when sent (as the server's API process does: one that does not fit fails at once
and never holds a slot). Between client and core lies the serving stack's round trip
(``SimConfig.request_latency_s``, HTTP, the API process and IPC): a request reaches the core half of it
after it is sent, and a sampled token reaches the client half of it after its step ends. So a request
sent when a slot frees arrives after the next step has started and waits for it, as on a real server.
The API process admits one request at a time (``SimConfig.admission_interval_s`` apart), so the first
of a burst starts a step of its own. Per-request times are the client's, from the core's outputs:
TTFT from sending to the first token's arrival, ITL between the steps of the next ones, and the results
go through bench's own :func:`compute_metrics`.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from collections import deque
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import numpy as np

from iterserve.bench.metrics import DEFAULT_PERCENTILES, RequestResult, compute_metrics
from iterserve.bench.serve import LoadPoint, arrival_offsets
from iterserve.bench.workloads import Request, WorkloadSpec, random_tokens
from iterserve.config import (
    DEFAULT_MODEL,
    Batching,
    Dtype,
    EngineConfig,
    KVAllocation,
    ModelConfig,
    SpeculativeConfig,
    get_preset,
)
from iterserve.config.kv_cache import KVCacheDtype
from iterserve.config.speculative import DEFAULT_DISABLE_BY_BATCH_SIZE
from iterserve.engine.core import EngineCore
from iterserve.engine.messages import EngineCoreOutput, EngineCoreRequest
from iterserve.engine.validation import check_prompt
from iterserve.sampling_params import SamplingParams
from iterserve.simulate.cost import CostModel
from iterserve.simulate.executor import CostModelExecutor, VirtualClock


@dataclass(frozen=True)
class SimConfig:
    """The simulated engine: the scheduler's settings, the KV pool's size and speculative decoding
    (``num_speculative_tokens`` drafts per decoding sequence, each position accepted with probability
    ``spec_acceptance``; 0 drafts: none)."""

    num_kv_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    batching: Batching = "continuous"
    max_batch_wait: float = 0.05  # dynamic batching: the oldest request's longest wait for its batch to fill
    kv_allocation: KVAllocation = "paged"
    enable_prefix_caching: bool = True
    kv_cache_dtype: KVCacheDtype = "auto"  # what a token's K/V costs in the pool (iterserve.config.kv_cache)
    max_model_len: int | None = None  # None: what the pool holds
    request_latency_s: float = 0.0  # client -> scheduler -> client round trip outside the steps
    admission_interval_s: float = 0.0  # least time between two requests reaching the scheduler
    num_speculative_tokens: int = 0
    spec_acceptance: float | None = None  # needed with drafts, refused without
    spec_disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE  # the engine's, as speculative_config's

    @property
    def model_len(self) -> int:
        return self.max_model_len or self.num_kv_blocks * self.block_size

    def __post_init__(self) -> None:
        if self.request_latency_s < 0 or self.admission_interval_s < 0:
            raise ValueError(f"the request latency and admission interval must be >= 0, got "
                             f"{self.request_latency_s} and {self.admission_interval_s}")
        if self.max_model_len is not None and self.max_model_len > self.num_kv_blocks * self.block_size:
            raise ValueError(f"max_model_len {self.max_model_len} needs more KV cache than the pool holds "
                             f"({self.num_kv_blocks} blocks of {self.block_size} tokens)")
        self._check_speculation()

    def _check_speculation(self) -> None:
        k, a = self.num_speculative_tokens, self.spec_acceptance
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"num_speculative_tokens must be an integer >= 0, got {k!r}")
        if k and a is None:
            raise ValueError("speculative decoding needs the draft acceptance probability (--spec-acceptance)")
        if not k and a is not None:
            raise ValueError("a draft acceptance probability needs drafts: set num_speculative_tokens "
                             "(--num-speculative-tokens) too")
        if a is not None and not 0 <= a <= 1:
            raise ValueError(f"the draft acceptance probability must be in [0, 1], got {a}")
        if k:  # disable_by_batch_size is checked where it is defined
            SpeculativeConfig(k, disable_by_batch_size=self.spec_disable_by_batch_size)

    @property
    def speculative_config(self) -> SpeculativeConfig | None:
        """The engine's speculative decoding: n-gram's settings, whose drafts the executor stands in for."""
        if not self.num_speculative_tokens:
            return None
        return SpeculativeConfig(self.num_speculative_tokens, disable_by_batch_size=self.spec_disable_by_batch_size)

    def engine_config(self, model: str, dtype: Dtype, step_trace: str | None = None) -> EngineConfig:
        """The engine core's config: these settings, the KV pool given in blocks."""
        return EngineConfig(model=model or DEFAULT_MODEL, dtype=dtype, block_size=self.block_size,
                            max_model_len=self.model_len, max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens,
                            enable_prefix_caching=self.enable_prefix_caching, num_kv_blocks=self.num_kv_blocks,
                            batching=self.batching, max_batch_wait=self.max_batch_wait,
                            kv_allocation=self.kv_allocation, step_trace=step_trace,
                            kv_cache_dtype=self.kv_cache_dtype,
                            speculative_config=self.speculative_config)


@dataclass
class PointStats:
    """Counts of one simulated run: the same for any cost model that keeps the step order."""

    num_steps: int = 0
    num_preemptions: int = 0
    busy_s: float = 0.0  # simulated time the engine spent in steps
    mean_batch: float = 0.0  # sequences per step
    prefix_hit_tokens: int = 0  # prompt tokens the prefix cache spared computing
    # speculative decoding, as vLLM counts it (engine/spec_decode/stats.py); zero without it
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    mean_accepted_length: float | None = None  # tokens per sequence per verification pass


class _Client:
    """One load point from the client's side: send times, the concurrency cap, the serving stack's delays,
    and every request's result read from the core's outputs."""

    def __init__(self, requests: list[Request], point: LoadPoint, burstiness: float, seed: int, cfg: SimConfig,
                 core: EngineCore, clock: VirtualClock) -> None:
        self.requests, self.cfg, self.core, self.clock = requests, cfg, core, clock
        self.cap = point.max_concurrency
        self.offsets = arrival_offsets(len(requests), point.request_rate, burstiness, seed)
        self.results = [RequestResult(prompt_len=r.prompt_len) for r in requests]
        self.pending = deque(range(len(requests)))  # not sent yet, in send order
        self.in_transit: deque[tuple[float, EngineCoreRequest]] = deque()  # sent, not at the core yet; arrival order
        self.one_way = cfg.request_latency_s / 2
        self.last_arrival = -math.inf
        self.in_flight = 0
        self.saturated = False
        self.freed_at = 0.0  # when a slot last freed after all were taken
        self.last_token: dict[int, float] = {}  # request -> when its engine sampled its last token so far
        self.rng = np.random.default_rng(seed)

    def _prompt_ids(self, r: Request) -> list[int]:
        p = r.prompt
        if isinstance(p, list) and p and isinstance(p[0], int):
            return list(p)
        # text or chat prompts: distinct ids of the same length (no prefix-cache hits are modelled for them)
        return random_tokens(self.rng, r.prompt_len, self.core.model_config.vocab_size)

    def _send(self, now: float) -> None:
        """Send every request due by ``now`` that has a slot; hand the core those arrived by ``now``."""
        while self.pending and self.offsets[self.pending[0]] <= now and (self.cap is None or self.in_flight < self.cap):
            i = self.pending.popleft()
            r, res = self.requests[i], self.results[i]
            sent = max(self.offsets[i], self.freed_at)
            res.start_time = sent
            params = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
            ids = self._prompt_ids(r)
            try:  # refused at once, as the server answers 400: it never holds a slot
                check_prompt(ids, params, self.core.model_config.vocab_size, self.core.max_model_len,
                             self.cfg.max_num_seqs)
            except ValueError as e:
                res.error = str(e)
                continue
            self.last_arrival = self._arrival(sent)
            self.in_transit.append((self.last_arrival, EngineCoreRequest(str(i), ids, params, self.last_arrival)))
            self.in_flight += 1
            if self.cap is not None and self.in_flight == self.cap:
                self.saturated = True
        while self.in_transit and self.in_transit[0][0] <= now:
            self.core.add_request(self.in_transit.popleft()[1])

    def _arrival(self, sent: float) -> float:
        """When a request sent at ``sent`` reaches the core."""
        return max(sent + self.one_way, self.last_arrival + self.cfg.admission_interval_s)

    def _next_event(self) -> float:
        """When the idle engine next has something to do: a request reaching it, or one being sent."""
        times = [self.in_transit[0][0]] if self.in_transit else []
        if self.pending and (self.cap is None or self.in_flight < self.cap):
            times.append(self._arrival(max(self.offsets[self.pending[0]], self.freed_at)))
        return min(times, default=math.inf)

    def run(self) -> float:
        """Every request sent, run and received; the run's duration."""
        core, clock = self.core, self.clock
        while self.pending or self.in_transit or core.has_unfinished_requests():
            self._send(clock.now)
            if not core.has_unfinished_requests():
                if self.pending or self.in_transit:
                    clock.advance_to(self._next_event())
                continue
            if (hold := core.scheduler.hold_s()) > 0:  # a dynamic batch fills: until its wait ends or a request comes
                clock.advance_to(min(clock.now + hold, max(clock.now, self._next_event())))
                continue
            steps = core.num_steps
            outputs = core.step().outputs
            if core.num_steps == steps:  # cannot happen while max_model_len fits the pool; never spin on it
                raise RuntimeError(f"the scheduler scheduled nothing with {core.num_waiting} requests waiting")
            for out in outputs:
                self._receive(out)
        core.block_manager.check_no_leaks()
        ends = [r.start_time + r.latency if r.success else r.start_time for r in self.results]
        return max([clock.now, *ends])

    def _receive(self, out: EngineCoreOutput) -> None:
        """The client's side of one output, half a round trip after the core's step sampled it."""
        i = int(out.request_id)
        res = self.results[i]
        if out.new_token_ids:
            if res.output_len == 0:
                res.ttft = out.timestamp + self.one_way - res.start_time
            else:
                res.itl.append(out.timestamp - self.last_token[i])
            self.last_token[i] = out.timestamp
            res.output_len += len(out.new_token_ids)
        if out.finish_reason is None:
            return
        del self.last_token[i]
        res.latency = out.timestamp + self.one_way - res.start_time
        res.success = out.finish_reason in ("stop", "length")
        if not res.success:
            res.error = f"the engine ended the request: {out.finish_reason}"
        self.in_flight -= 1
        if self.saturated:
            self.saturated, self.freed_at = False, out.timestamp + self.one_way


def simulate_point(
    requests: list[Request], point: LoadPoint, cost: CostModel, cfg: SimConfig, *, burstiness: float = 1.0,
    seed: int = 0, trace: IO[str] | None = None, model: ModelConfig | None = None, dtype: Dtype = "bfloat16",
) -> tuple[list[RequestResult], float, PointStats]:
    """Run the workload once at one load point through a fresh engine core; the per-request results,
    the duration and the counts. ``model`` (default: the embedded model's shape) supplies the vocabulary
    requests are checked against; ``trace`` gets the core's step trace of the run (the core writes it to
    a file of its own, copied here once the run is over, so a sweep's points follow each other)."""
    if not requests:
        raise ValueError("a simulation needs at least one request")
    model = model or get_preset(DEFAULT_MODEL)
    if trace is None:
        return _run_point(requests, point, cost, cfg, burstiness, seed, model, cfg.engine_config(model.name, dtype))
    with tempfile.TemporaryDirectory() as folder:
        step_trace = Path(folder) / "trace.jsonl"
        result = _run_point(requests, point, cost, cfg, burstiness, seed, model,
                            cfg.engine_config(model.name, dtype, str(step_trace)))
        with step_trace.open() as f:
            shutil.copyfileobj(f, trace)
    return result


def _run_point(requests: list[Request], point: LoadPoint, cost: CostModel, cfg: SimConfig, burstiness: float,
               seed: int, model: ModelConfig, config: EngineConfig) -> tuple[list[RequestResult], float, PointStats]:
    clock = VirtualClock()
    executor = CostModelExecutor(config, model, cost, clock, acceptance=cfg.spec_acceptance or 0.0, seed=seed)
    core = EngineCore(config, executor=executor, clock=clock, proposer=executor)
    try:
        client = _Client(requests, point, burstiness, seed, cfg, core, clock)
        duration = client.run()
    finally:
        core.close()
    if not any(r.success for r in client.results):
        raise ValueError(f"no request of the workload could run: {client.results[0].error}")
    spec = core.spec_stats
    stats = PointStats(core.num_steps, core.num_preemptions, executor.busy_s, executor.rows / max(core.num_steps, 1),
                       core.prefix_hit_tokens, spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens,
                       spec.mean_accepted_length)
    return client.results, duration, stats


def run_simulation(
    requests: list[Request], points: list[LoadPoint], cost: CostModel, cfg: SimConfig, *, burstiness: float = 1.0,
    workload: WorkloadSpec | None = None, model_id: str = "", label: str | None = None,
    percentiles: list[float] | None = None, goodput: dict[str, float] | None = None, trace: IO[str] | None = None,
    model: ModelConfig | None = None, dtype: Dtype = "bfloat16",
) -> dict[str, Any]:
    """Every load point in turn (:func:`simulate_point`); the result has ``bench serve``'s JSON shape
    (``bench plot`` reads it), with the simulator's settings and each run's step counts added."""
    if not points:
        raise ValueError("a simulation needs at least one load point")
    pcts = percentiles or list(DEFAULT_PERCENTILES)
    seed = workload.seed if workload is not None else 0
    runs = []
    for point in points:
        results, duration, stats = simulate_point(requests, point, cost, cfg, burstiness=burstiness, seed=seed,
                                                  trace=trace, model=model, dtype=dtype)
        run: dict[str, Any] = {
            "request_rate": "inf" if math.isinf(point.request_rate) else point.request_rate,
            "burstiness": burstiness, "max_concurrency": point.max_concurrency, "num_prompts": len(requests),
        }
        runs.append(run | compute_metrics(results, duration, pcts, goodput) | {"simulated": asdict(stats)})
    return {
        "benchmark": "serve", "simulated": True,
        "label": label or f"simulated {cost.describe()['kind']}",
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "base_url": None, "endpoint": None, "model_id": model_id, "tokenizer_id": None,
        "percentiles": pcts, "goodput": goodput,
        "workload": asdict(workload) if workload is not None else None,
        "simulation": {"engine": asdict(cfg), "cost_model": cost.describe()},
        "runs": runs,
    }

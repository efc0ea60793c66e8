"""The discrete-event loop: the engine's own Scheduler and BlockManager on a simulated clock.

Each iteration admits the requests sent by now, asks the real :class:`Scheduler` for a step, asks
the cost model how long that step takes, advances the clock by it and hands the scheduler one
sampled token per sequence that finished its tokens, exactly as the engine core does after a
forward pass. The token is a filler until the request reaches its workload output length, then an
end-of-sequence token, so requests stop where the workload says (an emulated EOS).

Arrivals follow ``bench serve``: gamma-distributed send times (:func:`arrival_offsets`, same seed,
same workload) and an optional cap on requests in flight, a request waiting for a free slot being
sent the moment the client sees the last token of one in flight. Between client and scheduler lies
the serving stack's round trip (``SimConfig.request_latency_s``, HTTP, the API process and IPC): a
request reaches the scheduler half of it after it is sent, and a sampled token reaches the client
half of it after its step ends. So a request sent when a slot frees arrives after the next step
has started and waits for it, as on a real server. The API process admits one request at a time
(``SimConfig.admission_interval_s`` apart), so the first of a burst starts a step of its own.
Per-request times are the client's: TTFT from sending to the first token's arrival, ITL between the
next ones, and the results go through bench's own :func:`compute_metrics`.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import IO, Any

import msgspec
import numpy as np

from iterserve.bench.metrics import DEFAULT_PERCENTILES, RequestResult, compute_metrics
from iterserve.bench.serve import LoadPoint, arrival_offsets
from iterserve.bench.workloads import FIRST_RANDOM_TOKEN_ID, Request, WorkloadSpec
from iterserve.config import Batching, KVAllocation, SchedulerConfig
from iterserve.config.speculative import DEFAULT_DISABLE_BY_BATCH_SIZE
from iterserve.engine.block_manager import BlockManager
from iterserve.engine.messages import StepStats
from iterserve.engine.sampler import SampleResult
from iterserve.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from iterserve.engine.sequence import Sequence
from iterserve.outputs import RequestMetrics
from iterserve.sampling_params import SamplingParams
from iterserve.simulate.cost import CostModel, StepShape
from iterserve.simulate.speculation import SimSpeculation

EOS = -1  # the emulated end-of-sequence token: outside any vocabulary, so no prompt holds it
FILLER = 0  # every other sampled token


@dataclass(frozen=True)
class SimConfig:
    """The simulated engine: the scheduler's settings and the KV pool's size."""

    num_kv_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    batching: Batching = "continuous"
    kv_allocation: KVAllocation = "paged"
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # None: what the pool holds
    request_latency_s: float = 0.0  # client -> scheduler -> client round trip outside the steps
    admission_interval_s: float = 0.0  # least time between two requests reaching the scheduler
    # speculative decoding: drafts per decoding sequence (0: none), each accepted with this probability
    # given the ones before it were, and no drafts in a step whose running batch is larger than the cut-off
    num_speculative_tokens: int = 0
    spec_acceptance: float = 0.0
    spec_disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE

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


def step_shape(scheduled: list[ScheduledSeq]) -> StepShape:
    """Summarise a scheduled step before it runs (the sequences' computed tokens have not moved yet)."""
    prefill_tokens = decode = context = pairs = prefill_seqs = sampling = drafts = 0
    for s in scheduled:
        n, c0 = s.num_tokens, s.seq.num_computed_tokens
        if s.is_prefill:
            prefill_tokens += n
            prefill_seqs += 1
        else:
            decode += 1
            drafts += len(s.spec_token_ids)
        context += c0 + n
        pairs += n * c0 + n * (n + 1) // 2
        sampling += s.samples
    return StepShape(prefill_tokens, decode, context, pairs, prefill_seqs, sampling, drafts)


@dataclass
class PointStats:
    """Counts of one simulated run: the same for any cost model that keeps the step order."""

    num_steps: int = 0
    num_preemptions: int = 0
    busy_s: float = 0.0  # simulated time the engine spent in steps
    mean_batch: float = 0.0  # sequences per step


class _Run:
    """One load point: the clock, the scheduler and the client side of every request."""

    def __init__(self, requests: list[Request], point: LoadPoint, burstiness: float, seed: int, cost: CostModel,
                 cfg: SimConfig, trace: IO[str] | None) -> None:
        self.requests, self.cost, self.cfg, self.trace = requests, cost, cfg, trace
        self.cap = point.max_concurrency
        self.offsets = arrival_offsets(len(requests), point.request_rate, burstiness, seed)
        self.block_manager = BlockManager(cfg.num_kv_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.batching,
                                                   cfg.kv_allocation, cfg.model_len), self.block_manager)
        self.results = [RequestResult(prompt_len=r.prompt_len) for r in requests]
        self.pending = deque(range(len(requests)))  # not sent yet, in send order
        self.in_transit: deque[tuple[float, Sequence]] = deque()  # sent, not at the scheduler yet; in arrival order
        self.one_way = cfg.request_latency_s / 2
        self.last_arrival = -math.inf
        self.in_flight = 0
        self.saturated = False
        self.freed_at = 0.0  # when a slot last freed after all were taken
        self.index: dict[str, int] = {}
        self.rng = np.random.default_rng(seed)
        self.stats = PointStats()
        self.spec = (SimSpeculation(cfg.num_speculative_tokens, cfg.spec_acceptance, cfg.spec_disable_by_batch_size,
                                    cfg.model_len, np.random.default_rng(seed + 1))
                     if cfg.num_speculative_tokens else None)

    def _prompt_ids(self, r: Request) -> list[int]:
        p = r.prompt
        if isinstance(p, list) and p and isinstance(p[0], int):
            return list(p)
        # text or chat prompts: distinct ids of the same length (no prefix-cache hits are modelled for them)
        return self.rng.integers(FIRST_RANDOM_TOKEN_ID, 1 << 30, size=r.prompt_len).tolist()

    def _send(self, now: float) -> None:
        """Send every request due by ``now`` that has a slot; hand the scheduler those arrived by ``now``."""
        while self.pending and self.offsets[self.pending[0]] <= now and (self.cap is None or self.in_flight < self.cap):
            i = self.pending.popleft()
            r, res = self.requests[i], self.results[i]
            sent = max(self.offsets[i], self.freed_at)
            res.start_time = sent
            if r.prompt_len + r.output_len > self.cfg.model_len:
                res.error = (f"prompt ({r.prompt_len} tokens) + max_tokens ({r.output_len}) exceeds max_model_len "
                             f"({self.cfg.model_len})")
                continue  # refused at once, as the server answers 400: it never holds a slot
            params = SamplingParams(max_tokens=r.output_len, temperature=0.0)
            self.last_arrival = self._arrival(sent)
            seq = Sequence(request_id=str(i), prompt=None, prompt_token_ids=self._prompt_ids(r), params=params,
                           max_tokens=r.output_len, stop_ids=frozenset({EOS}),
                           metrics=RequestMetrics(arrival_time=self.last_arrival, num_prompt_tokens=r.prompt_len))
            self.index[seq.request_id] = i
            self.in_transit.append((self.last_arrival, seq))
            self.in_flight += 1
            if self.cap is not None and self.in_flight == self.cap:
                self.saturated = True
        while self.in_transit and self.in_transit[0][0] <= now:
            self.scheduler.add(self.in_transit.popleft()[1])

    def _arrival(self, sent: float) -> float:
        """When a request sent at ``sent`` reaches the scheduler."""
        return max(sent + self.one_way, self.last_arrival + self.cfg.admission_interval_s)

    def _next_event(self) -> float:
        """When the idle engine next has something to do: a request reaching it, or one being sent."""
        times = [self.in_transit[0][0]] if self.in_transit else []
        if self.pending and (self.cap is None or self.in_flight < self.cap):
            times.append(self._arrival(max(self.offsets[self.pending[0]], self.freed_at)))
        return min(times)

    def run(self) -> float:
        now, sched, seqs_run = 0.0, self.scheduler, 0
        while self.pending or self.in_transit or sched.has_unfinished():
            self._send(now)
            if not sched.has_unfinished():
                if self.pending or self.in_transit:
                    now = max(now, self._next_event())
                continue
            out = sched.schedule()
            if out.is_empty:  # cannot happen while max_model_len fits the pool; never spin on it
                raise RuntimeError(f"the scheduler scheduled nothing with {len(sched.waiting)} requests waiting")
            start = now
            for s in out.scheduled:
                if s.seq.metrics.first_scheduled_time is None:
                    s.seq.metrics.first_scheduled_time = start
            shape = step_shape(out.scheduled)
            now += self.cost.step_time(shape)
            verdicts = self.spec.verdicts(out.scheduled) if self.spec is not None else {}
            tokens = []
            for i, s in enumerate(x for x in out.scheduled if x.samples):
                made = len(s.seq.output_token_ids) + 1 + (len(verdicts[i].accepted) if i in verdicts else 0)
                tokens.append(EOS if made >= self.requests[self.index[s.seq.request_id]].output_len else FILLER)
            update = sched.update_from_output(out, SampleResult(tokens, [None] * len(tokens), verdicts=verdicts))
            if self.spec is not None:
                self.spec.propose(sched.running)
            self.stats.num_steps += 1
            self.stats.num_preemptions += len(out.preempted)
            self.stats.busy_s += now - start
            seqs_run += len(out.scheduled)
            if self.trace is not None:
                self._trace_step(out, shape, start, now)
            for seq in update.sampled:
                m = seq.metrics
                n = update.new_tokens.get(id(seq), 1)
                m.token_times.extend([now] * n)
                m.num_output_tokens += n
                if m.first_token_time is None:
                    m.first_token_time = now
            for seq in update.finished:
                self._finish(seq, now)
        self.stats.mean_batch = seqs_run / max(self.stats.num_steps, 1)
        self.block_manager.check_no_leaks()
        ends = [r.start_time + r.latency if r.success else r.start_time for r in self.results]
        return max([now, *ends])

    def _finish(self, seq: Sequence, now: float) -> None:
        """The engine is done with ``seq`` at ``now``; the client, half a round trip later. A request's
        metrics are the engine's (arrival at the scheduler, step ends), as in a server's step trace;
        its result is the client's."""
        m = seq.metrics
        m.finished_time = now
        res = self.results[self.index.pop(seq.request_id)]
        res.ttft = m.first_token_time + self.one_way - res.start_time  # type: ignore[operator]
        res.itl = m.itl
        res.latency = now + self.one_way - res.start_time
        res.output_len = m.num_output_tokens
        res.success = True
        self.in_flight -= 1
        if self.saturated:
            self.saturated, self.freed_at = False, now + self.one_way
        if self.trace is not None:
            record = {"type": "request", "request_id": seq.request_id, "finish_reason": seq.finish_reason}
            self.trace.write(json.dumps({**record, **m.as_dict()}) + "\n")

    def _trace_step(self, out: SchedulerOutput, shape: StepShape, start: float, end: float) -> None:
        """A step record in the engine's step-trace schema, so bench's timeline charts read it."""
        record = StepStats(
            step=self.stats.num_steps, start=start, duration=end - start,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_prefill_tokens=shape.prefill_tokens, num_decode_tokens=shape.decode_seqs + shape.draft_tokens,
            num_prefill_seqs=shape.prefill_seqs, num_decode_seqs=shape.decode_seqs,
            kv_blocks_used=self.block_manager.num_used_blocks, prefix_hit_tokens=out.prefix_hit_tokens,
            num_preemptions=len(out.preempted), total_context=shape.total_context, seqs=out.batch_rows(),
            num_drafts=sum(1 for s in out.scheduled if s.spec_token_ids), num_draft_tokens=shape.draft_tokens,
        )
        self.trace.write(msgspec.json.encode(record).decode() + "\n")  # type: ignore[union-attr]


def simulate_point(
    requests: list[Request], point: LoadPoint, cost: CostModel, cfg: SimConfig, *, burstiness: float = 1.0,
    seed: int = 0, trace: IO[str] | None = None,
) -> tuple[list[RequestResult], float, PointStats]:
    """Run the workload once at one load point; the per-request results, the duration and the counts."""
    if not requests:
        raise ValueError("a simulation needs at least one request")
    run = _Run(requests, point, burstiness, seed, cost, cfg, trace)
    duration = run.run()
    if not any(r.success for r in run.results):
        raise ValueError(f"no request of the workload could run: {run.results[0].error}")
    return run.results, duration, run.stats


def run_simulation(
    requests: list[Request], points: list[LoadPoint], cost: CostModel, cfg: SimConfig, *, burstiness: float = 1.0,
    workload: WorkloadSpec | None = None, model_id: str = "", label: str | None = None,
    percentiles: list[float] | None = None, goodput: dict[str, float] | None = None, trace: IO[str] | None = None,
) -> dict[str, Any]:
    """Every load point in turn; the result has ``bench serve``'s JSON shape (``bench plot`` reads
    it), with the simulator's settings and each run's step counts added."""
    if not points:
        raise ValueError("a simulation needs at least one load point")
    pcts = percentiles or list(DEFAULT_PERCENTILES)
    seed = workload.seed if workload is not None else 0
    runs = []
    for point in points:
        results, duration, stats = simulate_point(requests, point, cost, cfg, burstiness=burstiness, seed=seed,
                                                  trace=trace)
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

"""Cost models: how long one engine step takes, from what the scheduler put in it.

A step is summarised as a :class:`StepShape` (prefill tokens, decode sequences, the context they
attend, ...). Three models turn a shape into seconds:

* :class:`ConstantCost`: every step takes the same time (tests, hand calculations);
* :class:`RooflineCost`: ``max(FLOPs / peak, bytes / bandwidth) + overhead`` for a model on an
  accelerator, counted as the planner counts a decode step and a prefill;
* :class:`LinearCost`: ``a + b * prefill_tokens + c * decode_seqs + d * total_context``, fitted by
  least squares to steps timed on this machine (:func:`fit_linear`), saved as a JSON profile.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from iterserve.simulate.planning import PlannerTerms

PROFILE_KIND = "iterserve-step-profile"
FEATURES = ("prefill_tokens", "decode_seqs", "total_context")


@dataclass(frozen=True)
class StepShape:
    """What one step computes. ``total_context`` sums every scheduled sequence's tokens in the KV
    cache after the step (what attention reads); ``attention_pairs`` sums, over the step's new
    tokens, how many keys each attends (causal within a prefill chunk)."""

    prefill_tokens: int
    decode_seqs: int
    total_context: int
    attention_pairs: int = 0
    prefill_seqs: int = 0
    sampling_seqs: int = 0  # sequences whose last token ran: the LM head runs for these
    draft_tokens: int = 0  # speculative drafts the decoding sequences verify, beside their own token

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs + self.draft_tokens

    @property
    def logits_rows(self) -> int:
        """Rows through the LM head: one per sampling sequence, and one per draft it verifies."""
        return self.sampling_seqs + self.draft_tokens


class CostModel(Protocol):
    def step_time(self, shape: StepShape) -> float: ...

    def describe(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ConstantCost:
    seconds: float

    def __post_init__(self) -> None:
        if not self.seconds > 0:
            raise ValueError(f"a constant step time must be positive, got {self.seconds}")

    def step_time(self, shape: StepShape) -> float:
        return self.seconds

    def describe(self) -> dict[str, Any]:
        return {"kind": "constant", "step_time_s": self.seconds}


@dataclass(frozen=True)
class RooflineCost:
    """The planner's roofline applied to a whole mixed step (decodes and prefill chunks together):
    FLOPs are the linear layers on every token, the LM head on every sampled one and attention on
    every (query, key) pair; bytes are the matmul weights once (of a MoE model's experts, the share
    the step's tokens run) plus every scheduled sequence's KV cache. Compute and memory do not overlap
    with the overhead, which covers scheduling and launch."""

    terms: PlannerTerms
    overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if self.terms.peak_flops is None or self.terms.bandwidth is None:
            raise ValueError("a roofline cost model needs an accelerator (--gpu, or --flops and --bandwidth)")
        if self.overhead_s < 0:
            raise ValueError(f"the per-step overhead must be >= 0, got {self.overhead_s}")

    def compute_s(self, shape: StepShape) -> float:
        t = self.terms
        flops = (2 * t.layer_matmul_params * shape.tokens + 2 * t.lm_head_params * shape.logits_rows
                 + t.attention_flops_per_pair * shape.attention_pairs)
        return flops / t.peak_flops  # type: ignore[operator]

    def memory_s(self, shape: StepShape) -> float:
        t = self.terms
        kv = t.kv_bytes_per_token * shape.total_context
        return (t.weight_bytes_read(shape.tokens) + kv) / t.bandwidth  # type: ignore[operator]

    def step_time(self, shape: StepShape) -> float:
        return max(self.compute_s(shape), self.memory_s(shape)) + self.overhead_s

    def describe(self) -> dict[str, Any]:
        t = self.terms
        return {"kind": "roofline", "model": t.model_name, "accelerator": t.accelerator, "peak_flops": t.peak_flops,
                "bandwidth": t.bandwidth, "overhead_s": self.overhead_s, "quantization": t.quantization}


@dataclass(frozen=True)
class LinearCost:
    """``intercept_s + sum(coefficient * feature)`` over :data:`FEATURES`; a calibrated profile.

    With ``decode_batch_s`` (fitted per batch size, ``fit_linear(per_batch_size=True)``) the decode
    term is a table by the step's number of decode sequences instead of a line: on a CPU whose
    small-batch matmuls cost more per row than larger ones a step is not linear in its batch. Batches
    past the table grow by ``per_decode_seq_s`` per sequence."""

    intercept_s: float
    per_prefill_token_s: float
    per_decode_seq_s: float
    per_context_token_s: float
    source: str = ""
    num_steps: int = 0
    mean_abs_rel_error: float | None = None  # of the fit on its own steps
    # Not step costs: the serving stack around the steps, measured on the server the steps came from
    # (:func:`fit_request_timing`); the simulator's defaults for the same ``SimConfig`` fields.
    request_latency_s: float = 0.0
    admission_interval_s: float = 0.0
    decode_batch_s: tuple[float, ...] = ()  # index: decode sequences in the step; [0] is 0

    def decode_s(self, batch: int) -> float:
        table = self.decode_batch_s
        if not table:
            return self.per_decode_seq_s * batch
        if batch < len(table):
            return table[batch]
        return table[-1] + self.per_decode_seq_s * (batch - len(table) + 1)

    def step_time(self, shape: StepShape) -> float:
        # a verified draft runs like a prompt token: one more row through every matmul, over cached context
        work = self.per_prefill_token_s * (shape.prefill_tokens + shape.draft_tokens) + self.decode_s(shape.decode_seqs)
        return self.intercept_s + work + self.per_context_token_s * shape.total_context

    def describe(self) -> dict[str, Any]:
        return {"kind": "linear", **asdict(self)}

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"kind": PROFILE_KIND, **asdict(self)}, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> LinearCost:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e.msg})") from None
        if not isinstance(data, dict) or data.pop("kind", None) != PROFILE_KIND:
            raise ValueError(f"{path}: not a step profile (write one with 'iterserve simulate calibrate')")
        data["decode_batch_s"] = tuple(data.get("decode_batch_s", ()))  # JSON has lists
        try:
            return cls(**data)
        except TypeError as e:
            raise ValueError(f"{path}: malformed step profile ({e})") from None


# -- calibration ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TimedStep:
    shape: StepShape
    seconds: float


def steps_from_trace(path: str | Path) -> list[TimedStep]:
    """Timed steps of an engine step trace (JSON lines, ``--step-trace``).

    A step's time is its period: from its start to the next step's start while the engine stayed
    busy (requests running or waiting after it), so the loop's own work between forward passes
    (output processing, a server's streaming) is charged to the steps, as the simulated clock needs;
    the step's own ``duration`` before an idle gap. The step's context is the trace's
    ``total_context``; traces written before it was recorded get it rebuilt by summing each request's
    scheduled tokens, starting again when a request prefills after decoding (a recompute after
    preemption). That rebuild misses prefix-cache hits and recomputes of sequences preempted before
    their first decode."""
    computed: dict[str, int] = {}
    decoded: set[str] = set()
    records = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if record.get("type") == "step":
                records.append(record)
    if not records:
        raise ValueError(f"{path}: no step records (write a trace with --step-trace or bench throughput --trace-dir)")
    steps = []
    for k, record in enumerate(records):
        prefill = decode = context = 0
        for rid, phase, n, *_ in record["seqs"]:
            if phase == "prefill":
                if rid in decoded:
                    decoded.discard(rid)
                    computed[rid] = 0
                prefill += n
            else:
                decoded.add(rid)
                decode += 1
            computed[rid] = computed.get(rid, 0) + n
            context += computed[rid]
        context = record.get("total_context", context)
        seconds = float(record["duration"])
        nxt = records[k + 1] if k + 1 < len(records) else None
        busy = record.get("num_running", 0) or record.get("num_waiting", 0)
        if nxt is not None and busy and "start" in record and nxt["start"] > record["start"]:
            seconds = max(seconds, nxt["start"] - record["start"])
        steps.append(TimedStep(StepShape(prefill, decode, context), seconds))
    return steps


@dataclass(frozen=True)
class RequestTiming:
    """The serving stack around the steps, as a client sees it (``SimConfig``'s fields of the same names)."""

    request_latency_s: float  # median client TTFT minus the engine's TTFT: HTTP, API process, IPC, both ways
    admission_interval_s: float  # spread of a burst's arrivals at the engine per request after the first
    num_requests: int  # requests found in both the trace and the client's results
    num_bursts: int  # groups of requests the client sent together (under 1 ms apart)


BURST_GAP_S = 1e-3  # requests a client sends less than this apart are one burst


def fit_request_timing(runs: Iterable[tuple[str | Path, str | Path]]) -> RequestTiming:
    """Compare the client's view of runs (``bench serve --output-json``) with the engine's (the
    request records of the server's ``--step-trace`` during each), given as (trace, result) pairs.

    Requests are paired by (prompt tokens, output tokens), run by run, in the client's sending order
    and the trace's order (runs follow each other), so the trace may hold other requests too (a
    readiness probe). The round trip is the median of client TTFT minus engine TTFT (from the API
    process's arrival stamp to the step that sampled the first token); the admission interval is how
    far apart the engine saw the requests of a burst arrive."""
    gaps: list[float] = []
    spread = 0.0
    per = bursts = 0
    for trace, serve_json in runs:
        run_gaps, run_bursts = _pair_requests(trace, serve_json)
        gaps += run_gaps
        for arrivals in run_bursts:
            spread += max(arrivals) - min(arrivals)
            per += len(arrivals) - 1
        bursts += len(run_bursts)
    if not gaps:
        raise ValueError("no request of the bench serve results was found in the traces (are they the server's "
                         "traces of those runs?)")
    return RequestTiming(max(0.0, float(np.median(gaps))), spread / per if per else 0.0, len(gaps), bursts)


def _pair_requests(trace: str | Path, serve_json: str | Path) -> tuple[list[float], list[list[float]]]:
    """Client TTFT minus engine TTFT of every request found in both, and the engine arrival times of
    each burst the client sent."""
    try:
        data = json.loads(Path(serve_json).read_text())
    except json.JSONDecodeError:
        data = None
    if not isinstance(data, dict) or data.get("benchmark") != "serve":
        raise ValueError(f"{serve_json}: not a bench serve result (write one with bench serve --output-json)")
    engine: dict[tuple[int, int], deque[dict[str, Any]]] = {}
    with open(trace) as f:
        for line in f:
            record = json.loads(line)
            if record.get("type") == "request" and record.get("ttft") is not None:
                engine.setdefault((record["num_prompt_tokens"], record["num_output_tokens"]), deque()).append(record)
    gaps: list[float] = []
    bursts: list[list[float]] = []
    for run in data["runs"]:
        sent = sorted(range(len(run["ttfts"])), key=lambda i: run["start_times"][i])
        matched: list[tuple[float, float]] = []  # (client send time, engine arrival time)
        for i in sent:
            key = (run["input_lens"][i], run["output_lens"][i])
            if not run["output_lens"][i] or run["ttfts"][i] is None or not engine.get(key):  # failed, or not traced
                continue
            record = engine[key].popleft()
            gaps.append(run["ttfts"][i] - record["ttft"])
            matched.append((run["start_times"][i], record["arrival_time"]))
        k = 0
        while k < len(matched):
            j = k + 1
            while j < len(matched) and matched[j][0] - matched[j - 1][0] < BURST_GAP_S:
                j += 1
            if j - k > 1:
                bursts.append([a for _, a in matched[k:j]])
            k = j
    return gaps, bursts


def steps_from_batch(path: str | Path) -> list[TimedStep]:
    """Timed steps of a ``bench batch --output-json`` sweep: a decode step of ``B`` sequences at
    context ``C`` and a prefill of ``B`` prompts of ``C`` tokens per point."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or data.get("benchmark") != "batch":
        raise ValueError(f"{path}: not a bench batch result")
    c = int(data["context"])
    steps = []
    for p in data["points"]:
        b = int(p["batch_size"])
        steps.append(TimedStep(StepShape(0, b, b * (c + 1)), float(p["decode_s"])))
        if p.get("prefill_s"):
            steps.append(TimedStep(StepShape(b * c, 0, b * c), float(p["prefill_s"])))
    return steps


def fit_linear(steps: Iterable[TimedStep], source: str = "", *, per_batch_size: bool = False) -> LinearCost:
    """Least squares of step time on (1, prefill tokens, decode sequences, total context), relative
    to each step's time so short decode steps weigh as much as long prefills. A coefficient that
    comes out negative (no step costs less for more work, and none takes negative time) is fixed at
    zero and the rest refitted.

    ``per_batch_size`` replaces the decode-sequences column by one indicator per batch size seen
    (their coefficients may take either sign: a batch of 8 may step faster than one of 3); sizes
    between those seen are interpolated, and the slope of the two largest extends the table."""
    steps = list(steps)
    if len(steps) < 4:
        raise ValueError(f"calibration needs at least 4 timed steps, got {len(steps)}")
    y = np.array([s.seconds for s in steps])
    if not np.all(y > 0):
        raise ValueError("calibration steps must have positive durations")
    decode = np.array([s.shape.decode_seqs for s in steps])
    sizes = sorted(set(decode[decode > 0].tolist())) if per_batch_size else []
    cols = [np.ones(len(steps)), np.array([s.shape.prefill_tokens for s in steps], dtype=float),
            np.array([s.shape.total_context for s in steps], dtype=float)]
    cols += [(decode == b).astype(float) for b in sizes] if per_batch_size else [decode.astype(float)]
    x = np.stack(cols, axis=1)
    clipped = 3 if per_batch_size else x.shape[1]  # the columns held >= 0
    active = [j for j in range(x.shape[1]) if np.any(x[:, j] != 0)]
    while True:
        w = 1.0 / y
        coef_active, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        negative = [j for j, c in zip(active, coef_active) if c < 0 and j < clipped]
        if not negative:
            break
        active = [j for j in active if j not in negative]
        if not active:
            raise ValueError("the step times fall as the work grows: no calibration fits them")
    coef = np.zeros(x.shape[1])
    coef[active] = coef_active
    err = float(np.mean(np.abs(x @ coef - y) / y))
    table: tuple[float, ...] = ()
    per_seq = float(coef[3]) if not per_batch_size else 0.0
    if sizes:
        seen = [0, *sizes]
        table = tuple(float(v) for v in np.interp(np.arange(sizes[-1] + 1), seen, [0.0, *coef[3:]]))
        if len(sizes) > 1:
            per_seq = max(0.0, (table[sizes[-1]] - table[sizes[-2]]) / (sizes[-1] - sizes[-2]))
    return LinearCost(float(coef[0]), float(coef[1]), per_seq, float(coef[2]), source=source,
                      num_steps=len(steps), mean_abs_rel_error=err, decode_batch_s=table)

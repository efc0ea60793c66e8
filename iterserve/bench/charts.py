"""PNG charts of benchmark results: throughput against latency over a sweep, latency percentiles
against load for one or more servers, and a per-sequence timeline from the engine's step trace."""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from iterserve.bench.knee import read_knee

logger = logging.getLogger(__name__)


def subplots(*grid: int, figsize: tuple[float, float], **kwargs: Any) -> tuple[Figure, Any]:
    """A figure on its own Agg canvas (charts are PNG files): no pyplot state, no global backend."""
    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(*grid, **kwargs)


@dataclass
class Series:
    """One curve of a throughput-latency chart; ``knee`` names the point to mark, if any."""

    label: str
    throughput: list[float]
    latency: list[float]
    point_labels: list[str]
    knee: int | None = None  # index into the points


def throughput_latency_chart(series: list[Series], path: str | Path, *, xlabel: str, ylabel: str, title: str) -> None:
    """Latency against throughput, one labelled point per sweep step, the knee circled."""
    fig, ax = subplots(figsize=(7, 4.5))
    for s in series:
        (line,) = ax.plot(s.throughput, s.latency, marker="o", label=s.label)
        for x, y, text in zip(s.throughput, s.latency, s.point_labels):
            ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        if s.knee is not None:
            ax.scatter([s.throughput[s.knee]], [s.latency[s.knee]], s=200, facecolors="none", linewidths=2,
                       edgecolors=line.get_color(), label=f"{s.label}: knee ({s.point_labels[s.knee]})")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# -- serve results --------------------------------------------------------------------------------


def load_serve_results(path: str | Path) -> dict[str, Any]:
    """A ``bench serve`` result, or a single-run result JSON of ``vllm bench serve`` (wrapped as one run)."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg})") from None
    if isinstance(data, dict) and isinstance(data.get("runs"), list) and data.get("benchmark", "serve") == "serve":
        return data
    if isinstance(data, dict) and "request_throughput" in data:
        return {"label": data.get("label") or data.get("backend") or Path(path).stem, "runs": [data]}
    raise ValueError(f"{path}: not a bench serve result (no 'runs' list) nor a vllm bench serve result")


def load_axis(runs: list[dict[str, Any]]) -> tuple[str, list[tuple[float, dict[str, Any]]]]:
    """The load each run was driven at: its request rate when finite, else its concurrency cap."""

    def rate(run: dict[str, Any]) -> float:
        r = run.get("request_rate", "inf")
        return math.inf if r in ("inf", None) else float(r)

    by_rate = [(rate(r), r) for r in runs if math.isfinite(rate(r))]
    if by_rate:
        return "request rate (req/s)", sorted(by_rate, key=lambda p: p[0])
    return "max concurrency", sorted(((float(r["max_concurrency"]), r) for r in runs if r.get("max_concurrency")),
                                     key=lambda p: p[0])


def latency_vs_load_chart(results: list[dict[str, Any]], path: str | Path, percentiles: list[str]) -> None:
    """TTFT and TPOT (median and each percentile) against load, one colour per result."""
    fig, axes = subplots(1, 2, figsize=(11, 4.5))
    styles = ["-", "--", ":", "-."]
    xlabel = "load"
    for k, result in enumerate(results):
        xlabel, points = load_axis(result["runs"])
        color = f"C{k}"
        for metric, ax in zip(("ttft", "tpot"), axes):
            for style, stat in zip(styles, ["median", *(f"p{p}" for p in percentiles)]):
                key = f"{stat}_{metric}_ms"
                xs = [x for x, run in points if key in run]
                ys = [run[key] for _, run in points if key in run]
                if xs:
                    ax.plot(xs, ys, style, marker="o", color=color, label=f"{result['label']} {stat}")
    for metric, ax in zip(("TTFT", "TPOT"), axes):
        ax.set(xlabel=xlabel, ylabel=f"{metric} (ms)", title=f"{metric} against load")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def percentiles_in(runs: list[dict[str, Any]]) -> list[str]:
    """The percentile keys ("90", "99", ...) a set of serve runs reports."""
    keys = {m.group(1) for run in runs for k in run if (m := re.fullmatch(r"p([\d.]+)_ttft_ms", k))}
    return sorted(keys, key=float)


def run_label(run: dict[str, Any]) -> str:
    rate, cap = run.get("request_rate", "inf"), run.get("max_concurrency")
    parts = [] if rate in ("inf", None) else [f"{float(rate):g} req/s"]
    return ", ".join(parts + ([f"c={cap}"] if cap else [])) or "all at once"


def serve_charts(results: list[dict[str, Any]], prefix: Path) -> list[Path]:
    """``<prefix>_throughput.png`` (median TPOT against output tokens/s) and, when some run has a
    finite rate or a concurrency cap to plot against, ``<prefix>_latency.png`` (TTFT and TPOT
    against load); returns the paths written. On a concurrency sweep the knee is marked:
    :func:`~iterserve.bench.knee.read_knee` of median TPOT over the concurrency caps, the same rule
    ``bench batch`` applies to decode steps over batch sizes (no knee on a non-monotone sweep)."""
    latency_path = prefix.with_name(f"{prefix.name}_latency.png")
    throughput_path = prefix.with_name(f"{prefix.name}_throughput.png")
    axes = [load_axis(result["runs"]) for result in results]
    series = []
    for result, (axis, points) in zip(results, axes):
        runs = [run for _, run in points] or result["runs"]
        knee = None
        if axis == "max concurrency" and len(points) > 1:
            knee_load, refused = read_knee([x for x, _ in points], [run["median_tpot_ms"] for run in runs],
                                           axis="concurrency")
            if refused:
                logger.warning("%s: knee %s", result["label"], refused)
            knee = next((i for i, (x, _) in enumerate(points) if x == knee_load), None)
        series.append(Series(
            result["label"], [run["output_throughput"] for run in runs], [run["median_tpot_ms"] for run in runs],
            [run_label(run) for run in runs], knee,
        ))
    throughput_latency_chart(series, throughput_path, xlabel="output throughput (tokens/s)",
                             ylabel="median TPOT (ms)", title="throughput against latency")
    if not any(points for _, points in axes):
        return [throughput_path]
    latency_vs_load_chart(results, latency_path, percentiles_in([run for r in results for run in r["runs"]]))
    return [throughput_path, latency_path]


# -- timeline -------------------------------------------------------------------------------------

PHASE_COLORS = {"queue": "#d0d0d0", "prefill": "#f28e2b", "decode": "#4e79a7"}


def read_trace(path: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The step and request records of an engine step trace (JSON lines)."""
    steps: list[dict[str, Any]] = []
    requests: list[dict[str, Any]] = []
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            (steps if record["type"] == "step" else requests).append(record)
    return steps, requests


def sequence_spans(steps: list[dict[str, Any]]) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """request id -> phase -> (start, duration) spans; a phase over consecutive steps is one span."""
    spans: dict[str, dict[str, list[tuple[float, float]]]] = {}
    last_step: dict[tuple[str, str], int] = {}
    for step in steps:
        end = step["start"] + step["duration"]
        for rid, phase, *_ in step["seqs"]:
            phase_spans = spans.setdefault(rid, {}).setdefault(phase, [])
            if last_step.get((rid, phase)) == step["step"] - 1:
                s, _ = phase_spans[-1]
                phase_spans[-1] = (s, end - s)
            else:
                phase_spans.append((step["start"], step["duration"]))
            last_step[(rid, phase)] = step["step"]
    return spans


def step_spans(steps: list[dict[str, Any]]) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """As :func:`sequence_spans`, in engine steps: step ``k`` (1-based in the trace) spans ``[k-1, k)``."""
    return sequence_spans([{**s, "start": s["step"] - 1, "duration": 1} for s in steps])


def _draw_rows(ax: Any, steps: list[dict[str, Any]], requests: list[dict[str, Any]], x: str) -> None:
    """One row per request (by arrival): queue, prefill and decode spans, in steps or seconds."""
    if x == "steps":
        first_step: dict[str, int] = {}
        for step in steps:
            for rid, *_ in step["seqs"]:
                first_step.setdefault(rid, step["step"] - 1)
        spans, t0 = step_spans(steps), 0.0
        queued = {r["request_id"]: (0.0, float(first_step.get(r["request_id"], 0))) for r in requests}
    else:
        t0 = min([r["arrival_time"] for r in requests] + [s["start"] for s in steps[:1]])
        spans = sequence_spans(steps)
        queued = {r["request_id"]: (r["arrival_time"] - t0, r["first_scheduled_time"] - r["arrival_time"])
                  for r in requests}
    for y, r in enumerate(requests):
        ax.broken_barh([queued[r["request_id"]]], (y - 0.4, 0.8), facecolors=PHASE_COLORS["queue"])
        for phase in ("prefill", "decode"):
            segments = [(s - t0, w) for s, w in spans.get(r["request_id"], {}).get(phase, [])]
            ax.broken_barh(segments, (y - 0.4, 0.8), facecolors=PHASE_COLORS[phase])


def _scheduled_requests(trace: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    steps, requests = read_trace(trace)
    requests = [r for r in requests if r["first_scheduled_time"] is not None]
    requests.sort(key=lambda r: (r["arrival_time"], int(r["request_id"]) if r["request_id"].isdigit() else 0))
    return steps, requests


def timeline_chart(
    traces: dict[str, str | Path], path: str | Path, *, x: str = "steps", max_num_seqs: int | None = None,
    busy: bool = False,
) -> None:
    """Each sequence's queue, prefill and decode spans, one panel per trace, side by side, with the
    running sequences and KV blocks of every step drawn under each panel.

    The x-axis counts engine steps by default, so the picture is the same on any machine and a
    stall of the machine cannot pass for batching waste; ``x="time"`` draws wall time instead
    (``busy`` then notes that the machine was busy). All panels share their axes, so a batch slot
    that static batching leaves idle shows as white space a continuous run fills.
    """
    if x not in ("steps", "time"):
        raise ValueError(f"timeline x-axis must be 'steps' or 'time', got {x!r}")
    n = len(traces)
    loaded = {label: _scheduled_requests(trace) for label, trace in traces.items()}
    top_blocks = max(s["kv_blocks_used"] for steps, _ in loaded.values() for s in steps)
    fig, axes = subplots(2, n, figsize=(6.5 * n, 6.5), sharex=True, sharey="row", squeeze=False,
                             gridspec_kw={"height_ratios": [3, 1]})
    for k, (label, (steps, requests)) in enumerate(loaded.items()):
        ax, occ = axes[0][k], axes[1][k]
        _draw_rows(ax, steps, requests, x)
        running = [len(s["seqs"]) for s in steps]
        out_tokens = sum(r["num_output_tokens"] for r in requests)
        occupancy = f", slot occupancy {sum(running) / len(running) / max_num_seqs:.0%}" if max_num_seqs else ""
        ax.set(title=f"{label}: {len(steps)} steps, {out_tokens / max(len(steps), 1):.2f} tokens out per step"
                     f"{occupancy}", ylabel="request (by arrival)")
        ax.title.set_fontsize(9)
        if x == "steps":
            xs = [s["step"] - 1 for s in steps]
            widths = [1.0] * len(steps)
        else:
            t0 = min([r["arrival_time"] for r in requests] + [s["start"] for s in steps[:1]])
            xs, widths = [s["start"] - t0 for s in steps], [s["duration"] for s in steps]
        occ.bar(xs, running, width=widths, align="edge", color=PHASE_COLORS["decode"], linewidth=0,
                label="running sequences")
        if max_num_seqs:
            occ.axhline(max_num_seqs, color="black", linestyle="--", linewidth=0.8, label="max_num_seqs")
        blocks = occ.twinx()
        blocks.step(xs, [s["kv_blocks_used"] for s in steps], where="post", color="#e15759", linewidth=1)
        blocks.set_ylim(0, top_blocks * 1.1)  # one scale in every panel, so KV use compares across modes
        blocks.set_ylabel("KV blocks held", color="#e15759", fontsize=8)
        blocks.tick_params(axis="y", labelsize=7, colors="#e15759")
        occ.set(xlabel="engine step" if x == "steps" else "time (s)", ylabel="running")
        occ.legend(fontsize=7, loc="upper right")
    axes[0][0].invert_yaxis()  # the y axis is shared: inverting it once flips every panel
    fig.legend(handles=[Patch(color=c, label=p) for p, c in PHASE_COLORS.items()], loc="upper right", ncols=3)
    if x == "time" and busy:
        fig.suptitle("wall time on a busy machine: stalls of the machine show as long spans", x=0.02, ha="left",
                     fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)


def joins_chart(trace: str | Path, path: str | Path, *, max_num_seqs: int | None = None) -> int:
    """Iteration-level scheduling in one step trace: per step, the sequences already decoding and
    the requests whose prefill joins them; above, each request's spans. Returns how many requests
    joined a batch that was already decoding."""
    steps, requests = _scheduled_requests(trace)
    fig, (ax, bars) = subplots(2, 1, figsize=(9, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    _draw_rows(ax, steps, requests, "steps")
    ax.invert_yaxis()
    xs = [s["step"] - 1 for s in steps]
    started: set[str] = set()
    joining, decoding, joined = [], [], 0
    for s in steps:
        new = [rid for rid, phase, *_ in s["seqs"] if phase == "prefill" and rid not in started]
        started.update(new)
        joined += len(new) if s["num_decode_seqs"] > 0 else 0
        joining.append(len(new))
        decoding.append(len(s["seqs"]) - len(new))
    bars.bar(xs, decoding, width=1.0, align="edge", color=PHASE_COLORS["decode"], linewidth=0,
             label="already in the batch")
    bars.bar(xs, joining, width=1.0, align="edge", bottom=decoding, color=PHASE_COLORS["prefill"], linewidth=0,
             label="joining at this step (prefill)")
    if max_num_seqs:
        bars.axhline(max_num_seqs, color="black", linestyle="--", linewidth=0.8, label="max_num_seqs")
    ax.set(title=f"{joined} of {len(requests)} requests joined a batch that was already decoding",
           ylabel="request (by arrival)")
    bars.set(xlabel="engine step", ylabel="sequences in the step")
    bars.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return joined


# -- summaries ------------------------------------------------------------------------------------


def _with_spread(ax: Any, labels: list[str], medians: list[float], runs: list[list[float]], color: str) -> None:
    """Bars at the medians, error bars from min to max over the runs."""
    lo = [m - min(r) if r else 0.0 for m, r in zip(medians, runs)]
    hi = [max(r) - m if r else 0.0 for m, r in zip(medians, runs)]
    ax.bar(labels, medians, color=color, yerr=[lo, hi], capsize=4)


def throughput_summary_chart(result: dict[str, Any], path: str | Path) -> None:
    """A ``bench throughput`` result in three panels: output tokens per step (a count), output tokens/s
    and median end-to-end latency (medians, min-max over the repeats as error bars)."""
    runs = result["runs"]
    labels = [r["mode"] for r in runs]
    fig, axes = subplots(1, 3, figsize=(12, 3.8))
    axes[0].bar(labels, [r["output_tokens_per_step"] for r in runs], color="#59a14f")
    axes[0].set(title="output tokens per engine step\n(a count: the same on any machine)")
    _with_spread(axes[1], labels, [r["output_throughput"] for r in runs], [r["output_throughput_runs"] for r in runs],
                 "#4e79a7")
    runs_text = f"median, min-max of {result['repeats']} runs" if result["repeats"] > 1 else "one run"
    axes[1].set(title=f"output tokens/s\n({runs_text})")
    e2el = [[x["median_e2el_ms"] for x in r["latency_runs"] or []] for r in runs]
    _with_spread(axes[2], labels, [(r["latency"] or {}).get("median_e2el_ms", 0.0) for r in runs], e2el, "#f28e2b")
    axes[2].set(title=f"median end-to-end latency, ms\n({runs_text})")
    for ax in axes:
        ax.grid(alpha=0.3, axis="y")
    if result.get("busy_warning"):
        fig.suptitle("measured on a busy machine: wall-clock panels are noisy", fontsize=9, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)


def prompt_sweep_chart(points: list[Any], path: str | Path, *, busy: bool = False) -> None:
    """TTFT and TPOT against prompt length (medians, min-max as error bars), from a prompt-length sweep."""
    xs = [p.prompt_len for p in points]
    fig, axes = subplots(1, 2, figsize=(10, 3.8), sharex=True)
    for ax, key, title, color in ((axes[0], "ttft", "time to first token (prefill)", "#f28e2b"),
                                  (axes[1], "tpot", "time per output token (decode)", "#4e79a7")):
        med = [getattr(p, f"{key}_ms") for p in points]
        runs = [getattr(p, f"{key}_ms_runs") for p in points]
        ax.errorbar(xs, med, yerr=[[m - min(r) for m, r in zip(med, runs)], [max(r) - m for m, r in zip(med, runs)]],
                    marker="o", color=color, capsize=3)
        ax.set(title=title, xlabel="prompt tokens", ylabel="ms", ylim=(0, None))
        ax.grid(alpha=0.3)
    if busy:
        fig.suptitle("measured on a busy machine: spreads are wide", fontsize=9, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)


def request_steps_chart(point: Any, path: str | Path, *, busy: bool = False) -> None:
    """One lone request, step by step: the tokens each forward pass processed and how long it took.

    The first bar is the prefill (every prompt token in one pass), each later bar a decode (one token).
    """
    steps = range(1, len(point.step_tokens) + 1)
    colors = ["#f28e2b"] + ["#4e79a7"] * (len(point.step_tokens) - 1)
    fig, (top, bottom) = subplots(2, 1, figsize=(8, 5), sharex=True)
    top.bar(steps, point.step_tokens, color=colors)
    top.set(ylabel="tokens in the pass (log)", yscale="log", ylim=(0.5, None),
            title=f"one request, prompt {point.prompt_len} tokens: one prefill pass, then one pass per token")
    bottom.bar(steps, point.step_ms, color=colors)
    bottom.set(xlabel="engine step of this request", ylabel="step time (ms)", xticks=list(steps))
    bottom.legend(handles=[Patch(color="#f28e2b", label="prefill"), Patch(color="#4e79a7", label="decode")])
    for ax in (top, bottom):
        ax.grid(alpha=0.3, axis="y")
    if busy:
        fig.suptitle("measured on a busy machine: step times are noisy", fontsize=9, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)

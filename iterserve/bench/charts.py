"""PNG charts of benchmark results: throughput against latency over a sweep, latency percentiles
against load for one or more servers, and the summaries of bench throughput, load and ttft (the step
trace's timeline is :mod:`iterserve.bench.timeline`). A timing chart carries a stamp: the machine it
was measured on and its load."""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from iterserve.bench.knee import read_knee
from iterserve.bench.machine import stamp_figure

if TYPE_CHECKING:
    from iterserve.bench.batch import BatchSweep

logger = logging.getLogger(__name__)


def subplots(*grid: int, figsize: tuple[float, float], **kwargs: Any) -> tuple[Figure, Any]:
    """A figure on its own Agg canvas (charts are PNG files): no pyplot state, no global backend."""
    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(*grid, **kwargs)


def save_figure(fig: Figure, path: str | Path, *, dpi: int = 110, stamp: str | None = None,
                top: float = 1.0) -> None:
    """Lay the figure out (below ``top``, above the stamp's line when there is one) and write it,
    creating the folder it goes in."""
    stamp_figure(fig, stamp)
    fig.tight_layout(rect=(0, 0.03 if stamp else 0, 1, top))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)


@dataclass
class Series:
    """One curve of a throughput-latency chart; ``knee`` names the point to mark, if any."""

    label: str
    throughput: list[float]
    latency: list[float]
    point_labels: list[str]
    knee: int | None = None  # index into the points


def throughput_latency_chart(series: list[Series], path: str | Path, *, xlabel: str, ylabel: str, title: str,
                             stamp: str | None = None) -> None:
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
    save_figure(fig, path, dpi=120, stamp=stamp)


def batch_sweep_chart(sweep: BatchSweep, path: str | Path, *, stamp: str | None = None) -> None:
    """``bench batch``'s sweep: decode tokens/s against step time, one point per batch size, the knee circled."""
    sizes = [p.batch_size for p in sweep.points]
    throughput_latency_chart(
        [Series(f"{sweep.model} ({sweep.dtype})", [p.decode_tokens_per_s for p in sweep.points],
                [p.decode_s * 1000 for p in sweep.points], [f"B={b}" for b in sizes],
                sizes.index(sweep.knee_batch_size) if sweep.knee_batch_size is not None else None)],
        path, xlabel="decode throughput (tokens/s)", ylabel="decode step = time per output token (ms)",
        title=f"decode batch sweep at context {sweep.context} ({sweep.device})", stamp=stamp,
    )


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
    save_figure(fig, path, dpi=120)


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


# -- summaries ------------------------------------------------------------------------------------


def _with_spread(ax: Any, labels: list[str], medians: list[float], runs: list[list[float]], color: str) -> None:
    """Bars at the medians, error bars from min to max over the runs."""
    lo = [m - min(r) if r else 0.0 for m, r in zip(medians, runs)]
    hi = [max(r) - m if r else 0.0 for m, r in zip(medians, runs)]
    ax.bar(labels, medians, color=color, yerr=[lo, hi], capsize=4)


def throughput_summary_chart(result: dict[str, Any], path: str | Path, *, stamp: str | None = None) -> None:
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
    save_figure(fig, path, stamp=stamp)


MODE_COLORS = {"static": "#e15759", "dynamic": "#f28e2b", "continuous": "#4e79a7", "reserved": "#76b7b2"}


def offered_load_chart(result: dict[str, Any], path: str | Path, *, stamp: str | None = None) -> None:
    """A ``bench load`` result: output tokens/s served and TTFT (p50 solid, p99 dashed) against the
    offered load, one colour per batching policy; the dotted diagonal is the load offered."""
    fig, (served, ttft) = subplots(1, 2, figsize=(11, 4.3))
    points = result["points"]
    loads = sorted({p["load"] for p in points})
    offered = [x * result["capacity_output_throughput"] for x in loads]
    served.plot(loads, offered, ":", color="grey", label="offered (tokens/s asked for)")
    for mode in dict.fromkeys(p["mode"] for p in points):
        mine = sorted((p for p in points if p["mode"] == mode), key=lambda p: p["load"])
        xs, color = [p["load"] for p in mine], MODE_COLORS.get(mode)
        served.plot(xs, [p["output_throughput"] for p in mine], "o-", color=color, label=mode)
        ttft.plot(xs, [p["p50_ttft_ms"] for p in mine], "o-", color=color, label=f"{mode} p50")
        ttft.plot(xs, [p["p99_ttft_ms"] for p in mine], "s--", color=color, label=f"{mode} p99")
    xlabel = f"offered load (1 = {result['capacity_request_rate']:.3g} req/s, continuous batching's capacity)"
    served.set(xlabel=xlabel, ylabel="output tokens/s served", title="throughput", ylim=(0, None))
    ttft.set(xlabel=xlabel, ylabel="time to first token, ms (log)", yscale="log", title="TTFT: p50 and p99")
    served.legend(fontsize=8, loc="upper left")
    top = max(p["p99_ttft_ms"] for p in points)
    ttft.set_ylim(top=top * 6)  # room above the lines for the legend, on the log scale
    ttft.legend(fontsize=7, loc="upper left", ncols=3)
    for ax in (served, ttft):
        ax.grid(alpha=0.3, which="both")
    n = result["num_requests"]
    fig.suptitle(f"{result['model']} ({result['dtype']}): {n} requests arriving at random (Poisson) at each load, "
                 f"max_num_seqs {result['engine']['max_num_seqs']}", fontsize=10)
    save_figure(fig, path, stamp=stamp, top=0.95)


def prompt_sweep_chart(points: list[Any], path: str | Path, *, stamp: str | None = None) -> None:
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
    save_figure(fig, path, stamp=stamp)


def request_steps_chart(point: Any, path: str | Path, *, stamp: str | None = None) -> None:
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
    save_figure(fig, path, stamp=stamp)

"""Pictures of an engine step trace (the JSON lines ``--step-trace`` writes, which the simulator writes
too): every request's queue, prefill and decode spans, and under them the batch of every step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from matplotlib.patches import Patch

from iterserve.bench.charts import save_figure, subplots

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


def first_prefills(steps: list[dict[str, Any]]) -> list[list[str]]:
    """Per step, the requests whose prefill started in it (a request preempted and recomputed counts once)."""
    started: set[str] = set()
    out = []
    for s in steps:
        new = [rid for rid, phase, *_ in s["seqs"] if phase == "prefill" and rid not in started]
        started.update(new)
        out.append(new)
    return out


def joined_running_batch(steps: list[dict[str, Any]]) -> int:
    """Requests whose prefill started in a step that also decoded others: they joined a running batch."""
    return sum(len(new) for s, new in zip(steps, first_prefills(steps)) if s["num_decode_seqs"] > 0)


def _draw_batches(occ: Any, steps: list[dict[str, Any]], xs: list[float], widths: list[float],
                  max_num_seqs: int | None) -> None:
    """Each step's sequences: those already in the batch, and those joining it (their first prefill)."""
    joining = [len(new) for new in first_prefills(steps)]
    running = [len(s["seqs"]) - j for s, j in zip(steps, joining)]
    occ.bar(xs, running, width=widths, align="edge", color=PHASE_COLORS["decode"], linewidth=0,
            label="already in the batch")
    occ.bar(xs, joining, width=widths, align="edge", bottom=running, color=PHASE_COLORS["prefill"], linewidth=0,
            label="joining (first prefill)")
    top = max([r + j for r, j in zip(running, joining)] + [max_num_seqs or 0])
    if max_num_seqs:  # above the bars, and the axis taller than it, so a full batch does not hide it
        occ.axhline(max_num_seqs, color="black", linestyle="--", linewidth=1.2, zorder=3, label="max_num_seqs")
    occ.set_ylim(0, top * 1.35 + 0.5)


def timeline_chart(
    traces: dict[str, str | Path], path: str | Path, *, x: str = "steps", max_num_seqs: int | None = None,
    stamp: str | None = None,
) -> None:
    """Each sequence's queue, prefill and decode spans, one panel per trace, side by side, with the
    sequences of every step (already running, and joining) and the KV blocks held drawn under each panel.

    The x-axis counts engine steps by default, so the picture is the same on any machine and a
    stall of the machine cannot pass for batching waste; ``x="time"`` draws time instead (the
    simulator's, or the wall clock: ``stamp`` then says what machine it was). All panels share their
    axes, so a batch slot that static batching leaves idle shows as white space a continuous run fills.
    """
    if x not in ("steps", "time"):
        raise ValueError(f"timeline x-axis must be 'steps' or 'time', got {x!r}")
    n = len(traces)
    loaded = {label: _scheduled_requests(trace) for label, trace in traces.items()}
    top_blocks = max(s["kv_blocks_used"] for steps, _ in loaded.values() for s in steps)
    fig, axes = subplots(2, n, figsize=(6.5 * n, 6.5), sharex=True, sharey="row", squeeze=False,
                         gridspec_kw={"height_ratios": [3, 1.3]})
    for k, (label, (steps, requests)) in enumerate(loaded.items()):
        ax, occ = axes[0][k], axes[1][k]
        _draw_rows(ax, steps, requests, x)
        running = [len(s["seqs"]) for s in steps]
        out_tokens = sum(r["num_output_tokens"] for r in requests)
        occupancy = f", slots {sum(running) / len(running) / max_num_seqs:.0%} full" if max_num_seqs else ""
        ax.set(title=f"{label}: {len(steps)} steps, {out_tokens / max(len(steps), 1):.2f} tokens out per step"
                     f"{occupancy},\n{joined_running_batch(steps)} of {len(requests)} requests joined a running batch",
               ylabel="request (by arrival)")
        ax.title.set_fontsize(9)
        if x == "steps":
            xs = [float(s["step"] - 1) for s in steps]
            widths = [1.0] * len(steps)
        else:
            t0 = min([r["arrival_time"] for r in requests] + [s["start"] for s in steps[:1]])
            xs, widths = [s["start"] - t0 for s in steps], [s["duration"] for s in steps]
        _draw_batches(occ, steps, xs, widths, max_num_seqs)
        blocks = occ.twinx()
        blocks.step(xs, [s["kv_blocks_used"] for s in steps], where="post", color="#e15759", linewidth=1)
        blocks.set_ylim(0, top_blocks * 1.1)  # one scale in every panel, so KV use compares across modes
        blocks.set_ylabel("KV blocks held", color="#e15759", fontsize=8)
        blocks.tick_params(axis="y", labelsize=7, colors="#e15759")
        occ.set(xlabel="engine step" if x == "steps" else "time (s)", ylabel="sequences")
        occ.legend(fontsize=7, loc="upper left", ncols=3)
    axes[0][0].invert_yaxis()  # the y axis is shared: inverting it once flips every panel
    fig.legend(handles=[Patch(color=c, label=p) for p, c in PHASE_COLORS.items()], loc="upper right", ncols=3)
    save_figure(fig, path, stamp=stamp, top=0.95)


def joins_chart(trace: str | Path, path: str | Path, *, max_num_seqs: int | None = None) -> int:
    """Iteration-level scheduling in one step trace: per step, the sequences already decoding and
    the requests whose prefill joins them; above, each request's spans. Returns how many requests
    joined a batch that was already decoding."""
    steps, requests = _scheduled_requests(trace)
    fig, (ax, bars) = subplots(2, 1, figsize=(9, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    _draw_rows(ax, steps, requests, "steps")
    ax.invert_yaxis()
    _draw_batches(bars, steps, [float(s["step"] - 1) for s in steps], [1.0] * len(steps), max_num_seqs)
    joined = joined_running_batch(steps)
    ax.set(title=f"{joined} of {len(requests)} requests joined a batch that was already decoding",
           ylabel="request (by arrival)")
    bars.set(xlabel="engine step", ylabel="sequences in the step")
    bars.legend(fontsize=8, loc="upper left", ncols=3)
    save_figure(fig, path)
    return joined


# bench throughput's panel titles, in panel order: the batching and how KV blocks are allocated
MODE_LABELS = {"static": "static, paged KV", "continuous": "continuous, paged KV",
               "reserved": "continuous, reserved KV", "no-spec": "continuous, no speculation"}


def modes_timeline_chart(traces: dict[str, str | Path], path: str | Path, *, x: str = "steps",
                         max_num_seqs: int | None = None, stamp: str | None = None) -> None:
    """:func:`timeline_chart` of a ``bench throughput`` run's step traces (by mode), one panel per mode in
    :data:`MODE_LABELS`'s order."""
    if not traces:
        raise ValueError("--timeline draws the engine's modes; include continuous, static or reserved")
    order = sorted(traces, key=list(MODE_LABELS).index)
    timeline_chart({MODE_LABELS[m]: traces[m] for m in order}, path, x=x, max_num_seqs=max_num_seqs, stamp=stamp)


def continuous_joins_chart(traces: dict[str, str | Path], path: str | Path, *, max_num_seqs: int | None = None) -> None:
    """:func:`joins_chart` of a ``bench throughput`` run's continuous mode."""
    if "continuous" not in traces:
        raise ValueError("--joins draws the continuous run's step trace; include continuous in --modes")
    joins_chart(traces["continuous"], path, max_num_seqs=max_num_seqs)

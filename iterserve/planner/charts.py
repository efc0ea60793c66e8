"""The planner's charts: predicted decode sweeps, a prediction against measured steps, a roofline with
the steps' arithmetic intensity on it, and how many sequences the KV cache holds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from iterserve.bench.charts import save_figure, subplots
from iterserve.config import ModelConfig
from iterserve.planner.hardware import Accelerator
from iterserve.planner.roofline import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    Plan,
    kv_bytes_per_token,
    kv_capacity,
    model_label,
)
from iterserve.planner.weights import Quantization

if TYPE_CHECKING:
    from iterserve.bench.validate import Validation


@dataclass(frozen=True)
class PlanCharts:
    """Where ``iterserve plan`` draws each chart (None: not drawn)."""

    plans: str | None = None  # tokens/s and latency against batch
    roofline: str | None = None
    capacity: str | None = None  # sequences that fit against context length


def chart_plans(plans: list[Plan], path: str, stamp: str | None = None) -> None:
    """Predicted tokens/s and per-token latency vs batch, knee and memory limit marked."""
    fig, (ax_tps, ax_lat) = subplots(1, 2, figsize=(11, 4.5))
    for i, p in enumerate(plans):
        color = f"C{i}"
        b = [s.batch for s in p.sweep]
        ax_tps.plot(b, [s.tokens_per_s for s in p.sweep], "o-", color=color, ms=3, label=p.hardware.name)
        ax_lat.plot(b, [s.decode.time_s * 1e3 for s in p.sweep], "o-", color=color, ms=3, label=p.hardware.name)
        if p.knee_batch is not None:
            k = p.knee_batch
            for ax in (ax_tps, ax_lat):
                ax.axvline(k, color=color, ls="--", lw=1)
            kp = p.knee_point
            assert kp is not None  # a plan with a knee has its point
            ax_tps.plot([k], [kp.tokens_per_s], "*", color=color, ms=12, label=f"knee B={k}")
            ax_lat.plot([k], [kp.decode.time_s * 1e3], "*", color=color, ms=12)
        if p.capacity.max_seqs >= 1:
            for ax in (ax_tps, ax_lat):
                ax.axvline(p.capacity.max_seqs, color=color, ls=":", lw=1)
    _log_batch_axes(((ax_tps, "tokens/s (all sequences)"), (ax_lat, "per-token latency, ms (TPOT)")),
                    "batch size (concurrent sequences)")
    first = plans[0]
    ax_tps.legend(fontsize=8)
    fig.suptitle(
        f"{first.model}, {first.dtype}, decode at {first.context} ctx: roofline prediction "
        "(dashed: knee, dotted: memory limit)",
        fontsize=10,
    )
    save_figure(fig, path, dpi=120, stamp=stamp)


def _log_batch_axes(axes: Sequence[tuple[Any, str]], xlabel: str) -> None:
    """Log-log axes against batch size, as every planner chart draws them."""
    for ax, ylabel in axes:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)


def chart_validation(v: Validation, path: str, stamp: str | None = None) -> None:
    """Predicted vs measured decode step time and tokens/s, with both knees marked."""
    fig, (ax_t, ax_tps) = subplots(1, 2, figsize=(11, 4.5))
    b = [r.batch for r in v.rows]
    pred = [r.predicted_s for r in v.rows]
    meas = [r.measured_s for r in v.rows]
    ax_t.plot(b, [t * 1e3 for t in pred], "o-", color="C0", label="predicted (roofline)")
    ax_t.plot(b, [t * 1e3 for t in meas], "s-", color="C1", label="measured")
    ax_tps.plot(b, [x / t for x, t in zip(b, pred)], "o-", color="C0", label="predicted (roofline)")
    ax_tps.plot(b, [x / t for x, t in zip(b, meas)], "s-", color="C1", label="measured")
    for knee, color, label in ((v.predicted_knee, "C0", "predicted knee"), (v.measured_knee, "C1", "measured knee")):
        if knee is not None:
            for ax in (ax_t, ax_tps):
                ax.axvline(knee, color=color, ls="--", lw=1, label=f"{label} B={knee}" if ax is ax_t else None)
    _log_batch_axes(((ax_t, "decode step time, ms"), (ax_tps, "tokens/s")), "batch size")
    ax_t.legend(fontsize=8)
    fig.suptitle(f"{v.model}, {v.dtype}, decode at {v.context} ctx on {v.hardware.name}", fontsize=10)
    save_figure(fig, path, dpi=120, stamp=stamp)


def chart_roofline(p: Plan, path: str, stamp: str | None = None) -> None:
    """The roofline of ``p``'s hardware, attainable FLOP/s = min(peak, intensity x bandwidth), with the
    ridge at ops:byte and the plan's steps placed on it by their arithmetic intensity: the decode
    step at every swept batch, and the prefill."""
    fig, ax = subplots(figsize=(8.5, 5))
    peak, bw, ridge = p.peak_flops, p.bandwidth, p.ops_per_byte
    points = [(f"decode B={s.batch}", s.decode.intensity) for s in p.sweep] + [
        (f"prefill {p.prompt_len} tok", p.prefill.intensity)]
    lo = min([ridge, *(x for _, x in points)]) / 4
    hi = max([ridge, *(x for _, x in points)]) * 4
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(xs, [min(peak, x * bw) for x in xs], color="black", lw=2, label="attainable FLOP/s")
    ax.axvline(ridge, color="#e15759", ls="--", lw=1.2,
               label=f"ops:byte ridge = {peak / 1e9:,.4g} GFLOP/s / {bw / 1e9:,.3g} GB/s = {ridge:,.3g}")
    for k, (label, x) in enumerate(points):
        prefill = label.startswith("prefill")
        ax.plot([x], [min(peak, x * bw)], "s" if prefill else "o", ms=7,
                color="#f28e2b" if prefill else "#4e79a7", zorder=3)
        if prefill or k in (0, len(p.sweep) - 1) or k % 2 == 0:
            ax.annotate(label, (x, min(peak, x * bw)), textcoords="offset points", xytext=(5, -12), fontsize=7)
    ax.fill_betweenx([peak / 1e4, peak * 2], lo, ridge, color="#4e79a7", alpha=0.06)
    ax.text(lo * 1.3, peak * 1.2, "memory-bound", fontsize=8, color="#4e79a7")
    ax.text(ridge * 1.3, peak * 1.2, "compute-bound", fontsize=8, color="#e15759")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(min(peak / 1e3, lo * bw), peak * 2),
           xlabel="arithmetic intensity (FLOPs per byte moved)", ylabel=f"attainable {p.dtype} FLOP/s",
           title=f"{p.model} on {p.hardware.name}: decode at {p.context} ctx (blue, one per batch) and prefill")
    ax.title.set_fontsize(9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    save_figure(fig, path, dpi=120, stamp=stamp)


def chart_capacity(cfg: Any, hws: Sequence[Accelerator], dtype: str, kv_dtype: str | None, path: str,
                   gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
                   quantization: Quantization | None = None) -> None:
    """Sequences whose KV cache fits beside the weights, against their context length, per accelerator."""
    fig, ax = subplots(figsize=(7.5, 4.5))
    contexts = [c for c in (2 ** k for k in range(7, 18)) if c <= cfg.max_position_embeddings]
    for i, hw in enumerate(hws):
        seqs = []
        for c in contexts:
            try:
                seqs.append(kv_capacity(cfg, hw, c, dtype, kv_dtype, gpu_memory_utilization,
                                                quantization=quantization).max_seqs)
            except ValueError:  # the weights do not fit: no sequence does
                seqs.append(0)
        ax.plot(contexts, [max(s, 0.5) for s in seqs], "o-", color=f"C{i}", label=hw.name)
        for c, s in zip(contexts, seqs):
            if c in (contexts[0], 4096, contexts[-1]):
                ax.annotate(f"{s:,}", (c, max(s, 0.5)), textcoords="offset points", xytext=(4, 4), fontsize=7)
    kv = kv_bytes_per_token(cfg, kv_dtype or dtype)
    _log_batch_axes(((ax, "sequences that fit at once"),), "context length (tokens per sequence)")
    ax.set_title(f"{model_label(cfg)}: {kv:,} B of KV cache per token ({kv_dtype or dtype}), "
                 f"weights in {dtype if quantization is None or quantization.name == 'none' else quantization.name}, "
                 f"{gpu_memory_utilization:g} of memory used", fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, path, dpi=120)


def draw_plan_charts(plans: list[Plan], shard: ModelConfig, hws: Sequence[Accelerator], dtype: str,
                     kv_dtype: str | None, quantization: Quantization, gpu_memory_utilization: float,
                     paths: PlanCharts, machine: dict[str, Any] | None = None, allow_busy: bool = False) -> list[str]:
    """Draw the asked-for charts of ``iterserve plan``; returns the paths written. Where this machine was measured
    (``machine``: its readings), the timing charts carry its stamp and are refused if it was busy meanwhile, and
    the roofline is the measured machine's (the last plan)."""
    stamp, timed = None, True
    if machine is not None:
        from iterserve.bench.machine import machine_stamp, may_draw_timing_figure

        stamp = machine_stamp(machine)
        timed = may_draw_timing_figure(machine, "this machine's roofline and plan (its ops:byte)", allow_busy)
    if paths.plans and timed:
        chart_plans(plans, paths.plans, stamp=stamp)
    if paths.roofline and timed:
        chart_roofline(plans[-1] if machine is not None else plans[0], paths.roofline, stamp=stamp)
    if paths.capacity:
        chart_capacity(shard, hws, dtype, kv_dtype, paths.capacity, gpu_memory_utilization, quantization)
    return [c for c in (paths.plans if timed else None, paths.roofline if timed else None, paths.capacity) if c]


"""The capacity planner's report: the model, roofline, decode-sweep, speculation and validation tables that
``iterserve plan`` prints, formatted here so that the command line only parses and calls."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

from iterserve.bench.tables import render_table
from iterserve.config import ModelConfig
from iterserve.planner.hardware import ACCELERATORS, GiB
from iterserve.planner.roofline import Plan
from iterserve.planner.speculative import crossover_batch, mean_accepted_length, speculative_sweep
from iterserve.planner.weights import Quantization

if TYPE_CHECKING:
    from iterserve.bench.validate import Validation


def _fmt_count(n: float) -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}"
    return f"{n:g}"


def _fmt_gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _fmt_time(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.1f} µs"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.3f} s"


def _fmt_flops(f: float) -> str:
    return f"{f / 1e12:.1f} TFLOP/s" if f >= 1e12 else f"{f / 1e9:.1f} GFLOP/s"


def _fmt_bw(b: float) -> str:
    return f"{b / 1e12:.2f} TB/s" if b >= 1e12 else f"{b / 1e9:.1f} GB/s"


def _print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]], out: TextIO) -> None:
    print(render_table(headers, rows, title), file=out)


def _knee_text(p: Plan) -> str:
    if p.knee_batch is None:
        return f"none (intensity < {p.decode_intensity_limit:.1f})"
    text = str(p.knee_batch)
    if not p.knee_reachable:
        text += " (> max seqs)"
    return text


def _tp_rows(first: Plan) -> list[tuple[str, Any]]:
    """The tensor-parallel rows of the roofline table: per-GPU memory and the all-reduce's share."""
    if first.tensor_parallel_size == 1:
        return []
    b = first.batch
    return [
        ("interconnect", lambda p: f"{p.interconnect.name} ({_fmt_bw(p.interconnect.bandwidth)})"),
        (f"compute / memory / all-reduce @ B={b}", lambda p: " / ".join(
            _fmt_time(t) for t in (p.decode.compute_s, p.decode.memory_s, p.decode.comm_s))),
        (f"TPOT all-reduce share @ B={b}", lambda p: f"{100 * p.decode.comm_share:.1f}%"),
    ]


def print_plans(plans: list[Plan], out: TextIO) -> None:
    first = plans[0]
    tp = first.tensor_parallel_size
    per_gpu = f" per GPU (of {tp})" if tp > 1 else ""
    weights = f"{first.dtype} weights" if first.quantization == "none" else f"{first.dtype} compute"
    _print_table(
        f"{first.model}: {weights}, {first.kv_dtype} KV cache"
        + (f", tensor parallel over {tp} GPUs" if tp > 1 else ""),
        ["model", "value"],
        [
            ["parameters", f"{_fmt_count(first.num_parameters)} ({first.num_parameters:,})"],
            ["weight format", first.quantization if first.quantization != "none"
             else f"{first.dtype} (no quantization)"],
            [f"matmul parameters (per-token work){per_gpu}", _fmt_count(first.matmul_parameters)],
            *([["weight memory, all GPUs", _fmt_gib(first.total_weight_bytes)]] if tp > 1 else []),
            [f"weight memory{per_gpu}", _fmt_gib(first.weight_bytes)],
            [f"weight bytes read per step{per_gpu}", _fmt_gib(first.streamed_weight_bytes)],
            [f"KV bytes per token{per_gpu}", f"{first.kv_bytes_per_token:,} B"],
            ["context / prompt / batch", f"{first.context} / {first.prompt_len} / {first.batch}"],
        ],
        out,
    )
    rows: list[tuple[str, Any]] = [*_tp_rows(first),
        (f"peak {first.dtype}", lambda p: _fmt_flops(p.peak_flops)),
        ("bandwidth", lambda p: _fmt_bw(p.bandwidth)),
        ("memory", lambda p: _fmt_gib(p.capacity.memory_bytes)),
        ("ops:byte", lambda p: f"{p.ops_per_byte:.1f}"),
        (f"KV memory{per_gpu} (x{first.gpu_memory_utilization:g} - weights)",
         lambda p: _fmt_gib(p.capacity.kv_budget_bytes)),
        ("KV tokens", lambda p: f"{p.capacity.kv_tokens:,}"),
        (f"max seqs @ {first.context} ctx", lambda p: f"{p.capacity.max_seqs:,}"),
        (f"decode knee @ {first.context} ctx", _knee_text),
        ("decode knee, weights only", lambda p: str(p.knee_batch_no_kv)),
        (f"prefill {first.prompt_len} tok", lambda p: f"{_fmt_time(p.prefill.time_s)} ({p.prefill.bound})"),
        ("prefill intensity", lambda p: f"{p.prefill.intensity:.0f}"),
        (f"decode intensity @ B={first.batch}", lambda p: f"{p.decode.intensity:.2f} ({p.decode.bound})"),
        (f"TTFT @ B={first.batch}", lambda p: _fmt_time(p.ttft_s)),
        (f"TPOT @ B={first.batch}", lambda p: _fmt_time(p.tpot_s)),
        (f"tokens/s @ B={first.batch}", lambda p: f"{p.tokens_per_s:,.0f}"),
    ]
    _print_table(
        "roofline" + (f" (one GPU of {tp}; times include the all-reduces)" if tp > 1 else ""),
        ["", *[p.hardware.name for p in plans]],
        [[label, *[fn(p) for p in plans]] for label, fn in rows],
        out,
    )
    batches = [s.batch for s in first.sweep]
    headers = ["batch"]
    for p in plans:
        headers += [f"{p.hardware.name} TPOT", "tok/s", "bound"]
    body = []
    for i, b in enumerate(batches):
        row = [str(b)]
        for p in plans:
            s = p.sweep[i]
            mark = "" if s.fits else "*"
            row += [_fmt_time(s.decode.time_s) + mark, f"{s.tokens_per_s:,.0f}", s.decode.bound]
        body.append(row)
    _print_table(f"decode sweep @ {first.context} ctx (* = more sequences than fit in memory)", headers, body, out)
    for p in plans:
        print(f"{p.hardware.name}: {p.hardware.source}", file=out)
        if p.interconnect is not None:
            print(f"{p.interconnect.name}: {p.interconnect.source}", file=out)


def print_speculation(plans: list[Plan], shard: ModelConfig, k: int, acceptance: float, out: TextIO,
                      quantization: Quantization | None = None) -> None:
    """Decode tokens/s with and without speculative decoding over each plan's sweep (``shard``: what one
    device holds), and the batch where speculation stops paying."""
    length = mean_accepted_length(k, acceptance)
    for p in plans:
        points = speculative_sweep(shard, p.hardware, [s.batch for s in p.sweep], p.context, k, acceptance,
                                   p.dtype, p.kv_dtype, quantization)
        rows = [(str(q.batch), f"{q.plain_tokens_per_s:,.0f}", f"{q.spec_tokens_per_s:,.0f}", f"{q.speedup:.2f}x",
                 q.verify_bound) for q in points]
        _print_table(f"Speculative decoding on {p.hardware.name}: k={k}, acceptance {acceptance:.2f} "
                     f"({length:.2f} tokens per pass)",
                     ["batch", "plain tok/s", "speculative tok/s", "speed-up", "verify step"], rows, out)
        cross = crossover_batch(points)
        print(f"speculation stops paying at batch {cross}" if cross else
              "speculation pays at every batch of the sweep", file=out)


def print_plan_report(plans: list[Plan], skipped: list[str], charts: list[str], out: TextIO, err: TextIO, *,
                      as_json: bool = False, speculation: tuple[ModelConfig, int, float, Quantization] | None = None
                      ) -> None:
    """What ``iterserve plan`` prints: the plans as JSON, or their tables (with ``speculation``'s, a shard and
    its drafts, acceptance and quantization, when given), the GPUs ``skipped`` (on ``err``) and the charts
    written."""
    if as_json:
        print(json.dumps({"plans": [p.to_dict() for p in plans], "skipped": skipped}, indent=2), file=out)
        return
    print_plans(plans, out)
    if speculation is not None:
        shard, k, acceptance, quantization = speculation
        print_speculation(plans, shard, k, acceptance, out, quantization)
    for line in skipped:
        print(f"skipped {line}", file=err)
    for chart in charts:
        print(f"chart written to {chart}", file=out)


def print_validation(v: Validation, out: TextIO, as_json: bool = False, chart: str | None = None) -> None:
    """A prediction against measured decode steps: as JSON, or its table, the hardware and both knees."""
    if as_json:
        print(json.dumps({"validation": v.to_dict()}, indent=2, default=str), file=out)
        return
    hw = v.hardware
    _print_table(
        f"validation: {v.model}, {v.dtype}, decode at {v.context} ctx on {hw.name}",
        ["batch", "predicted", "measured", "error", "bound"],
        [
            [str(r.batch), _fmt_time(r.predicted_s), _fmt_time(r.measured_s),
             f"{100 * r.relative_error:+.1f}%", r.bound]
            for r in v.rows
        ],
        out,
    )
    flops = ", ".join(f"{k} {_fmt_flops(f)}" for k, f in hw.flops.items())
    print(f"hardware: {flops}; bandwidth {_fmt_bw(hw.bandwidth)} ({hw.source})", file=out)
    print(f"predicted knee: {v.predicted_knee if v.predicted_knee is not None else 'none'} "
          f"(on the swept batches: {v.predicted_knee_on_sweep or 'none'}); "
          f"measured knee: {v.measured_knee or 'none'}", file=out)
    if chart:
        print(f"chart written to {chart}", file=out)


def print_accelerators(out: TextIO, as_json: bool = False) -> None:
    """The table of known accelerators (or all their figures as JSON), each with where its figures come from."""
    if as_json:
        print(json.dumps({name: hw.to_dict() for name, hw in ACCELERATORS.items()}, indent=2), file=out)
        return
    keys = ["fp32", "tf32", "fp16", "bf16", "fp8", "int8"]
    _print_table(
        "accelerators (dense peak TFLOP/s; int8 in TOP/s)",
        ["GPU", *keys, "GB/s", "GiB"],
        [[hw.name, *[f"{hw.flops[k] / 1e12:g}" if k in hw.flops else "-" for k in keys],
          f"{hw.bandwidth / 1e9:g}", f"{hw.memory_bytes / GiB:g}"] for hw in ACCELERATORS.values()],
        out,
    )
    for hw in ACCELERATORS.values():
        print(f"{hw.name}: {hw.source}" + (f" ({hw.notes})" if hw.notes else ""), file=out)

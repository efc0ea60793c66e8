"""What ``iterserve bench`` prints: every subcommand's tables and headings (throughput, serve, batch, ttft,
perplexity, load, the counts of step traces) and the batch-1 bandwidth line, built here so that the command
line only parses and calls."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from iterserve.bench.metrics import percentile_key
from iterserve.bench.tables import render_table

if TYPE_CHECKING:
    from iterserve.bench.batch import BatchSweep
    from iterserve.bench.prompt_sweep import PromptPoint


def _spread(values: Sequence[float]) -> str:
    """``min-max`` of a repeated figure, or ``-`` for a single run."""
    return f"{min(values):,.2f}-{max(values):,.2f}" if len(values) > 1 else "-"


def throughput_report(result: dict[str, Any]) -> str:
    """The ``bench throughput`` tables: counts first (the same on any machine), then wall-clock
    medians with their spread over the repeats, then the ratios and any busy-machine warning."""
    runs = result["runs"]
    counts = render_table(
        ["mode", "steps", "out tok/step", "peak running", "mean running", "slot occupancy", "peak KV blocks",
         "mean KV blocks", "joined running batch", "preempted"],
        [[r["mode"], r["num_steps"], r["output_tokens_per_step"], r["peak_running"], r["mean_running"],
          f"{r['slot_occupancy']:.0%}", r["peak_kv_blocks"], r["mean_kv_blocks"], r["joined_running_batch"],
          r["num_preemptions"]] for r in runs],
    )

    def lat(r: dict[str, Any], key: str) -> float | None:
        return (r["latency"] or {}).get(key)

    def lat_spread(r: dict[str, Any], key: str) -> str:
        return _spread([run[key] for run in r["latency_runs"]]) if r["latency_runs"] else "-"

    n = result["repeats"]
    clock = render_table(
        ["mode", "out tok/s", "min-max", "req/s", "median TTFT ms", "min-max", "median TPOT ms", "min-max",
         "median E2EL ms"],
        [[r["mode"], r["output_throughput"], _spread(r["output_throughput_runs"]), r["request_throughput"],
          lat(r, "median_ttft_ms"), lat_spread(r, "median_ttft_ms"), lat(r, "median_tpot_ms"),
          lat_spread(r, "median_tpot_ms"), lat(r, "median_e2el_ms")] for r in runs],
    )
    cap = result.get("max_tokens_cap")
    lines = [
        f"{result['num_requests']} requests, max_num_seqs {result['engine']['max_num_seqs']}"
        + (f", max_tokens {cap} with an emulated end at each drawn length" if cap else ""),
        "counts (machine-independent)", counts, "",
        f"wall clock: median of {n} run{'s' if n > 1 else ''}" + (", min-max over the runs" if n > 1 else ""), clock,
    ]
    if "continuous_over_static" in result:
        ratios = result["continuous_over_static_runs"]
        spread = f" (runs: {', '.join(f'{x:.2f}' for x in ratios)})" if len(ratios) > 1 else ""
        lines.append(f"continuous / static: {result['continuous_over_static_per_step']:.2f}x output tokens per step; "
                     f"{result['continuous_over_static']:.2f}x output tokens/s{spread}")
    lines += _spec_lines(result)
    if result.get("busy_warning"):
        lines.append(result["busy_warning"])
    return "\n".join(lines)


def _spec_lines(result: dict[str, Any]) -> list[str]:
    """Speculative decoding's counts per mode that verified drafts, and its speed-up over no-spec."""
    runs = [r for r in result["runs"] if r.get("num_drafts")]
    lines = []
    if runs:
        lines += ["speculative decoding", render_table(
            ["mode", "drafts", "draft tokens", "accepted", "acceptance rate", "mean accepted length"],
            [[r["mode"], r["num_drafts"], r["num_draft_tokens"], r["num_accepted_tokens"],
              f"{r['acceptance_rate']:.1%}", f"{r['mean_accepted_length']:.2f}"] for r in runs])]
    if "spec_over_no_spec" in result:  # also where nothing was drafted: what the proposer costs alone
        ratios = result["spec_over_no_spec_runs"]
        spread = f" (runs: {', '.join(f'{x:.2f}' for x in ratios)})" if len(ratios) > 1 else ""
        lines.append(f"speculative / no-spec: {result['spec_over_no_spec']:.2f}x output tokens/s{spread}")
    return [""] + lines if lines else []


def serve_table(result: dict[str, Any]) -> str:
    p = percentile_key(result["percentiles"][-1])
    goodput = result["goodput"] is not None
    headers = ["rate", "concurrency", "done", "failed", "req/s", "out tok/s", "total tok/s",
               *(["goodput req/s"] if goodput else []), "median TTFT", f"p{p} TTFT", "median TPOT", f"p{p} TPOT",
               "median ITL", "median E2EL"]
    rows = [
        [str(r["request_rate"]), r["max_concurrency"], r["completed"], r["failed"], r["request_throughput"],
         r["output_throughput"], r["total_token_throughput"], *([r["request_goodput"]] if goodput else []),
         r["median_ttft_ms"], r[f"p{p}_ttft_ms"], r["median_tpot_ms"], r[f"p{p}_tpot_ms"], r["median_itl_ms"],
         r["median_e2el_ms"]]
        for r in result["runs"]
    ]
    return render_table(headers, rows) + "\n(latencies in ms)"


def serve_report(result: dict[str, Any], url: str) -> str:
    """``bench serve``'s heading (the server measured) and its table."""
    return f"{result['label']}: model {result['model_id']} at {url}\n{serve_table(result)}"


def decode_bandwidth_line(loaded: Any, context: int, decode_s: float, device: str) -> str:
    """Batch-1 decode as a memory stream: the bytes one step must read (every matmul weight and the
    sequence's KV cache) over its time, beside this machine's measured bandwidth."""
    from iterserve import planner
    from iterserve.bench.microbench import measure_bandwidth

    dtype = loaded.model.dtype.itemsize
    read = planner.matmul_parameters(loaded.config) * dtype + context * loaded.config.kv_bytes_per_token(dtype)
    measured = measure_bandwidth(device.split(":")[0] if device.startswith("cuda") else "cpu", budget_s=0.3)
    peak = max(measured["copy"], measured["read"])
    return (f"batch-1 decode reads {read / 1e6:,.3g} MB (weights + KV cache) per step in {decode_s * 1000:,.2f} ms: "
            f"{read / decode_s / 1e9:,.3g} GB/s achieved, {read / decode_s / peak:.0%} of the {peak / 1e9:,.1f} GB/s "
            "this machine's memory copy/read benchmark reached")


def batch_report(sweep: BatchSweep) -> str:
    """The ``bench batch`` table and its knee: where a larger batch stops being nearly free."""
    lines = [f"{sweep.model} ({sweep.dtype}, {sweep.device}), context {sweep.context}, median of {sweep.repeats}",
             render_table(
        ["batch", "decode step ms", "decode tok/s", "ms per token", "prefill ms", "prefill tok/s"],
        [[p.batch_size, p.decode_s * 1000, p.decode_tokens_per_s, p.ms_per_token,
          None if p.prefill_s is None else p.prefill_s * 1000, p.prefill_tokens_per_s] for p in sweep.points],
    )]
    knee = sweep.knee_batch_size
    if sweep.knee_refused:
        lines.append(f"knee: {sweep.knee_refused}")
        return "\n".join(lines)
    lines.append((f"knee: batch {knee}" if knee is not None else "knee: none within the sweep")
                 + f" (first batch whose decode step grew >= (B/B_prev)^{sweep.elasticity:g}; "
                 f"a doubling there adds < {sweep.max_gain_at_knee:.0%} tokens/s)")
    if knee is not None:
        lines.append(f"reading: below batch {knee} a step costs about the same whatever the batch, so a larger "
                     "batch is nearly free throughput; from it on, latency per token grows about as fast as throughput")
    return "\n".join(lines)


def ttft_report(name: str, points: Sequence[PromptPoint], output_len: int, repeats: int) -> str:
    """The ``bench ttft`` table: one request at a time, TTFT and TPOT against the prompt's length."""
    first, last = points[0], points[-1]
    return "\n".join([f"{name}: one request at a time, {output_len} output tokens, median of {repeats}", render_table(
        ["prompt tokens", "steps per request", "tokens in first step", "TTFT ms", "min-max", "TPOT ms", "min-max"],
        [[p.prompt_len, p.steps_per_request, p.first_step_tokens, p.ttft_ms, _spread(p.ttft_ms_runs), p.tpot_ms,
          _spread(p.tpot_ms_runs)] for p in points],
    ), f"prompt {first.prompt_len} -> {last.prompt_len} tokens: TTFT x{last.ttft_ms / first.ttft_ms:.1f}, "
       f"TPOT x{last.tpot_ms / first.tpot_ms:.1f}"])


def first_step_line(point: PromptPoint) -> str:
    """One request's passes: its whole prompt in the first, then a token a pass."""
    return (f"steps of one {point.prompt_len}-token request: {point.step_tokens[0]} tokens in its first pass "
            f"({point.step_ms[0]:.1f} ms), then 1 token a pass (median {statistics.median(point.step_ms[1:]):.1f} ms)")


def perplexity_report(model: str, scored: int, window: int, headers: Sequence[str],
                      rows: Sequence[Sequence[Any]]) -> str:
    """The ``bench perplexity`` table: each weight format and KV cache dtype's perplexity of one text."""
    return f"{model}: {scored} tokens scored in windows of {window}\n{render_table(headers, rows)}"


def load_report(result: dict[str, Any]) -> str:
    """The ``bench load`` tables: what every point shares (counts), then each policy at each load."""
    e = result["engine"]
    rows = [[p["mode"], f"{p['load']:g}", p["request_rate"], p["num_steps"], p["mean_running"], p["output_throughput"],
             p["request_throughput"], p["p50_ttft_ms"], p["p99_ttft_ms"], p["median_tpot_ms"]]
            for p in result["points"]]
    lines = [
        f"{result['num_requests']} requests ({result['total_output_tokens']} output tokens) at every point, "
        f"max_num_seqs {e['max_num_seqs']}, dynamic batches wait up to {e['max_batch_wait']:g} s to fill",
        f"capacity: continuous batching, all {result['num_requests']} at once: {result['capacity_steps']} steps, "
        f"{result['capacity_request_rate']:.3g} req/s, {result['capacity_output_throughput']:.4g} output tokens/s "
        f"(median of {result['repeats']})",
        render_table(["mode", "load", "offered req/s", "steps", "mean running", "out tok/s", "req/s", "p50 TTFT ms",
                      "p99 TTFT ms", "median TPOT ms"], rows),
        "(load: offered requests/s over the capacity; arrivals Poisson, the same at every load for every mode)",
    ]
    if result.get("busy_warning"):
        lines.append(result["busy_warning"])
    return "\n".join(lines)


def timeline_counts(traces: dict[str, str], max_num_seqs: int | None) -> str:
    """The counts of each step trace: the same on any machine where the trace's steps were counted, not timed."""
    from iterserve.bench.step_counts import trace_counts
    from iterserve.bench.timeline import read_trace

    rows = []
    for label, path in traces.items():
        _, requests = read_trace(path)
        n_out = sum(r["num_output_tokens"] for r in requests)
        c = trace_counts(path, max_num_seqs or 1, n_out)
        queued = sorted(r["first_scheduled_time"] - r["arrival_time"] for r in requests
                        if r["first_scheduled_time"] is not None)
        rows.append([label, len(requests), n_out, c.num_steps, c.output_tokens_per_step, c.peak_running,
                     c.mean_running, f"{c.slot_occupancy:.0%}" if max_num_seqs else "-", c.joined_running_batch,
                     1000 * queued[len(queued) // 2] if queued else None])
    return render_table(["trace", "requests", "out tokens", "steps", "out tok/step", "peak running", "mean running",
                         "slot occupancy", "joined running batch", "median queue ms"], rows)

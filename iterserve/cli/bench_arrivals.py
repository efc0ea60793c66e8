"""``iterserve bench load`` (the batching policies against offered load) and ``iterserve bench timeline``
(step traces side by side, with their counts): how a policy treats requests that arrive over time."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import Any

from iterserve.bench.tables import render_table
from iterserve.cli.flags import add_config_args, config_from_args
from iterserve.cli.results import add_allow_busy_arg
from iterserve.cli.workload import add_workload_args, float_list, workload_spec_from_args
from iterserve.config import EngineConfig

# what bench throughput uses, for the same reason: the workload spans several batches
LOAD_MAX_NUM_SEQS = 16


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


def _cmd_load(args: argparse.Namespace) -> int:
    from iterserve.bench.charts import offered_load_chart
    from iterserve.bench.machine import machine_stamp, may_draw_timing_figure
    from iterserve.bench.offered_load import sweep_offered_load
    from iterserve.bench.progress import load_model_with_status
    from iterserve.bench.workloads import make_workload
    from iterserve.cli.results import write_json

    spec = workload_spec_from_args(args)
    config = config_from_args(EngineConfig, args)
    modes = [m for m in args.modes.split(",") if m]
    loads = float_list(args.loads, "--loads")
    loaded = load_model_with_status(config.model, config.dtype, config.device, config.seed)
    requests = make_workload(spec, tokenizer=loaded.tokenizer, vocab_size=loaded.config.vocab_size)
    result = sweep_offered_load(loaded, config, requests, modes, loads, repeats=args.repeats,
                                burstiness=args.burstiness, seed=spec.seed, use_tqdm=not args.disable_tqdm)
    result["workload"] = asdict(spec)
    print(load_report(result))
    if args.chart and may_draw_timing_figure(result["machine"], "the offered-load chart", args.allow_busy):
        offered_load_chart(result, args.chart, stamp=machine_stamp(result["machine"]))
        print(f"chart written to {args.chart}")
    if args.output_json:
        write_json(args.output_json, result)
    return 0


def timeline_counts(traces: dict[str, str], max_num_seqs: int | None) -> str:
    """The counts of each step trace: the same on any machine where the trace's steps were counted, not timed."""
    from iterserve.bench.throughput import trace_counts
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


def _cmd_timeline(args: argparse.Namespace) -> int:
    from iterserve.bench.timeline import timeline_chart

    labels = args.labels.split(",") if args.labels else [Path(t).stem for t in args.traces]
    if len(labels) != len(args.traces):
        raise ValueError(f"--labels names {len(labels)} traces but {len(args.traces)} were given")
    if len(set(labels)) != len(labels):
        raise ValueError(f"--labels must be distinct, got {args.labels!r}")
    traces = dict(zip(labels, args.traces))
    print(timeline_counts(traces, args.max_num_seqs))
    timeline_chart(traces, args.output, x=args.x, max_num_seqs=args.max_num_seqs)
    print(f"timeline written to {args.output}")
    return 0


def add_arrivals_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``bench load`` and ``bench timeline``."""
    ld = sub.add_parser("load", help="offline: the batching policies at growing offered load (throughput, TTFT)",
                        description="Measure the engine's capacity (the workload all at once, continuous batching), "
                                    "then offer each batching policy the same Poisson arrivals at fractions of it.")
    add_config_args(ld.add_argument_group("engine"), EngineConfig)
    ld.set_defaults(max_num_seqs=LOAD_MAX_NUM_SEQS)
    add_workload_args(ld)
    ld.add_argument("--modes", default="static,dynamic,continuous",
                    help="comma-separated: static, dynamic, continuous, reserved (default %(default)s)")
    ld.add_argument("--loads", default="0.25,0.5,0.75,1,1.25",
                    help="offered loads, as fractions of the measured capacity (default %(default)s)")
    ld.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals; 1 is Poisson")
    ld.add_argument("--repeats", type=int, default=1, help="runs of every point; the median is kept (default 1)")
    ld.add_argument("--chart", default=None, help="PNG of throughput and TTFT p50/p99 against offered load")
    ld.add_argument("--output-json", default=None, help="write the result as JSON to this file")
    ld.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    add_allow_busy_arg(ld)
    ld.set_defaults(func=_cmd_load)

    tl = sub.add_parser("timeline", help="draw step traces side by side and print their counts",
                        description="Every request's queue, prefill and decode spans from engine (or simulator) "
                                    "step traces, one panel each, and each step's batch under them.")
    tl.add_argument("traces", nargs="+", help="step trace JSONL files (--step-trace of the engine or simulate run)")
    tl.add_argument("--labels", default=None, help="comma-separated panel names, one per trace (default: file names)")
    tl.add_argument("--x", choices=["steps", "time"], default="steps", help="x-axis (default %(default)s)")
    tl.add_argument("--max-num-seqs", type=int, default=None, help="the batch limit to draw and count slots against")
    tl.add_argument("--output", "-o", required=True, help="PNG to write")
    tl.set_defaults(func=_cmd_timeline)

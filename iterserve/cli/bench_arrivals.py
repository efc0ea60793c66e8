"""``iterserve bench load`` (the batching policies against offered load) and ``iterserve bench timeline``
(step traces side by side, with their counts): how a policy treats requests that arrive over time."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from iterserve.bench.report import load_report, timeline_counts
from iterserve.cli.flags import add_allow_busy_arg, add_config_args, config_from_args
from iterserve.cli.workload import add_workload_args, float_list, workload_spec_from_args
from iterserve.config import EngineConfig

# what bench throughput uses, for the same reason: the workload spans several batches
LOAD_MAX_NUM_SEQS = 16


def _cmd_load(args: argparse.Namespace) -> int:
    from iterserve.bench.charts import offered_load_chart
    from iterserve.bench.machine import machine_stamp, may_draw_timing_figure
    from iterserve.bench.offered_load import sweep_offered_load
    from iterserve.bench.progress import load_model_with_status
    from iterserve.bench.workloads import make_workload
    from iterserve.cli.flags import write_json

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

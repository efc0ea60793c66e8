"""``iterserve bench``: throughput (offline), serve (online), batch (sweep), ttft (prompt sweep), perplexity
(weight formats) and plot; load and timeline live in :mod:`iterserve.cli.bench_arrivals`."""

from __future__ import annotations

import argparse
import math
import tempfile
from dataclasses import asdict
from pathlib import Path

from iterserve.bench.metrics import DEFAULT_PERCENTILES, parse_goodput, parse_percentiles, percentile_key
from iterserve.bench.report import (
    batch_report,
    decode_bandwidth_line,
    first_step_line,
    perplexity_report,
    serve_report,
    throughput_report,
    ttft_report,
)
from iterserve.cli.flags import add_allow_busy_arg, add_config_args, config_from_args, sibling_path, write_json
from iterserve.cli.workload import add_workload_args, float_list, load_points, workload_spec_from_args
from iterserve.config import DEFAULT_MODEL, EngineConfig

# bench throughput's batch cap: the default 64 requests then span several static batches, which is
# where static and continuous batching differ (with every request in one batch they would not)
BENCH_MAX_NUM_SEQS = 16


# -- throughput -----------------------------------------------------------------------------------


def _cmd_throughput(args: argparse.Namespace) -> int:
    from iterserve.bench.machine import machine_stamp, may_draw_timing_figure
    from iterserve.bench.progress import load_model_with_status
    from iterserve.bench.throughput import ENGINE_MODES, HF_MODE, run_throughput
    from iterserve.bench.timeline import continuous_joins_chart, modes_timeline_chart
    from iterserve.bench.workloads import make_workload

    if args.step_trace:
        raise ValueError("bench throughput writes one step trace per mode: use --trace-dir instead of --step-trace")
    spec = workload_spec_from_args(args)
    modes = [m for m in args.modes.split(",") if m] + ([HF_MODE] if args.hf_baseline else [])
    percentiles = parse_percentiles(args.percentiles)
    config = config_from_args(EngineConfig, args)
    loaded = load_model_with_status(config.model, config.dtype, config.device, config.seed,
                                    quantization=config.quantization)
    requests = make_workload(spec, tokenizer=loaded.tokenizer, vocab_size=loaded.config.vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        trace_dir = args.trace_dir or (tmp if args.timeline or args.joins else None)
        result = run_throughput(loaded, config, requests, modes, temperature=args.temperature, trace_dir=trace_dir,
                                max_tokens_cap=args.max_tokens_cap, repeats=args.repeats, percentiles=percentiles,
                                use_tqdm=not args.disable_tqdm)
        result["workload"] = asdict(spec)
        traces = {r["mode"]: r["step_trace"] for r in result["runs"] if r["mode"] in ENGINE_MODES}
        if args.timeline:
            modes_timeline_chart(traces, args.timeline, x=args.timeline_x, max_num_seqs=config.max_num_seqs,
                                 stamp=machine_stamp(result["machine"]) if args.timeline_x == "time" else None)
            print(f"timeline written to {args.timeline}")
        if args.joins:
            continuous_joins_chart(traces, args.joins, max_num_seqs=config.max_num_seqs)
            print(f"joins chart written to {args.joins}")
        if not args.trace_dir:
            for run in result["runs"]:
                run["step_trace"] = None
    print(throughput_report(result))
    if args.chart and may_draw_timing_figure(result["machine"], "the throughput-latency chart", args.allow_busy):
        from iterserve.bench.charts import throughput_summary_chart

        throughput_summary_chart(result, args.chart, stamp=machine_stamp(result["machine"]))
        print(f"chart written to {args.chart}")
    if args.output_json:
        write_json(args.output_json, result)
    return 0


# -- serve ----------------------------------------------------------------------------------------


def _cmd_serve(args: argparse.Namespace) -> int:
    from iterserve.bench.charts import serve_charts
    from iterserve.bench.serve import ServeConfig, run_serve
    from iterserve.bench.workloads import make_workload
    from iterserve.models.loader import load_tokenizer

    spec = workload_spec_from_args(args)
    percentiles = parse_percentiles(args.percentiles)
    goodput = parse_goodput(args.goodput) if args.goodput else None
    points = load_points(args)
    tokenizer = None if args.tokenizer.lower() == "none" else load_tokenizer(args.tokenizer)
    requests = make_workload(spec, tokenizer=tokenizer)
    cfg = ServeConfig(
        base_url=args.base_url, endpoint=args.endpoint, model=args.model, prompt_format=args.prompt_format,
        temperature=args.temperature, ignore_eos=not args.no_ignore_eos, connect_timeout=args.connect_timeout,
        read_timeout=args.timeout, api_key=args.api_key, lora_modules=tuple(args.lora_modules or ()),
    )
    result = run_serve(cfg, requests, tokenizer, points, burstiness=args.burstiness, workload=spec,
                       tokenizer_id=None if tokenizer is None else args.tokenizer, label=args.label,
                       percentiles=percentiles, goodput=goodput, use_tqdm=not args.disable_tqdm)
    print(serve_report(result, f"{cfg.base_url}{cfg.endpoint}"))
    if args.output_json:
        write_json(args.output_json, result)
        for chart in serve_charts([result], sibling_path(args.output_json, "")):
            print(f"chart written to {chart}")
    return 0


# -- batch ----------------------------------------------------------------------------------------


def _cmd_batch(args: argparse.Namespace) -> int:
    from iterserve.bench.batch import default_batch_sizes, sweep_batches
    from iterserve.bench.charts import batch_sweep_chart
    from iterserve.bench.machine import MachineMonitor, machine_stamp, may_draw_timing_figure
    from iterserve.bench.progress import load_model_with_status

    loaded = load_model_with_status(args.model, args.dtype, args.device, quantization=args.quantization)
    if args.batch_sizes:
        values = float_list(args.batch_sizes, "--batch-sizes")
        if not all(v == int(v) for v in values):
            raise ValueError(f"--batch-sizes takes whole numbers, got {args.batch_sizes!r}")
        batches = [int(v) for v in values]
    else:
        batches = default_batch_sizes(loaded, args.context, args.kv_cache_memory, args.max_batch, args.block_size)
    monitor = MachineMonitor()
    monitor.sample()
    sweep = sweep_batches(loaded, batches, args.context, repeats=args.repeats, block_size=args.block_size,
                          prefill=not args.no_prefill, elasticity=args.elasticity,
                          use_tqdm=not args.disable_tqdm)
    monitor.sample()
    warning = monitor.check.warning()
    print(batch_report(sweep))
    one = next((p for p in sweep.points if p.batch_size == 1), None)
    if one is not None:
        print(decode_bandwidth_line(loaded, sweep.context, one.decode_s, args.device or "cpu"))
    if warning:
        print(warning)
    chart = args.chart or (str(sibling_path(args.output_json, ".png")) if args.output_json else None)
    if chart and may_draw_timing_figure(monitor.check.to_dict(), "the batch sweep (its knee)", args.allow_busy):
        batch_sweep_chart(sweep, chart, stamp=machine_stamp(monitor.check.to_dict()))
        print(f"chart written to {chart}")
    if args.output_json:
        result = {"benchmark": "batch", **asdict(sweep), "max_gain_at_knee": sweep.max_gain_at_knee,
                  "machine": monitor.check.to_dict(), "busy_warning": warning}
        write_json(args.output_json, result)
    return 0


def _cmd_ttft(args: argparse.Namespace) -> int:
    from iterserve.bench.charts import prompt_sweep_chart, request_steps_chart
    from iterserve.bench.machine import MachineMonitor, machine_stamp
    from iterserve.bench.progress import load_model_with_status
    from iterserve.bench.prompt_sweep import sweep_prompt_lengths

    values = float_list(args.prompt_lens, "--prompt-lens")
    if not all(v == int(v) for v in values):
        raise ValueError(f"--prompt-lens takes whole numbers, got {args.prompt_lens!r}")
    config = config_from_args(EngineConfig, args)
    loaded = load_model_with_status(config.model, config.dtype, config.device, config.seed,
                                    quantization=config.quantization)
    monitor = MachineMonitor()
    monitor.sample()
    points = sweep_prompt_lengths(loaded, config, [int(v) for v in values], args.output_len, args.repeats)
    monitor.sample()
    warning = monitor.check.warning()
    print(ttft_report(loaded.name, points, args.output_len, args.repeats))
    if warning:
        print(warning)
    if args.chart:
        prompt_sweep_chart(points, args.chart, stamp=machine_stamp(monitor.check.to_dict()))
        print(f"chart written to {args.chart}")
    if args.steps_chart:
        request_steps_chart(points[-1], args.steps_chart, stamp=machine_stamp(monitor.check.to_dict()))
        print(first_step_line(points[-1]))
        print(f"chart written to {args.steps_chart}")
    if args.output_json:
        write_json(args.output_json, {"benchmark": "ttft", "model": loaded.name, "output_len": args.output_len,
                                       "repeats": args.repeats, "machine": monitor.check.to_dict(),
                                       "busy_warning": warning, "points": [asdict(p) for p in points]})
    return 0


# -- plot -----------------------------------------------------------------------------------------


def _cmd_plot(args: argparse.Namespace) -> int:
    from iterserve.bench.charts import load_serve_results, serve_charts

    results = [load_serve_results(p) for p in args.results]
    if args.labels:
        labels = args.labels.split(",")
        if len(labels) != len(results):
            raise ValueError(f"--labels names {len(labels)} results but {len(results)} files were given")
        for r, label in zip(results, labels):
            r["label"] = label
    for chart in serve_charts(results, Path(args.output_prefix)):
        print(f"chart written to {chart}")
    return 0


# -- parser ---------------------------------------------------------------------------------------


def _add_percentiles_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--percentiles", default=",".join(percentile_key(q) for q in DEFAULT_PERCENTILES),
                   help="latency percentiles to report, comma-separated (default %(default)s)")


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``iterserve bench`` and its subcommands."""
    bench = subparsers.add_parser("bench", help="benchmark the engine or any OpenAI-compatible server")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    _add_throughput_parser(sub)
    _add_serve_parser(sub)
    _add_batch_parser(sub)
    _add_ttft_parser(sub)
    _add_perplexity_parser(sub)
    _add_plot_parser(sub)
    from iterserve.cli.bench_arrivals import add_arrivals_parsers

    add_arrivals_parsers(sub)


def _add_throughput_parser(sub: argparse._SubParsersAction) -> None:
    tp = sub.add_parser("throughput", help="offline: one workload through continuous and static batching in-process")
    add_config_args(tp.add_argument_group("engine"), EngineConfig)
    tp.set_defaults(max_num_seqs=BENCH_MAX_NUM_SEQS)
    add_workload_args(tp)
    tp.add_argument("--modes", default="continuous,static",
                    help="comma-separated: continuous, static, dynamic, reserved, no-spec (continuous without "
                         "the --speculative-config; with it, the speed-up is reported) (default %(default)s); every "
                         "request is queued at once, so dynamic batches are full at once and run as static ones")
    tp.add_argument("--hf-baseline", action="store_true",
                    help="also run transformers' generate on padded batches of --max-num-seqs ")
    tp.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request")
    _add_percentiles_arg(tp)
    tp.add_argument("--output-json", default=None, help="write the result as JSON to this file")
    tp.add_argument("--trace-dir", default=None, help="keep each mode's step trace as <dir>/<mode>.jsonl")
    tp.add_argument("--timeline", default=None,
                    help="PNG of every sequence's spans, one panel per engine mode, slot occupancy under each")
    tp.add_argument("--timeline-x", choices=["steps", "time"], default="steps",
                    help="timeline x-axis: engine steps (default; the same on any machine) or wall time")
    tp.add_argument("--joins", default=None,
                    help="PNG of the continuous run's steps: sequences already decoding and requests joining")
    tp.add_argument("--chart", default=None, help="PNG of tokens per step, tokens/s and latency per mode")
    tp.add_argument("--repeats", type=int, default=1,
                    help="runs of every mode; wall-clock figures report the median and min-max (default 1)")
    tp.add_argument("--max-tokens-cap", type=int, default=None,
                    help="every request asks for this many tokens and ends at its drawn output length (an "
                         "emulated end-of-sequence), so reserved allocation holds blocks for the cap")
    tp.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    add_allow_busy_arg(tp)
    tp.set_defaults(func=_cmd_throughput)


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    sv = sub.add_parser("serve", help="online: load an OpenAI-compatible server and measure TTFT, TPOT, ITL")
    sv.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    sv.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    sv.add_argument("--model", default=None, help="model name to request (default: the first of GET /v1/models)")
    sv.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    sv.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME",
                    help="LoRA adapters the server serves; each request names one, drawn at random (as vLLM)")
    sv.add_argument("--tokenizer", default=DEFAULT_MODEL,
                    help="model whose tokenizer builds prompts and counts tokens: an embedded name, .gguf or "
                         "folder; 'none' for none (default %(default)s)")
    sv.add_argument("--prompt-format", choices=["text", "ids"], default="text",
                    help="send token-id prompts as decoded text (portable) or as ids (vLLM) (default %(default)s)")
    add_workload_args(sv)
    sv.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    sv.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals; 1 is Poisson")
    sv.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    sv.add_argument("--sweep-rates", default=None, help="run once per request rate, e.g. 1,2,4")
    sv.add_argument("--sweep-concurrency", default=None, help="run once per concurrency cap, e.g. 1,4,16")
    sv.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request")
    sv.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS (default: ignore it)")
    _add_percentiles_arg(sv)
    sv.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                    help="SLOs for goodput, e.g. ttft:500 tpot:50 (metrics ttft, tpot, e2el)")
    sv.add_argument("--label", default=None, help="name of this server in tables and charts")
    sv.add_argument("--output-json", default=None, help="result JSON; charts are written beside it")
    sv.add_argument("--connect-timeout", type=float, default=3.0, help="seconds to wait for a connection")
    sv.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for each streamed chunk")
    sv.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    sv.set_defaults(func=_cmd_serve)


def _add_batch_parser(sub: argparse._SubParsersAction) -> None:
    bt = sub.add_parser("batch", help="decode and prefill step latency against batch size, and the knee")
    d = EngineConfig()
    add_config_args(bt.add_argument_group("engine"), EngineConfig, include=("model", "dtype", "device", "quantization",
                                                                                 "block_size"))
    bt.add_argument("--context", type=int, default=256, help="tokens each sequence holds (default %(default)s)")
    bt.add_argument("--batch-sizes", default=None, help="comma-separated (default: 1, 2, 4, ... up to what fits)")
    bound = "bounds the default sweep (default %(default)s)"
    bt.add_argument("--kv-cache-memory", default=d.kv_cache_memory, help=bound)
    bt.add_argument("--max-batch", type=int, default=d.max_num_seqs, help=bound)
    bt.add_argument("--repeats", type=int, default=5, help="timed runs per point; the median is kept")
    bt.add_argument("--elasticity", type=float, default=0.5,
                    help="knee: first batch whose step time grows >= (B/B_prev)^elasticity (default %(default)s)")
    bt.add_argument("--no-prefill", action="store_true", help="time decode steps only")
    bt.add_argument("--output-json", default=None, help="write the result as JSON to this file")
    bt.add_argument("--chart", default=None, help="PNG path (default: beside --output-json)")
    bt.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    add_allow_busy_arg(bt)
    bt.set_defaults(func=_cmd_batch)


def _add_ttft_parser(sub: argparse._SubParsersAction) -> None:
    tt = sub.add_parser("ttft", help="TTFT and TPOT of lone requests against prompt length (prefill vs decode)")
    add_config_args(tt.add_argument_group("engine"), EngineConfig)
    tt.add_argument("--prompt-lens", default="32,128,256,512", help="comma-separated (default %(default)s)")
    tt.add_argument("--output-len", type=int, default=16, help="tokens each request generates (default %(default)s)")
    tt.add_argument("--repeats", type=int, default=3, help="timed requests per prompt length (default %(default)s)")
    tt.add_argument("--chart", default=None, help="PNG of TTFT and TPOT against prompt length")
    tt.add_argument("--steps-chart", default=None,
                    help="PNG of the longest prompt's request step by step: tokens per pass and step time")
    tt.add_argument("--output-json", default=None, help="write the result as JSON to this file")
    tt.set_defaults(func=_cmd_ttft)


def _add_perplexity_parser(sub: argparse._SubParsersAction) -> None:
    pp = sub.add_parser("perplexity", help="perplexity of a fixed text under each weight format and KV cache dtype")
    add_config_args(pp.add_argument_group("engine"), EngineConfig, include=("model", "dtype", "device", "seed"))
    pp.add_argument("--formats", default="none,gguf,int8",
                    help="comma-separated quantizations; none: float weights in --dtype (default %(default)s)")
    pp.add_argument("--kv-cache-dtypes", default="auto",
                    help="comma-separated KV cache dtypes (auto, fp8, fp8_e5m2, int8), each scored with each format")
    pp.add_argument("--text", default=None, help="a UTF-8 text file (default: the shipped opening of Coriolanus)")
    pp.add_argument("--window", type=int, default=512, help="tokens scored together (default %(default)s)")
    pp.set_defaults(func=_cmd_perplexity)


def _cmd_perplexity(args: argparse.Namespace) -> int:
    from iterserve.bench.perplexity import SHIPPED_TEXT, compare

    text = Path(args.text or SHIPPED_TEXT).read_text(encoding="utf-8")
    scored, headers, rows = compare(args.model, args.dtype, args.device, args.seed, args.formats.split(","),
                                    args.kv_cache_dtypes.split(","), text, args.window)
    print(perplexity_report(args.model, scored, args.window, headers, rows))
    return 0


def _add_plot_parser(sub: argparse._SubParsersAction) -> None:
    pl = sub.add_parser("plot", help="overlay bench serve (or vllm bench serve) results in charts")
    pl.add_argument("results", nargs="+", help="result JSON files")
    pl.add_argument("--labels", default=None, help="comma-separated names, one per file")
    pl.add_argument("--output-prefix", default="bench", help="charts go to <prefix>_latency.png and _throughput.png")
    pl.set_defaults(func=_cmd_plot)

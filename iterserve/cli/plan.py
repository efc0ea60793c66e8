"""``iterserve plan``: the capacity planner on the command line.

The main CLI wires it in with :func:`add_plan_parser`; ``python -m iterserve.cli.plan``
runs it on its own. Bad input prints one line to stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

from iterserve import planner
from iterserve.cli.results import add_allow_busy_arg
from iterserve.cli.tables import render_table
from iterserve.config import ModelConfig
from iterserve.config.dtypes import canonical_dtype
from iterserve.config.units import parse_bandwidth, parse_flops, parse_size
from iterserve.planner.hardware import ACCELERATORS, INTERCONNECTS, Accelerator, GiB, get_accelerator, get_interconnect
from iterserve.planner.speculative import crossover_batch, mean_accepted_length, speculative_sweep

if TYPE_CHECKING:
    from iterserve.bench.validate import Validation

PROG = "iterserve plan"

def _parse_batches(text: str | None) -> list[int] | None:
    if text is None:
        return None
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if not re.fullmatch(r"-?[0-9]+", part):
            raise ValueError(f"batch sizes must be integers separated by commas, got {text!r}")
        out.append(int(part))
    if not out:
        raise ValueError("--batches needs at least one batch size")
    for b in out:
        if b < 1:
            raise ValueError(f"batch size must be a positive integer, got {b}")
    return out


# -- argument parser ----------------------------------------------------------------------------


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        help="preset name (e.g. llama-3-8b, meta-llama/Llama-2-7b-hf), a config.json, a model "
        "folder, or a .gguf file",
    )
    hw = p.add_argument_group("hardware")
    hw.add_argument("--gpu", help=f"one or more GPUs, comma-separated: {', '.join(ACCELERATORS)}")
    hw.add_argument("--list-gpus", action="store_true", help="print the accelerator table and exit")
    hw.add_argument("--flops", help="peak FLOP/s for --dtype, in TFLOP/s (or with a unit: 800GFLOPS)")
    hw.add_argument("--bandwidth", help="memory bandwidth in GB/s (or with a unit: 3.35TB/s)")
    hw.add_argument("--memory", help="device memory in GiB (or with a unit: 80GiB, 85.9GB)")
    hw.add_argument("--measure", action="store_true", help="measure this machine (CPU or CUDA)")
    hw.add_argument("--measure-repeats", type=int, default=3,
                    help="measure this many times; the medians are used, and no figure is printed when the runs "
                         "disagree by more than 20%% (default %(default)s)")
    add_allow_busy_arg(hw)
    hw.add_argument("--device", choices=["cpu", "cuda"], help="device for --measure/--validate")
    hw.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                    help="split the model over this many GPUs (tensor parallelism); figures are per GPU")
    hw.add_argument("--interconnect", help=f"the GPUs' link for --tp: {', '.join(INTERCONNECTS)} "
                    "(default: the GPU's own)")
    wl = p.add_argument_group("workload")
    wl.add_argument("--dtype", help="weight/compute dtype: fp32, tf32, bf16, fp16, fp8, int8, or auto (what the engine "
                    "runs in: bf16 on a GPU or a CPU with bf16 instructions, else fp32) (default bf16; with "
                    "--validate fp32 on CPU)")
    wl.add_argument("--kv-cache-dtype", "--kv-dtype", dest="kv_dtype", help="KV-cache dtype: bf16, fp16, fp32, "
                    "fp8 (fp8_e4m3, fp8_e5m2) or int8 (+ a float16 scale per token and KV head) (default: --dtype)")
    wl.add_argument("--quantization", type=str.lower, choices=planner.QUANTIZATION_CHOICES, default="none",
                    help="the matmul weights' format: gguf (a GGUF model's own mix of tensor types; approximated "
                         "for other models), q4_0, q4_1, q8_0, int8, int4, fp8, or none (all in --dtype) "
                         "(default %(default)s)"),
    wl.add_argument("--context", type=int, help="tokens per sequence for KV capacity and decode "
                    "(default min(4096, model max); 256 with --validate)")
    wl.add_argument("--prompt-len", type=int, help="prompt tokens for prefill/TTFT (default --context)")
    wl.add_argument("--batch", type=int, default=1, help="batch for the TTFT/TPOT headline (default 1)")
    wl.add_argument("--batches", help="decode sweep, comma-separated (default 1,2,4,...,256)")
    wl.add_argument("--gpu-memory-utilization", type=float,
                    default=planner.DEFAULT_GPU_MEMORY_UTILIZATION,
                    help="fraction of device memory for weights + KV cache (default 0.9)")
    wl.add_argument("--block-size", type=int, default=planner.DEFAULT_BLOCK_SIZE,
                    help="KV-cache block size in tokens (default 16)")
    wl.add_argument("--num-speculative-tokens", type=int, default=0,
                    help="speculative decoding: drafts verified per sequence and step; adds a table of decode "
                         "tokens/s with and without it and the batch where it stops paying (default 0: none)")
    wl.add_argument("--spec-acceptance", type=float, default=0.7,
                    help="chance a draft is accepted given the ones before it were (default %(default)s)")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print JSON instead of tables")
    out.add_argument("--chart", metavar="PNG", help="write a chart of tokens/s and latency vs batch")
    out.add_argument("--roofline-chart", metavar="PNG",
                     help="write the roofline (first hardware) with every decode batch and the prefill on it")
    out.add_argument("--capacity-chart", metavar="PNG", help="write the sequences that fit against context length")
    val = p.add_argument_group("validation")
    val.add_argument("--validate", action="store_true",
                     help="time decode steps on this machine and compare with the prediction")
    val.add_argument("--repeats", type=int, default=3, help="timed repeats per batch (default 3)")


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand to an argparse subparsers object; it dispatches to run_plan."""
    p = subparsers.add_parser(
        "plan",
        help="capacity planner: memory, KV capacity, roofline latency and throughput",
        description="Roofline capacity planner: weights and KV-cache memory, arithmetic "
        "intensity, the decode knee, and predicted TTFT/TPOT/tokens/s per GPU.",
    )
    _add_arguments(p)
    p.set_defaults(func=run_plan)
    return p


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Roofline capacity planner for iterserve.")
    _add_arguments(p)
    return p


# -- formatting ---------------------------------------------------------------------------------


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


def _knee_text(p: planner.Plan) -> str:
    if p.knee_batch is None:
        return f"none (intensity < {p.decode_intensity_limit:.1f})"
    text = str(p.knee_batch)
    if not p.knee_reachable:
        text += " (> max seqs)"
    return text


def _tp_rows(first: planner.Plan) -> list[tuple[str, Any]]:
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


def print_plans(plans: list[planner.Plan], out: TextIO) -> None:
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


def print_speculation(plans: list[planner.Plan], shard: ModelConfig, k: int, acceptance: float, out: TextIO,
                      quantization: planner.Quantization | None = None) -> None:
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


def print_validation(v: Validation, out: TextIO) -> None:
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


# -- running ------------------------------------------------------------------------------------


def _hardware_from_args(args: argparse.Namespace, dtype: str) -> tuple[list[Accelerator], dict[str, Any] | None]:
    """The accelerators to plan for, and with --measure the readings of this machine while it was measured
    (its charts say, or refuse, what they were drawn on)."""
    flops = parse_flops(args.flops) if args.flops else None
    bandwidth = parse_bandwidth(args.bandwidth) if args.bandwidth else None
    memory = parse_size(args.memory) if args.memory else None
    hws: list[Accelerator] = []
    machine = None
    if args.gpu:
        names = [n.strip() for n in args.gpu.split(",") if n.strip()]
        if not names:
            raise ValueError("--gpu needs at least one GPU name")
        hws += [get_accelerator(n) for n in names]
    if args.measure:
        from iterserve.bench.machine import MachineMonitor
        from iterserve.bench.microbench import measure_local_repeated

        monitor = MachineMonitor()
        monitor.sample()
        hws.append(measure_local_repeated(args.device, dtype, repeats=args.measure_repeats))
        monitor.sample()
        machine = monitor.check.to_dict()
    if hws:
        return [hw.with_overrides(dtype=dtype, flops=flops, bandwidth=bandwidth, memory_bytes=memory)
                for hw in hws], machine
    missing = [f"--{k}" for k, v in (("flops", args.flops), ("bandwidth", args.bandwidth),
                                     ("memory", args.memory)) if not v]
    if len(missing) == 3:
        raise ValueError("say which hardware: --gpu NAME, --measure, or --flops/--bandwidth/--memory")
    if missing:
        raise ValueError(f"explicit hardware needs --flops, --bandwidth and --memory; missing {', '.join(missing)}")
    return [planner.custom_accelerator(dtype=dtype, flops=flops, bandwidth=bandwidth, memory_bytes=memory)], None


def _list_gpus(out: TextIO, as_json: bool) -> None:
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


def _run_validate(args: argparse.Namespace, out: TextIO) -> int:
    if args.gpu or args.flops or args.bandwidth or args.memory:
        raise ValueError("--validate measures this machine; drop --gpu/--flops/--bandwidth/--memory")
    if args.quantization != "none":
        raise ValueError("--validate times the model's float weights; drop --quantization")
    import torch

    from iterserve.bench import validate
    from iterserve.bench.progress import status

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = canonical_dtype(args.dtype or ("bf16" if device == "cuda" else "fp32"))
    cfg = planner.load_model_config(args.model)
    context = args.context if args.context is not None else min(
        validate.DEFAULT_VALIDATION_CONTEXT, cfg.max_position_embeddings)
    batches = _parse_batches(args.batches) or list(validate.DEFAULT_VALIDATION_BATCHES)
    planner.check_context(cfg, context)  # bad input first, before anything is measured or built
    planner.check_positive(args.repeats, "repeats")

    with status(f"loading {args.model} ...") as say:
        timer = validate.default_decode_timer(args.model, dtype, device=device)

        def timed(batch: int, context_len: int) -> float:
            say(f"timing decode steps at context {context_len}: batch {batch} (sweep up to {max(batches)}) ...")
            return timer(batch, context_len)

        say("measuring this machine's memory bandwidth and FLOP/s ...")
        v = validate.validate(cfg, timed, device=device, dtype=dtype, kv_dtype=args.kv_dtype, context=context,
                              batches=batches, repeats=args.repeats)
    if args.chart:
        from iterserve.bench.machine import machine_stamp
        from iterserve.cli.plan_charts import chart_validation

        chart_validation(v, args.chart, stamp=machine_stamp())
    if args.json:
        print(json.dumps({"validation": v.to_dict()}, indent=2, default=str), file=out)
    else:
        print_validation(v, out)
        if args.chart:
            print(f"chart written to {args.chart}", file=out)
    return 0


def run_plan(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run the planner for parsed arguments; returns the exit status (2 on bad input)."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        return _run(args, out, err)
    except BrokenPipeError:  # output piped into a reader that stopped early (head)
        return 1
    except (ValueError, OSError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"{PROG}: error: {msg}", file=err)
        return 2


def _run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    if args.list_gpus:
        _list_gpus(out, args.json)
        return 0
    if not args.model:
        raise ValueError("name a model: a preset (e.g. llama-3-8b), a config.json, a folder or a .gguf file")
    if args.validate:
        return _run_validate(args, out)
    dtype = _plan_dtype(args.dtype, args.measure and args.device != "cuda")
    kv_dtype = canonical_dtype(args.kv_dtype) if args.kv_dtype else None
    cfg = planner.load_model_config(args.model)
    quantization = planner.quantization_for(args.model, args.quantization)
    hws, machine = _hardware_from_args(args, dtype)
    batches = _parse_batches(args.batches)
    options: dict[str, Any] = dict(dtype=dtype, kv_dtype=kv_dtype, context=args.context, prompt_len=args.prompt_len,
                                   batch=args.batch, gpu_memory_utilization=args.gpu_memory_utilization,
                                   block_size=args.block_size, tensor_parallel_size=args.tp,
                                   interconnect=get_interconnect(args.interconnect) if args.interconnect else None,
                                   quantization=quantization)
    shard = cfg.tensor_parallel_shard(args.tp)  # what one GPU holds
    if batches is None and len(hws) > 1:  # one sweep for every GPU, so the table lines up
        context = args.context if args.context is not None else min(
            planner.DEFAULT_CONTEXT, cfg.max_position_embeddings)
        sweeps = []
        for hw in hws:
            try:  # a GPU the model does not fit on is skipped below, with the reason, and adds no rows
                planner.kv_capacity(shard, hw, context, dtype, kv_dtype, args.gpu_memory_utilization, args.block_size,
                                    quantization)
                sweeps.append(planner.default_batches(shard, hw, context, dtype, kv_dtype, quantization))
            except ValueError:
                continue
        batches = sorted({b for sweep in sweeps for b in sweep}) or None
    plans, skipped = [], []
    for hw in hws:
        try:
            plans.append(planner.plan(cfg, hw, batches=batches, **options))
        except ValueError as e:
            if len(hws) == 1:
                raise
            skipped.append(f"{hw.name}: {e}")
    if not plans:
        raise ValueError(f"no GPU can run this: {'; '.join(skipped)}")
    written = _charts(args, plans, cfg, hws, dtype, kv_dtype, quantization, machine)
    if args.json:
        print(json.dumps({"plans": [p.to_dict() for p in plans], "skipped": skipped}, indent=2), file=out)
    else:
        print_plans(plans, out)
        if args.num_speculative_tokens:
            print_speculation(plans, shard, args.num_speculative_tokens, args.spec_acceptance, out, quantization)
        for line in skipped:
            print(f"skipped {line}", file=err)
        for chart in written:
            print(f"chart written to {chart}", file=out)
    return 0


def _plan_dtype(name: str | None, on_this_cpu: bool) -> str:
    """The planner's dtype; ``auto`` as the engine resolves it (bf16 unless this CPU would emulate it)."""
    if str(name).lower() != "auto":
        return canonical_dtype(name or "bf16")
    if on_this_cpu:
        from iterserve.config.dtypes import parse_dtype

        return canonical_dtype(parse_dtype("auto"))
    return "bf16"


def _charts(args: argparse.Namespace, plans: list[planner.Plan], cfg: Any, hws: list[Accelerator], dtype: str,
            kv_dtype: str | None, quantization: planner.Quantization, machine: dict[str, Any] | None) -> list[str]:
    """Draw the asked-for charts; returns the paths written. A measured machine's timing charts carry its
    stamp, and are refused when the machine was busy while it was measured."""
    from iterserve.cli import plan_charts

    stamp, timed = None, True
    if machine is not None:
        from iterserve.bench.machine import machine_stamp, may_draw_timing_figure

        stamp = machine_stamp(machine)
        timed = may_draw_timing_figure(machine, "this machine's roofline and plan (its ops:byte)",
                                       args.allow_busy)
    if args.chart and timed:
        plan_charts.chart_plans(plans, args.chart, stamp=stamp)
    if args.roofline_chart and timed:
        plan_charts.chart_roofline(plans[-1] if args.measure else plans[0], args.roofline_chart, stamp=stamp)
    if args.capacity_chart:
        plan_charts.chart_capacity(cfg.tensor_parallel_shard(args.tp), hws, dtype, kv_dtype, args.capacity_chart,
                                   args.gpu_memory_utilization, quantization)
    return [c for c in (args.chart if timed else None, args.roofline_chart if timed else None, args.capacity_chart)
            if c]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse has printed its message
        return int(e.code or 0)
    return run_plan(args)


if __name__ == "__main__":
    sys.exit(main())

"""``iterserve plan``: the capacity planner on the command line.

The main CLI wires it in with :func:`add_plan_parser`; ``python -m iterserve.cli.plan``
runs it on its own. Bad input prints one line to stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from iterserve import planner
from iterserve.cli.flags import add_allow_busy_arg
from iterserve.config.dtypes import canonical_dtype
from iterserve.config.units import parse_bandwidth, parse_flops, parse_size
from iterserve.planner.hardware import ACCELERATORS, INTERCONNECTS, Accelerator, get_accelerator, get_interconnect
from iterserve.planner.report import print_accelerators, print_plan_report, print_validation

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
        from iterserve.planner.charts import chart_validation

        chart_validation(v, args.chart, stamp=machine_stamp())
    print_validation(v, out, as_json=args.json, chart=args.chart)
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
        print_accelerators(out, as_json=args.json)
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
    from iterserve.planner.charts import PlanCharts, draw_plan_charts

    written = draw_plan_charts(plans, shard, hws, dtype, kv_dtype, quantization, args.gpu_memory_utilization,
                               PlanCharts(args.chart, args.roofline_chart, args.capacity_chart), machine,
                               args.allow_busy)
    speculation = (shard, args.num_speculative_tokens, args.spec_acceptance, quantization) \
        if args.num_speculative_tokens else None
    print_plan_report(plans, skipped, written, out, err, as_json=args.json, speculation=speculation)
    return 0


def _plan_dtype(name: str | None, on_this_cpu: bool) -> str:
    """The planner's dtype; ``auto`` as the engine resolves it (bf16 unless this CPU would emulate it)."""
    if str(name).lower() != "auto":
        return canonical_dtype(name or "bf16")
    if on_this_cpu:
        from iterserve.config.dtypes import parse_dtype

        return canonical_dtype(parse_dtype("auto"))
    return "bf16"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse has printed its message
        return int(e.code or 0)
    return run_plan(args)


if __name__ == "__main__":
    sys.exit(main())

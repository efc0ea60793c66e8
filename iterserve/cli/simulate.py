"""``iterserve simulate``: ``run`` a workload through the real engine core on a modelled accelerator,
``calibrate`` a step-time profile from steps timed on this machine."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
from pathlib import Path
from typing import Any

from iterserve.cli.flags import add_config_args
from iterserve.config import EngineConfig
from iterserve.config.kv_cache import canonical_kv_cache_dtype
from iterserve.config.speculative import DEFAULT_DISABLE_BY_BATCH_SIZE
from iterserve.planner.weights import QUANTIZATION_CHOICES
from iterserve.simulate.cost import ConstantCost, CostModel, LinearCost, RooflineCost
from iterserve.simulate.planning import PlannerTerms

DEFAULT_SIM_MODEL = "smollm2-135m"


def _add_run_parser(sub: Any) -> None:
    from iterserve.cli.workload import add_workload_args

    p = sub.add_parser("run", help="simulate bench serve: real engine core, modelled step times",
                       description="Drive the engine core (its scheduler, KV block manager and prefix cache) on a "
                                   "virtual clock; step times come from a cost model. Output matches bench serve's.")
    m = p.add_argument_group("model and cost model (one of --step-time, --gpu/--flops, --profile)")
    m.add_argument("--model", default=DEFAULT_SIM_MODEL, help="preset name, config.json, model folder or .gguf")
    m.add_argument("--dtype", default="bf16", help="weight and KV dtype (bf16, fp16, fp32, ...; default %(default)s)")
    m.add_argument("--quantization", type=str.lower, default="none",
                   choices=QUANTIZATION_CHOICES,
                   help="the weights' format for the roofline, as iterserve plan --quantization (default %(default)s)")
    m.add_argument("--step-time", type=float, default=None, help="constant seconds per step")
    m.add_argument("--gpu", default=None, help="roofline on this accelerator (see iterserve plan --list-gpus)")
    m.add_argument("--flops", default=None, help="peak FLOP/s for --dtype, in TFLOP/s or with a unit")
    m.add_argument("--bandwidth", default=None, help="memory bandwidth in GB/s or with a unit")
    m.add_argument("--memory", default=None, help="device memory in GiB or with a unit")
    m.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of device memory for weights + KV pool, sizing the pool under --gpu")
    m.add_argument("--step-overhead", type=float, default=0.0, help="seconds added to every roofline step")
    m.add_argument("--profile", default=None, help="calibrated step profile JSON (iterserve simulate calibrate)")
    e = p.add_argument_group("simulated engine")
    add_config_args(e, EngineConfig, include=("block_size", "max_num_seqs", "max_num_batched_tokens", "batching",
                                              "max_batch_wait", "kv_allocation", "enable_prefix_caching",
                                              "kv_cache_dtype"))
    e.add_argument("--kv-cache-memory", default=None,
                   help="KV pool size, e.g. 2GiB (default: what fits beside the weights under --gpu, else 2GiB)")
    e.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (overrides memory)")
    e.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output (default: the model's)")
    e.add_argument("--request-latency", type=float, default=None,
                   help="seconds a request and its tokens spend outside the steps, there and back (HTTP, API "
                        "process, IPC; default: the --profile's measured value, else 0)")
    e.add_argument("--admission-interval", type=float, default=None,
                   help="least seconds between two requests reaching the scheduler (the API process admits one "
                        "at a time; default: the --profile's measured value, else 0)")
    _add_speculation_args(p)
    add_workload_args(p)
    p.add_argument("--tokenizer", default=None, help="tokenizer for text, JSONL-text and ShareGPT datasets")
    ld = p.add_argument_group("load (as bench serve)")
    ld.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    ld.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals; 1 is Poisson")
    ld.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    ld.add_argument("--sweep-rates", default=None, help="run once per request rate, e.g. 1,2,4")
    ld.add_argument("--sweep-concurrency", default=None, help="run once per concurrency cap, e.g. 1,4,16")
    o = p.add_argument_group("output")
    o.add_argument("--percentiles", default="90,99", help="latency percentiles to report, comma-separated")
    o.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 (metrics ttft, tpot, e2el)")
    o.add_argument("--label", default=None, help="name of this run in the results and charts")
    o.add_argument("--output-json", default=None, help="result JSON (bench serve's shape); charts beside it")
    o.add_argument("--no-charts", action="store_true", help="write the JSON without its charts")
    o.add_argument("--step-trace", default=None, help="JSON-lines step trace of the simulated steps")
    p.set_defaults(func=_cmd_run)


def _batch_limit(text: str) -> int | None:
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of running sequences or 'none', got {text!r}") from None


def _add_speculation_args(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("speculative decoding (drafts proposed as n-gram lookup would, accepted at random)")
    s.add_argument("--num-speculative-tokens", type=int, default=0,
                   help="drafts per decoding sequence and step (default 0: no speculation)")
    s.add_argument("--spec-acceptance", type=float, default=None,
                   help="probability that each draft position is accepted, given the ones before it were")
    s.add_argument("--spec-disable-by-batch-size", type=_batch_limit, default=DEFAULT_DISABLE_BY_BATCH_SIZE,
                   help="no drafts in a step whose running batch is larger (the engine's disable_by_batch_size; "
                        "default %(default)s, 'none': no limit)")


def _add_calibrate_parser(sub: Any) -> None:
    p = sub.add_parser("calibrate", help="fit a step-time profile to steps timed on this machine",
                       description="Least-squares fit of step time ~ a + b*prefill_tokens + c*decode_seqs + "
                                   "d*total_context to engine step traces and/or bench batch results.")
    p.add_argument("--trace", action="append", default=[], help="engine step trace JSONL (repeatable)")
    p.add_argument("--batch-json", action="append", default=[], help="bench batch --output-json file (repeatable)")
    p.add_argument("--serve-json", action="append", default=[],
                   help="bench serve --output-json of the run the --trace of the same position recorded (repeatable, "
                        "one per --trace): measures the request round trip and admission interval around the steps")
    p.add_argument("--per-batch-size", action="store_true",
                   help="fit the decode cost per batch size instead of per sequence (for a machine whose step time "
                        "is not linear in its batch, as small-batch matmuls on a CPU)")
    p.add_argument("--output", "-o", required=True, help="profile JSON to write")
    p.set_defaults(func=_cmd_calibrate)


def add_simulate_parser(subparsers: Any) -> None:
    """Register ``iterserve simulate run`` and ``iterserve simulate calibrate``."""
    p = subparsers.add_parser("simulate", help="simulate serving: real engine core, modelled accelerator",
                              description=__doc__)
    sub = p.add_subparsers(dest="simulate_command", required=True)
    _add_run_parser(sub)
    _add_calibrate_parser(sub)


def _cost_model(args: argparse.Namespace, terms: PlannerTerms) -> CostModel:
    roofline = terms.peak_flops is not None
    chosen = [name for name, on in (("--step-time", args.step_time is not None), ("--gpu/--flops", roofline),
                                    ("--profile", args.profile is not None)) if on]
    if len(chosen) != 1:
        raise ValueError(f"give exactly one cost model: --step-time, --gpu (or --flops and --bandwidth) or --profile"
                         f"{'; got ' + ' and '.join(chosen) if chosen else ''}")
    if args.step_time is not None:
        return ConstantCost(args.step_time)
    if args.profile is not None:
        return LinearCost.load(args.profile)
    return RooflineCost(terms, args.step_overhead)


def _planner_kv_dtype(kv_cache_dtype: str) -> str | None:
    """The planner's name of the engine's KV cache dtype (None: the model's dtype)."""
    return None if kv_cache_dtype == "auto" else canonical_kv_cache_dtype(kv_cache_dtype)


def sim_config_from_args(args: argparse.Namespace, terms: PlannerTerms, cost: CostModel) -> Any:
    from iterserve.config.units import parse_size
    from iterserve.simulate.runner import SimConfig

    if args.num_kv_blocks is not None:
        blocks = args.num_kv_blocks
    else:
        if args.kv_cache_memory is not None:
            pool = parse_size(args.kv_cache_memory)
        elif terms.kv_pool_bytes is not None:
            if terms.kv_pool_bytes <= 0:
                raise ValueError(f"{terms.model_name} weights do not fit on {terms.accelerator}")
            pool = terms.kv_pool_bytes
        else:
            pool = parse_size("2GiB")
        blocks = pool // (args.block_size * terms.kv_bytes_per_token)
    if blocks < 1:
        raise ValueError("the KV pool does not hold a single block")
    max_len = args.max_model_len or min(terms.max_position_embeddings, blocks * args.block_size)
    measured = cost if isinstance(cost, LinearCost) else None
    latency, interval = args.request_latency, args.admission_interval
    if latency is None:
        latency = measured.request_latency_s if measured else 0.0
    if interval is None:
        interval = measured.admission_interval_s if measured else 0.0
    return SimConfig(num_kv_blocks=blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                     max_num_batched_tokens=args.max_num_batched_tokens, batching=args.batching,
                     max_batch_wait=args.max_batch_wait, kv_allocation=args.kv_allocation,
                     enable_prefix_caching=args.enable_prefix_caching, max_model_len=max_len,
                     kv_cache_dtype=args.kv_cache_dtype,
                     request_latency_s=latency, admission_interval_s=interval,
                     num_speculative_tokens=args.num_speculative_tokens, spec_acceptance=args.spec_acceptance,
                     spec_disable_by_batch_size=args.spec_disable_by_batch_size)


def _cmd_run(args: argparse.Namespace) -> int:
    from iterserve.bench.charts import serve_charts
    from iterserve.bench.metrics import parse_goodput, parse_percentiles
    from iterserve.bench.report import serve_table
    from iterserve.bench.workloads import make_workload
    from iterserve.cli.flags import sibling_path, write_json
    from iterserve.cli.workload import load_points, workload_spec_from_args
    from iterserve.models.loader import load_model_config, load_tokenizer
    from iterserve.simulate.planning import planner_terms
    from iterserve.simulate.runner import run_simulation

    # each load point runs a fresh engine core, whose KV pool line would repeat; the summary below says it once
    logging.getLogger("iterserve.engine.core").setLevel(logging.WARNING)
    spec = workload_spec_from_args(args)
    percentiles = parse_percentiles(args.percentiles)
    goodput = parse_goodput(args.goodput) if args.goodput else None
    points = load_points(args)
    model = load_model_config(args.model)  # read once for the planner and the engine: a GGUF's takes seconds
    model = model if model.name else model.replace(name=args.model)
    from iterserve.planner import quantization_for

    terms = planner_terms(model, args.dtype, gpu=args.gpu, flops=args.flops, bandwidth=args.bandwidth,
                          memory=args.memory, gpu_memory_utilization=args.gpu_memory_utilization,
                          quantization=quantization_for(args.model, args.quantization),
                          kv_dtype=_planner_kv_dtype(args.kv_cache_dtype))
    cost = _cost_model(args, terms)
    cfg = sim_config_from_args(args, terms, cost)
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    requests = make_workload(spec, tokenizer=tokenizer, vocab_size=terms.vocab_size)
    if args.step_trace:
        Path(args.step_trace).parent.mkdir(parents=True, exist_ok=True)
    with open(args.step_trace, "w") if args.step_trace else contextlib.nullcontext() as trace:
        result = run_simulation(requests, points, cost, cfg, burstiness=args.burstiness, workload=spec,
                                model_id=terms.model_name, label=args.label, percentiles=percentiles,
                                goodput=goodput, trace=trace, model=model, dtype=args.dtype)
    c = cost.describe()
    print(f"{result['label']}: {terms.model_name}, cost model {c['kind']}, KV pool {cfg.num_kv_blocks} blocks x "
          f"{cfg.block_size} tokens, {cfg.batching} batching, {cfg.kv_allocation} KV")
    print(serve_table(result))
    if cfg.num_speculative_tokens:
        print(_speculation_summary(cfg, result))
    if args.output_json:
        write_json(args.output_json, result)
        for chart in [] if args.no_charts else serve_charts([result], sibling_path(args.output_json, "")):
            print(f"chart written to {chart}")
    return 0


def _speculation_summary(cfg: Any, result: dict[str, Any]) -> str:
    """One line per load point: the spec-decode counters and what they make per verification pass."""
    from iterserve.engine.spec_decode.stats import acceptance_rate

    limit = cfg.spec_disable_by_batch_size
    lines = [f"speculative decoding: {cfg.num_speculative_tokens} drafts, each accepted with probability "
             f"{cfg.spec_acceptance}, {'at any batch size' if limit is None else f'none above {limit} running'}"]
    for run in result["runs"]:
        s = run["simulated"]
        rate, length = acceptance_rate(s["num_accepted_tokens"], s["num_draft_tokens"]), s["mean_accepted_length"]
        lines.append(f"  {s['num_drafts']} drafts, {s['num_draft_tokens']} draft tokens, {s['num_accepted_tokens']} "
                     f"accepted: acceptance rate {'-' if rate is None else f'{rate:.1%}'}, mean accepted length "
                     f"{'-' if length is None else f'{length:.2f}'} over {s['num_steps']} steps")
    return "\n".join(lines)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from iterserve.simulate.cost import fit_linear, fit_request_timing, steps_from_batch, steps_from_trace

    if not args.trace and not args.batch_json:
        raise ValueError("calibrate needs at least one --trace or --batch-json")
    steps = [s for t in args.trace for s in steps_from_trace(t)]
    steps += [s for b in args.batch_json for s in steps_from_batch(b)]
    sources = [Path(x).name for x in [*args.trace, *args.batch_json]]
    profile = fit_linear(steps, source=", ".join(sources), per_batch_size=args.per_batch_size)
    if args.serve_json:
        if len(args.serve_json) != len(args.trace):
            raise ValueError(f"give one --serve-json per --trace, in the same order (got {len(args.serve_json)} and "
                             f"{len(args.trace)}): each is the client's side of the run that trace recorded")
        timing = fit_request_timing(zip(args.trace, args.serve_json))
        profile = dataclasses.replace(profile, request_latency_s=timing.request_latency_s,
                                      admission_interval_s=timing.admission_interval_s)
        print(f"{timing.num_requests} requests in both: round trip {timing.request_latency_s * 1e3:.1f} ms (client TTFT"
              f" - engine TTFT, median), admission interval {timing.admission_interval_s * 1e3:.2f} ms"
              f" ({timing.num_bursts} bursts)")
    profile.save(args.output)
    table = profile.decode_batch_s
    decode = (f"decode(B) ms by batch B=1.. [{', '.join(f'{t * 1e3:.1f}' for t in table[1:])}]" if table
              else f"{profile.per_decode_seq_s * 1e6:.3f} us/decode sequence")
    print(f"fitted {profile.num_steps} steps: step time = {profile.intercept_s * 1e3:.3f} ms"
          f" + {profile.per_prefill_token_s * 1e6:.3f} us/prefill token + {decode}"
          f" + {profile.per_context_token_s * 1e9:.3f} ns/context token;"
          f" mean |error| {profile.mean_abs_rel_error:.1%} on those steps")
    print(f"profile written to {args.output}")
    return 0

"""The workload and load flags that ``bench serve`` and ``simulate run`` share."""

from __future__ import annotations

import argparse

from iterserve.bench.serve import LoadPoint
from iterserve.bench.workloads import DATASETS, LengthDist, WorkloadSpec


def float_list(text: str, what: str) -> list[float]:
    """Positive numbers separated by commas (``--sweep-rates 1,2,4``)."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be numbers separated by commas, got {text!r}") from None
    if not values or not all(v > 0 for v in values):
        raise ValueError(f"{what} must be positive, got {text!r}")
    return values


def add_workload_args(p: argparse.ArgumentParser) -> None:
    d = WorkloadSpec()
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", choices=DATASETS, default=d.dataset,
                   help="random: random token ids; text: sentences of a built-in corpus; copy: chat requests to "
                        "repeat a corpus passage of --input-len tokens (output: the passage's length); jsonl or "
                        "sharegpt: a file named by --dataset-path")
    g.add_argument("--dataset-path", default=None, help="JSONL of {prompt|messages[, output_len]}, or ShareGPT JSON")
    g.add_argument("--num-prompts", type=int, default=d.num_prompts, help="requests in the workload")
    g.add_argument("--input-len", default=d.input_len,
                   help="prompt length distribution: N (vLLM's form of fixed:N), fixed:N, uniform:LOW:HIGH, "
                        "normal:MEAN:STD:MAX, lognormal:MEDIAN:SIGMA:MAX or pareto:MIN:ALPHA:MAX (default %(default)s)")
    g.add_argument("--output-len", default=d.output_len, help="output length distribution (default %(default)s)")
    g.add_argument("--shared-prefix-len", type=int, default=d.shared_prefix_len,
                   help="tokens of one shared system prompt in front of every synthetic prompt")
    g.add_argument("--dataset-output-len", type=int, default=d.dataset_output_len,
                   help="output length of JSONL records that give none")
    g.add_argument("--workload-seed", type=int, default=d.seed, help="seed of the drawn prompts and lengths")


def workload_spec_from_args(args: argparse.Namespace) -> WorkloadSpec:
    spec = WorkloadSpec(
        dataset=args.dataset, num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        shared_prefix_len=args.shared_prefix_len, dataset_path=args.dataset_path,
        dataset_output_len=args.dataset_output_len, seed=args.workload_seed,
    )
    if spec.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {spec.num_prompts}")
    for dist in (spec.input_len, spec.output_len):
        LengthDist.parse(dist)  # a bad spec fails before the model or tokenizer loads
    return spec


def load_points(args: argparse.Namespace) -> list[LoadPoint]:
    if args.sweep_rates and args.sweep_concurrency:
        raise ValueError("use --sweep-rates or --sweep-concurrency, not both")
    if args.sweep_rates:
        return [LoadPoint(r, args.max_concurrency) for r in float_list(args.sweep_rates, "--sweep-rates")]
    if args.sweep_concurrency:
        values = float_list(args.sweep_concurrency, "--sweep-concurrency")
        if not all(v == int(v) for v in values):
            raise ValueError(f"--sweep-concurrency takes whole numbers, got {args.sweep_concurrency!r}")
        return [LoadPoint(args.request_rate, int(c)) for c in values]
    return [LoadPoint(args.request_rate, args.max_concurrency)]

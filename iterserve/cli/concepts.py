"""The commands behind docs/concepts.md, in one place: ``scripts/make_concept_figures.sh`` runs them
all to regenerate the figures, and the tests run the small configuration.

``--small`` runs the same workloads on a tiny random model with one repeat: the step counts
(tokens per step, steps, sequences that fit) equal the real model's, because every request ignores
EOS and runs to its drawn length; the timings do not.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

SMALL_MODEL = ("random:llama-3-8b?num_layers=1&vocab_size=1024&hidden_size=64&intermediate_size=128&num_heads=4"
               "&num_kv_heads=2&head_dim=16")


@dataclass(frozen=True)
class Size:
    model: tuple[str, ...]
    repeats: int
    prompt_lens: str
    batch_sizes: str
    ttft_output: int
    loads: str
    timing_flags: tuple[str, ...]  # the small run's timings mean nothing, so a busy machine need not refuse them
    batch_repeats: int  # the knee is read off small differences between neighbouring batch sizes
    load_extra: tuple[str, ...]  # more requests per offered-load point: a p99 TTFT of 32 requests is their maximum


FULL = Size(("--model", "smollm2-135m", "--dtype", "auto"), 2, "32,128,512", "1,2,4,8,16,32,64", 8,
            "0.25,0.5,0.75,1,1.5", (), 5, ("--num-prompts", "96"))
SMALL = Size(("--model", SMALL_MODEL, "--dtype", "float32"), 1, "16,64,256", "1,2,4", 4, "0.5,1.5",
             ("--allow-busy",), 1, ())

# sections 1, 2 and 4 share one workload: more requests than slots, heavy-tailed outputs
WORKLOAD = ("--num-prompts", "32", "--max-num-seqs", "8", "--input-len", "uniform:8:32",
            "--output-len", "pareto:1:0.8:24")
POLICIES = ("static", "dynamic", "continuous")


def _static_vs_continuous(out: Path, s: Size) -> list[list[str]]:
    """Items 1, 2: every request queued at once."""
    return [["bench", "throughput", *s.model, *WORKLOAD, "--modes", "static,continuous", "--repeats", str(s.repeats),
             "--disable-tqdm", "--timeline", str(out / "static_vs_continuous.png"), "--joins", str(out / "joins.png"),
             "--chart", str(out / "throughput_latency.png"),
             "--output-json", str(out / "static_vs_continuous.json"), *s.timing_flags]]


def _arrivals(out: Path, s: Size) -> list[list[str]]:
    """Item 2: the three policies on the same arrivals, simulated at a constant step time, so every count
    and every span is the same on any machine; then the three traces side by side."""
    sim = ["simulate", "run", "--step-time", "0.05", *WORKLOAD, "--num-kv-blocks", "256", "--request-rate", "8",
           "--max-batch-wait", "0.3"]
    traces = [str(out / f"arrivals_{policy}.jsonl") for policy in POLICIES]
    return [*([*sim, "--batching", policy, "--step-trace", trace] for policy, trace in zip(POLICIES, traces)),
            ["bench", "timeline", *traces, "--labels", ",".join(POLICIES), "--x", "time", "--max-num-seqs", "8",
             "--output", str(out / "arrivals.png")]]


def _offered_load(out: Path, s: Size) -> list[list[str]]:
    """Item 4: throughput and TTFT against offered load, per policy, measured."""
    return [["bench", "load", *s.model, *WORKLOAD, *s.load_extra, "--modes", ",".join(POLICIES), "--loads", s.loads,
             "--max-batch-wait", "0.2", "--disable-tqdm", "--chart", str(out / "offered_load.png"),
             "--output-json", str(out / "offered_load.json"), *s.timing_flags]]


def _paged_vs_reserved(out: Path, s: Size) -> list[list[str]]:
    """Items 3, 10: one pool of 32 blocks, requests asking for 128 tokens and ending at their drawn length."""
    return [["bench", "throughput", *s.model, "--num-prompts", "16", "--max-num-seqs", "8", "--num-kv-blocks", "32",
             "--input-len", "uniform:8:32", "--output-len", "pareto:2:1:16", "--max-tokens-cap", "128",
             "--modes", "continuous,reserved", "--repeats", str(s.repeats), "--disable-tqdm",
             "--timeline", str(out / "paged_vs_reserved.png"), "--output-json", str(out / "paged_vs_reserved.json")]]


def _ttft(out: Path, s: Size) -> list[list[str]]:
    """Items 5, 6: lone requests at growing prompt lengths."""
    return [["bench", "ttft", *s.model, "--prompt-lens", s.prompt_lens, "--output-len", str(s.ttft_output),
             "--repeats", str(s.repeats), "--chart", str(out / "ttft_vs_prompt.png"),
             "--steps-chart", str(out / "request_steps.png"), "--output-json", str(out / "ttft_vs_prompt.json")]]


def _batch(out: Path, s: Size) -> list[list[str]]:
    """Items 7, 9: decode step time against batch size on this machine."""
    return [["bench", "batch", *s.model, "--batch-sizes", s.batch_sizes, "--context", "64",
             "--repeats", str(s.batch_repeats), "--no-prefill", "--disable-tqdm",
             "--chart", str(out / "batch_sweep.png"), "--output-json", str(out / "batch_sweep.json"), *s.timing_flags]]


def _plan(out: Path, s: Size) -> list[list[str]]:
    """Items 8, 9, 10: the roofline of a named GPU and model, and the sequences its KV cache holds."""
    return [["plan", "llama-3-8b", "--gpu", "H100-SXM", "--context", "4096",
             "--chart", str(out / "plan_llama3_8b_h100.png"), "--roofline-chart", str(out / "roofline_h100.png"),
             "--capacity-chart", str(out / "kv_capacity.png")]]


def _plan_here(out: Path, s: Size) -> list[list[str]]:
    """Items 8, 10: the same roofline for this machine, measured three times (no figure when the runs
    disagree by more than 20%), with the steps' arithmetic intensity drawn against its ridge."""
    return [["plan", "smollm2-135m", "--measure", "--dtype", "auto", "--context", "2048",
             "--chart", str(out / "plan_smollm2_here.png"), "--roofline-chart", str(out / "roofline_here.png"),
             *s.timing_flags]]


FIGURES: dict[str, Callable[[Path, Size], list[list[str]]]] = {
    "static_vs_continuous": _static_vs_continuous,
    "arrivals": _arrivals,
    "offered_load": _offered_load,
    "paged_vs_reserved": _paged_vs_reserved,
    "ttft": _ttft,
    "batch": _batch,
    "plan": _plan,
    "plan_here": _plan_here,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the figure commands in-process, each printed first as it would be typed."""
    from iterserve.cli.main import main as iterserve_main

    p = argparse.ArgumentParser(prog="make_concept_figures", description=__doc__)
    p.add_argument("outdir", nargs="?", default="docs/figures")
    p.add_argument("--small", action="store_true", help="a tiny random model and one repeat (for tests)")
    p.add_argument("--only", default=None, help=f"comma-separated subset of: {', '.join(FIGURES)}")
    args = p.parse_args(argv)
    names = args.only.split(",") if args.only else list(FIGURES)
    unknown = [n for n in names if n not in FIGURES]
    if unknown:
        p.error(f"unknown figure(s) {', '.join(unknown)}; use {', '.join(FIGURES)}")
    out = Path(args.outdir)
    out.mkdir(parents=True, exist_ok=True)
    size = SMALL if args.small else FULL
    for name in names:
        for cmd in FIGURES[name](out, size):
            print(f"\n$ iterserve {shlex.join(cmd)}", flush=True)
            rc = iterserve_main(["--log-level", "WARNING", *cmd])
            sys.stdout.flush()
            if rc:
                return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The floor of a workload on this machine: every matmul at the rate ``F.linear`` reaches on the model's weight
shapes, each decode step at least one read of the weights, and every decode's K/V read, at the streaming read
bandwidth; all measured here and now.

    .venv/bin/python scripts/workload_floor.py wl64.jsonl --dtype bfloat16 [--threads 2] [--engine-runs 5]
        [--rate-dtype float32]  # where torch emulates bf16 matmuls

The workload is ``scripts/workload_jsonl.py``'s file (prompt token ids and output lengths), all requests at once.
Each prompt passes once through each layer's matmuls, and the LM head gives its first output token. Every later
output token takes a decode step; the fewest steps a schedule can take run every request's t-th decode together
(step t has the rows of the requests with more than t output tokens), and each such step costs the larger of its
rows' matmuls and one read of the weights: the heavy tail's few rows are memory-bound. Each decode also reads the
K/V of its whole context. ``F.linear`` is timed on each distinct weight shape at 64 rows (the largest batch of the
64-request workload) on ``--threads`` torch threads: the median of ``--rounds`` rounds that take the shapes in
turn, since on a VM one shape's rate moved 3x between two runs a minute apart (the LM head's, 160-522 GFLOP/s in
bf16). An engine's time over the floor says how much of the machine it used.

``--engine-runs N`` also runs the workload N times through a fresh engine (greedy, ``ignore_eos``, up to 64
sequences, as ``iterserve bench throughput --modes continuous`` does) with a round of the floor's
measurements before the first run and after each: each run is divided into the floor measured beside it
(the median of its two neighbouring rounds), so that the VM's speed, which moved the floor 20% between two
commands a minute apart, moves both sides of a ratio alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from iterserve.bench.microbench import median_seconds, streaming_read_gbs
from iterserve.models.loader import load_model_config

Shape = tuple[int, int]  # a weight's [in, out]


@dataclass
class Floor:
    layers: int
    layer_shapes: list[Shape]  # each layer's weights
    head_shape: Shape
    prompt_tokens: int
    requests: int
    decode_rows: list[int]  # the rows of each decode step of the fewest steps
    kv_bytes: int  # the K/V its decodes read
    rows: int
    dtype: torch.dtype  # the weights' (their bytes per step)
    rate_dtype: torch.dtype  # the one F.linear is timed in

    def __post_init__(self) -> None:
        self.shapes = list(dict.fromkeys([*self.layer_shapes, self.head_shape]))
        t = self.rate_dtype
        self.operands = {(k, n): (torch.randn(self.rows, k).to(t), torch.randn(n, k).to(t)) for k, n in self.shapes}
        self.weight_bytes = sum(k * n for k, n in [*self.layer_shapes * self.layers, self.head_shape])
        self.weight_bytes *= self.dtype.itemsize

    def flops(self) -> int:
        token = 2 * self.layers * sum(k * n for k, n in self.layer_shapes)
        head = 2 * self.head_shape[0] * self.head_shape[1]
        return self.prompt_tokens * token + self.requests * head + sum(self.decode_rows) * (token + head)

    def rates(self, rounds: int) -> dict[Shape, float]:
        """FLOP/s of ``F.linear`` on each shape at ``rows`` rows: the median over ``rounds`` rounds."""
        seconds: dict[Shape, list[float]] = {s: [] for s in self.shapes}
        for _ in range(rounds):
            for s, (x, w) in self.operands.items():
                seconds[s].append(median_seconds(lambda: F.linear(x, w), 7))
        return {(k, n): 2 * self.rows * k * n / statistics.median(seconds[(k, n)]) for k, n in self.shapes}

    def seconds(self, rates: dict[Shape, float], gbs: float) -> tuple[float, float, float]:
        """(prefill matmul seconds, decode step seconds, K/V seconds) at these rates and this read bandwidth."""
        token_s = sum(2 * self.layers * k * n / rates[(k, n)] for k, n in self.layer_shapes)
        head_s = 2 * self.head_shape[0] * self.head_shape[1] / rates[self.head_shape]
        weights_s = self.weight_bytes / (gbs * 1e9)
        decode_s = sum(max(rows * (token_s + head_s), weights_s) for rows in self.decode_rows)
        return self.prompt_tokens * token_s + self.requests * head_s, decode_s, self.kv_bytes / (gbs * 1e9)


def engine_seconds(model: str, dtype: str, requests: list[dict]) -> float:
    """One run of the workload through a fresh engine: seconds from the first request queued to the last done."""
    from iterserve import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, max_num_seqs=64)
    params = [SamplingParams(temperature=0, max_tokens=r["output_len"], ignore_eos=True) for r in requests]
    prompts = [{"prompt_token_ids": r["prompt"]} for r in requests]
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rate-dtype", help="time F.linear in this dtype (default --dtype): float32 where torch "
                    "emulates bf16 matmuls (no avx512_bf16 or AMX), so that the floor takes torch's best rate")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5, help="rounds over the shapes; each shape's median is taken")
    ap.add_argument("--engine-runs", type=int, default=0, help="runs of the workload through the engine, "
                    "each divided into the floor measured beside it")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    cfg = load_model_config(args.model)
    requests = [json.loads(line) for line in open(args.workload)]
    prompt_tokens = sum(len(r["prompt"]) for r in requests)
    output_tokens = sum(r["output_len"] for r in requests)
    # Each output token's decode reads the K/V of the context before it.
    kv_tokens = sum(len(r["prompt"]) * r["output_len"] + r["output_len"] * (r["output_len"] - 1) // 2
                    for r in requests)
    h, q, kv, ff = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    decodes = [r["output_len"] - 1 for r in requests]  # the first output token comes from the prompt's pass
    floor = Floor(cfg.num_layers, [(h, q + 2 * kv), (q, h), (h, 2 * ff), (ff, h)], (h, cfg.vocab_size),
                  prompt_tokens, len(requests), [sum(d >= t for d in decodes) for t in range(1, max(decodes) + 1)],
                  kv_tokens * cfg.kv_bytes_per_token(dtype.itemsize), args.rows, dtype,
                  getattr(torch, args.rate_dtype or args.dtype))
    print(f"{len(requests)} requests: {prompt_tokens} prompt + {output_tokens} output tokens, {args.dtype} "
          f"(F.linear in {floor.rate_dtype}), {args.threads} threads")

    def measure() -> tuple[float, tuple[float, float, float], dict[Shape, float], float]:
        torch.set_num_threads(args.threads)  # an engine leaves torch one thread (kernels.run_on_pool)
        rates, gbs = floor.rates(args.rounds), streaming_read_gbs()
        parts = floor.seconds(rates, gbs)
        return sum(parts), parts, rates, gbs

    total, (prefill_s, decode_s, kv_s), rates, gbs = measure()
    for s in floor.shapes:
        print(f"  F.linear {s[0]}->{s[1]} at {args.rows} rows: {rates[s] / 1e9:.1f} GFLOP/s")
    print(f"matmuls: {floor.flops() / 1e12:.2f} TFLOP; prompts {prefill_s:.2f} s, then {len(floor.decode_rows)} "
          f"decode steps {decode_s:.2f} s (each at least a read of {floor.weight_bytes / 1e6:.0f} MB of weights "
          f"at {gbs:.1f} GB/s)")
    print(f"K/V: {floor.kv_bytes / 1e9:.1f} GB at {gbs:.1f} GB/s = {kv_s:.2f} s")
    print(f"floor: {total:.2f} s = {output_tokens / total:.1f} output tok/s")
    ratios = []
    for run in range(args.engine_runs):
        seconds = engine_seconds(args.model, args.dtype, requests)
        after = measure()
        beside = statistics.median([total, after[0]])
        ratios.append(beside / seconds)
        print(f"run {run + 1}: {seconds:.2f} s = {output_tokens / seconds:.1f} output tok/s; floor beside it "
              f"{beside:.2f} s ({total:.2f} before, {after[0]:.2f} after): {ratios[-1]:.2f} of the floor")
        total = after[0]
    if ratios:
        print(f"of the floor over {len(ratios)} runs: median {statistics.median(ratios):.2f} "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f})")


if __name__ == "__main__":
    main()

"""The floor of a workload on this machine: its matmul FLOPs at the rate ``F.linear`` reaches on the model's
weight shapes, plus every decode's K/V read at the streaming read bandwidth, both measured here and now.

    .venv/bin/python scripts/workload_floor.py wl64.jsonl --dtype bfloat16 [--threads 2]

The workload is ``scripts/workload_jsonl.py``'s file (prompt token ids and output lengths). Every prompt and
output token passes through each layer's matmuls; each output token also through the LM head, and its
decode reads the K/V of its whole context. ``F.linear`` is timed on each distinct weight shape at 64 rows
(the largest batch of the 64-request workload) on ``--threads`` torch threads, and weighted by the FLOPs
each shape does: the median of ``--rounds`` rounds that take the shapes in turn, since on a VM one shape's
rate moved 3x between two runs a minute apart (the LM head's, 160-522 GFLOP/s in bf16). An engine's time
over the floor says how much of the machine it used.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from iterserve.bench.microbench import median_seconds, streaming_read_gbs
from iterserve.models.loader import load_model_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5, help="rounds over the shapes; each shape's median is taken")
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
    kv_bytes = kv_tokens * cfg.kv_bytes_per_token(dtype.itemsize)

    h, q, kv, ff = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    layer_shapes = [(h, q + 2 * kv), (q, h), (h, 2 * ff), (ff, h)]  # [in, out]: qkv, o, gate/up, down
    head_shape = (h, cfg.vocab_size)
    tokens = prompt_tokens + output_tokens
    flops = {s: 2 * s[0] * s[1] * tokens * cfg.num_layers for s in layer_shapes}
    flops[head_shape] = flops.get(head_shape, 0) + 2 * h * cfg.vocab_size * output_tokens
    operands = {(k, n): (torch.randn(args.rows, k).to(dtype), torch.randn(n, k).to(dtype)) for k, n in flops}
    seconds: dict[tuple[int, int], list[float]] = {s: [] for s in flops}
    for _ in range(args.rounds):
        for s, (x, w) in operands.items():
            seconds[s].append(median_seconds(lambda: F.linear(x, w), 7))
    rates = {(k, n): 2 * args.rows * k * n / statistics.median(seconds[(k, n)]) for k, n in flops}
    total = sum(flops.values())
    matmul_s = sum(f / rates[s] for s, f in flops.items())
    gbs = streaming_read_gbs()
    kv_s = kv_bytes / (gbs * 1e9)
    floor = matmul_s + kv_s
    print(f"{len(requests)} requests: {prompt_tokens} prompt + {output_tokens} output tokens, {args.dtype}, "
          f"{args.threads} threads")
    for s in flops:
        print(f"  F.linear {s[0]}->{s[1]} at {args.rows} rows: {rates[s] / 1e9:.1f} GFLOP/s")
    print(f"matmuls: {total / 1e12:.2f} TFLOP at {total / matmul_s / 1e9:.1f} GFLOP/s (FLOP-weighted) "
          f"= {matmul_s:.2f} s")
    print(f"K/V: {kv_bytes / 1e9:.1f} GB at {gbs:.1f} GB/s = {kv_s:.2f} s")
    print(f"floor: {floor:.2f} s = {output_tokens / floor:.1f} output tok/s")


if __name__ == "__main__":
    main()

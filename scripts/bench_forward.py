"""Time single forward passes of the model layer: decode batches and prefill chunks.

For each dtype this prints ms per step, tokens/s, and the achieved memory bandwidth and FLOP/s
implied by the planner's cost model (weights streamed once per step plus the K/V read).

    .venv/bin/python scripts/bench_forward.py --dtypes float32,bfloat16 --context 512
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from iterserve.attention import AttentionMetadata
from iterserve.engine.model_runner import keep_freed_memory_in_process
from iterserve.models.loader import load_model
from iterserve.planner import decode_cost, prefill_cost

PLANNER_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up: first calls build kernels for the shape
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--context", type=int, default=512, help="tokens already cached per decoding sequence")
    ap.add_argument("--prefill", default="128,512", help="prefill chunk lengths")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory_in_process()
    batches = [int(b) for b in args.batches.split(",")]
    chunks = [int(c) for c in args.prefill.split(",")]
    block = 16
    print(f"model={args.model} context={args.context} threads={torch.get_num_threads()}")
    print(f"{'dtype':<9} {'step':<14} {'ms':>9} {'tokens/s':>10} {'GB/s':>7} {'GFLOP/s':>8}")
    for dtype in args.dtypes.split(","):
        loaded = load_model(args.model, dtype=dtype, device="cpu")
        model, cfg = loaded.model, loaded.config
        blocks_per_seq = -(-(args.context + 1) // block)
        num_blocks = max(max(batches) * blocks_per_seq, -(-max(chunks) // block))
        caches = model.allocate_kv_cache(num_blocks, block)
        pdt = PLANNER_DTYPE[dtype]

        def report(label: str, seconds: float, tokens: int, cost) -> None:
            print(f"{dtype:<9} {label:<14} {seconds * 1e3:9.1f} {tokens / seconds:10.1f} "
                  f"{cost.bytes / seconds / 1e9:7.2f} {cost.flops / seconds / 1e9:8.1f}")

        for b in batches:
            perm = torch.randperm(num_blocks).tolist()
            tables = [perm[i * blocks_per_seq:(i + 1) * blocks_per_seq] for i in range(b)]
            meta = AttentionMetadata.build(block_size=block, block_tables=tables, num_cached=[args.context] * b,
                                           query_lens=[1] * b, sliding_window=cfg.sliding_window)
            ids = torch.randint(100, cfg.vocab_size, (b,))
            pos = torch.full((b,), args.context)
            rows = torch.arange(b)
            t = median_time(lambda: model(ids, pos, caches, meta, rows), args.repeats)
            report(f"decode B={b}", t, b, decode_cost(cfg, b, args.context, pdt))
        for n in chunks:
            meta = AttentionMetadata.build(block_size=block, block_tables=[list(range(-(-n // block)))],
                                           num_cached=[0], query_lens=[n], sliding_window=cfg.sliding_window)
            ids = torch.randint(100, cfg.vocab_size, (n,))
            pos = torch.arange(n)
            last = torch.tensor([n - 1])
            t = median_time(lambda: model(ids, pos, caches, meta, last), args.repeats)
            report(f"prefill N={n}", t, n, prefill_cost(cfg, n, 1, pdt))
        del caches, loaded, model


if __name__ == "__main__":
    main()

"""Decode attention alone, one layer: the C++ kernel beside the PyTorch routes it was chosen over.

Routes, timed alternately pass by pass so outside load hits all alike:
  kernel     iterserve.kernels paged_decode: reads K/V blocks in place
  gather     the reference: index_select the blocks, then two batched matmuls
  compiled   torch.compile of the reference (with --compile; the first call compiles for minutes)

    .venv/bin/python scripts/bench_decode_attention.py --batches 1,16,64 --context 512 --compile
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from iterserve import kernels
from iterserve.attention import AttentionMetadata, KVCache
from iterserve.attention.reference import decode_attention_reference


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--heads", default="9,3", help="query heads,kv heads (SmolLM2-135M: 9,3)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()
    ops = kernels.ops or kernels.load_build()
    if ops is None:
        raise SystemExit("the CPU kernels are not built: run `iterserve build-kernels`")
    heads, kv_heads = (int(h) for h in args.heads.split(","))
    dim, bs, ctx, dtype = args.head_dim, args.block_size, args.context, getattr(torch, args.dtype)
    compiled = torch.compile(decode_attention_reference, dynamic=False) if args.compile else None
    print(f"{'batch':>5} {'route':<9} {'ms':>8} {'K/V GB/s':>9}")
    for b in (int(x) for x in args.batches.split(",")):
        per_seq = -(-(ctx + 1) // bs)
        cache = KVCache.allocate(b * per_seq, bs, kv_heads, dim, dtype, "cpu")
        cache.k.normal_()
        cache.v.normal_()
        perm = torch.randperm(b * per_seq).tolist()
        tables = [perm[i * per_seq:(i + 1) * per_seq] for i in range(b)]
        meta = AttentionMetadata.build(block_size=bs, block_tables=tables, num_cached=[ctx] * b, query_lens=[1] * b)
        q = torch.randn(b, heads, dim).to(dtype)
        out = torch.empty_like(q)
        routes = {
            "kernel": lambda: ops.paged_decode(out, q, cache.k, cache.v, meta.decode_block_tables,
                                               meta.decode_context_lens, dim**-0.5, 0),
            "gather": lambda: decode_attention_reference(q, cache, meta, dim**-0.5),
        }
        if compiled is not None:
            routes["compiled"] = lambda: compiled(q, cache, meta, dim**-0.5)
        times: dict[str, list[float]] = {r: [] for r in routes}
        for i in range(args.repeats + 1):  # the first round warms up (and compiles)
            for name, fn in routes.items():
                start = time.perf_counter()
                fn()
                if i:
                    times[name].append(time.perf_counter() - start)
        kv_bytes = 2 * b * (ctx + 1) * kv_heads * dim * cache.k.element_size()
        for name, t in times.items():
            med = statistics.median(t)
            print(f"{b:>5} {name:<9} {med * 1e3:8.3f} {kv_bytes / med / 1e9:9.2f}")


if __name__ == "__main__":
    main()

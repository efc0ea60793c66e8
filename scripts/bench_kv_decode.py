"""Time decode steps of the real model over a KV cache in each kv_cache_dtype: B sequences, each at a context of
C cached tokens, one new token each (the model's forward pass, sampling left out). Every kind runs the native
whole-step loop (csrc/decoder.cpp); the float cache also, for the A/B, the layers one by one. Steps alternate
between the kinds.

    .venv/bin/python scripts/bench_kv_decode.py --batch 16 --context 1500
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from iterserve import kernels
from iterserve.attention import AttentionMetadata
from iterserve.attention.cpu import CpuBackend
from iterserve.models.loader import load_model
from iterserve.models.native_decoder import NativeDecoder
from iterserve.platforms.ops import cpu_kernels


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=1500)
    ap.add_argument("--kinds", default="auto,fp8,fp8_e5m2,int8")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    ops = cpu_kernels()
    assert ops is not None, "build the kernels first (iterserve build-kernels)"
    kernels.run_on_pool()
    loaded = load_model(args.model, args.dtype, "cpu")
    model, bs, b, ctx = loaded.model, 16, args.batch, args.context
    per_seq = (ctx + bs) // bs + 1
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(b)]
    meta = AttentionMetadata.build(block_size=bs, block_tables=tables, num_cached=[ctx] * b, query_lens=[1] * b)
    ids = torch.randint(0, model.config.vocab_size, (b,))
    positions = torch.full((b,), ctx, dtype=torch.long)
    rows = torch.arange(b)
    runs = {}
    for kind in args.kinds.split(","):
        for native in ([True, False] if kind == "auto" else [True]):
            backend = CpuBackend(ops)
            caches = model.allocate_kv_cache(b * per_seq, bs, backend, kind)
            for c in caches:  # random K/V stored as this kind stores them
                fill = AttentionMetadata.build(block_size=bs, block_tables=[list(range(b * per_seq))],
                                               num_cached=[0], query_lens=[b * per_seq * bs])
                kv = torch.randn(b * per_seq * bs, c.v.shape[1], c.v.shape[3]).to(model.dtype)
                backend.write_kv(kv, kv, c, fill)
            decoder = NativeDecoder(ops) if native else None
            runs[f"{kind}{'' if native else ' (layers one by one)'}"] = (backend, decoder, caches, [])
    with torch.inference_mode():
        for _ in range(args.repeats + 2):
            for backend, decoder, caches, times in runs.values():
                start = time.perf_counter()
                model(ids, positions, caches, meta, backend, rows, decoder=decoder)
                times.append(time.perf_counter() - start)
    base = statistics.median(next(iter(runs.values()))[3][2:])
    print(f"{args.model} {args.dtype}, batch {b}, context {ctx}, {ops.extension.threads()} threads")
    for name, (_, _, caches, times) in runs.items():
        med = statistics.median(times[2:])
        kv_bytes = sum(t.numel() * t.element_size() for c in caches for t in (c.k, c.v, c.k_scale, c.v_scale)
                       if t is not None)
        print(f"{name:32s} {med * 1e3:8.2f} ms/step  (min {min(times[2:]) * 1e3:.2f})  {med / base:5.2f}x  "
              f"KV pool {kv_bytes / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()

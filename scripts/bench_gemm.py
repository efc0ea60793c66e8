"""The packed matmul kernel (``CpuOps.packed_linear``) against ``F.linear`` on the model's weight shapes.

    .venv/bin/python scripts/bench_gemm.py [--model smollm2-135m] [--rows 16,64,256] [--threads 2]

Each shape at each row count in bf16: GFLOP/s of both and their ratio, the median of 3 rounds of 7 timed calls.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from iterserve.bench.microbench import median_seconds
from iterserve.models.loader import load_model_config
from iterserve.platforms.ops import cpu_kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", default="16,64,256")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    ops = cpu_kernels()
    if ops is None:
        raise SystemExit("the C++ kernels are not built (scripts/setup.sh)")
    torch.set_num_threads(args.threads)
    cfg = load_model_config(args.model)
    h, q, kv, ff = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    shapes = [(h, q + 2 * kv), (q, h), (h, 2 * ff), (ff, h), (h, cfg.vocab_size)]  # [in, out]
    for rows in (int(r) for r in args.rows.split(",")):
        for k, n in shapes:
            x, w = torch.randn(rows, k).bfloat16(), torch.randn(n, k).bfloat16()
            packed = ops.pack_linear_weight(w)
            seconds = [statistics.median(median_seconds(f, 7) for _ in range(3))
                       for f in (lambda: F.linear(x, w), lambda: ops.packed_linear(x, packed, n, None, 10**9))]
            torch_gflops, ours = (2 * rows * k * n / s / 1e9 for s in seconds)
            print(f"rows {rows} {k}->{n}: F.linear {torch_gflops:.0f} GFLOP/s, packed {ours:.0f}, "
                  f"ratio {ours / torch_gflops:.2f}")


if __name__ == "__main__":
    main()

"""Time every linear method this machine offers on a model's weight shapes, at the row counts of decode
and prefill steps, with the weights streaming from memory as they do in a forward pass.

Each (shape, dtype) gets enough copies of its weight to fill ``--working-set-mb`` (past the last-level
cache), and one timed pass multiplies by each copy once, so every call reads its weight from memory as a
step does. Prints microseconds per call, the weight bytes read per second and GFLOP/s, beside this
machine's streaming read bandwidth at 1 and at N threads.

    .venv/bin/python scripts/bench_linear.py --model smollm2-135m --rows 1,2,4,8,16,64
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from iterserve import kernels
from iterserve.models.loader import load_model_config

Method = Callable[[torch.Tensor], torch.Tensor]


def shapes_of(model: str) -> dict[str, tuple[int, int]]:
    """``{name: (in_features, out_features)}`` of the model's linear layers (one rank)."""
    c = load_model_config(model)
    return {"qkv": (c.hidden_size, c.q_size + 2 * c.kv_size), "o": (c.q_size, c.hidden_size),
            "gate_up": (c.hidden_size, 2 * c.intermediate_size), "down": (c.intermediate_size, c.hidden_size),
            "lm_head": (c.hidden_size, c.vocab_size)}


def read_gbs(threads: int) -> float:
    """Streaming read: summing a 512 MiB tensor with ``threads`` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    x = torch.ones(128 * 2**20)
    x.sum()
    t = statistics.median(_timed(x.sum) for _ in range(5))
    torch.set_num_threads(before)
    return x.nbytes / t / 1e9


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def methods_for(w: torch.Tensor, rows: int) -> dict[str, Callable[[torch.Tensor], Method]]:
    """Each method as a factory: given one weight copy, prepare it (pack) and return ``x -> x W^T``."""
    out: dict[str, Callable[[torch.Tensor], Method]] = {"F.linear": lambda w: lambda x: F.linear(x, w)}
    if w.dtype == torch.float32 and torch.backends.mkl.is_available():
        def mkl(w: torch.Tensor) -> Method:
            packed = torch.ops.mkl._mkl_reorder_linear_weight(w, rows)
            return lambda x: torch.ops.mkl._mkl_linear(x, packed, w, None, rows)
        out["mkl-packed"] = mkl
    if torch.backends.mkldnn.is_available():
        def onednn(w: torch.Tensor) -> Method:
            packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
            return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        out["onednn-packed"] = onednn
    if kernels.ops is not None:
        ops = kernels.ops

        def packed(w: torch.Tensor, amx_min_rows: int = 1) -> Method:
            p, n = ops.pack_linear_weight(w), w.shape[0]
            return lambda x: ops.packed_linear(x, p, n, None, amx_min_rows)
        out["packed"] = packed
        if w.dtype == torch.bfloat16:  # the same kernel without AMX tiles (vdpbf16ps, or widened FMAs)
            out["packed-noamx"] = lambda w: packed(w, 1 << 30)
    return out


def bench_shape(k: int, n: int, dtype: torch.dtype, rows: int, working_set: int, repeats: int,
                threads: int) -> dict[str, float]:
    """Median seconds per call of each method for x [rows, k] @ W [n, k]^T: torch's on ``threads`` OpenMP
    threads, the kernels on their pool of as many with torch at one thread, as the engine runs them
    (``kernels.run_on_pool``: an OpenMP team spinning after its last region slows the pool's threads)."""
    w0 = torch.randn(n, k, dtype=torch.float32).div_(k**0.5).to(dtype)
    copies = max(2, -(-working_set // w0.nbytes))
    x = torch.randn(rows, k).to(dtype)
    results: dict[str, float] = {}
    for name, factory in methods_for(w0, rows).items():
        torch.set_num_threads(1 if name.startswith("packed") else threads)
        try:
            fns = [factory(w0.clone()) for _ in range(copies)]
        except RuntimeError as e:  # oneDNN's packed bf16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT
            print(f"{name} skipped for {dtype}: {str(e).splitlines()[0]}")
            continue
        for fn in fns[:2]:
            fn(x)  # warm-up: first calls pick the kernel for the shape
        per_pass = [_timed(lambda fns=fns: [fn(x) for fn in fns]) for _ in range(repeats)]
        results[name] = statistics.median(per_pass) / copies
        del fns
    torch.set_num_threads(threads)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rows", default="1,2,4,8,16,64")
    ap.add_argument("--layers", default=None, help="comma-separated subset of qkv,o,gate_up,down,lm_head")
    ap.add_argument("--working-set-mb", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    if kernels.ops is not None:
        kernels.run_on_pool(threads)
        torch.set_num_threads(threads)
    peak = read_gbs(threads)
    print(f"model={args.model} threads={threads} streaming read: {read_gbs(1):.1f} GB/s at 1 thread, "
          f"{peak:.1f} GB/s at {threads}")
    shapes = shapes_of(args.model)
    if args.layers:
        shapes = {name: shapes[name] for name in args.layers.split(",")}
    print(f"{'dtype':<9} {'layer':<8} {'K->N':<12} {'rows':>4} {'method':<14} {'us':>9} {'GB/s':>7} {'%read':>6} "
          f"{'GFLOP/s':>8} {'best':>5}")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for layer, (k, n) in shapes.items():
            for rows in (int(r) for r in args.rows.split(",")):
                res = bench_shape(k, n, dtype, rows, args.working_set_mb * 2**20, args.repeats, threads)
                best = min(res.values())
                for name, t in res.items():
                    gbs = n * k * dtype.itemsize / t / 1e9
                    print(f"{dtype_name:<9} {layer:<8} {f'{k}->{n}':<12} {rows:>4} {name:<14} {t * 1e6:9.1f} "
                          f"{gbs:7.1f} {100 * gbs / peak:5.0f}% {2 * rows * n * k / t / 1e9:8.1f} "
                          f"{'*' if t == best else '':>5}")


if __name__ == "__main__":
    main()

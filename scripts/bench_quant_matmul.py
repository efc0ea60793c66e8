"""Time the quantized matmul against F.linear on the float32 and bfloat16 weights, per shape and number of rows.

    .venv/bin/python scripts/bench_quant_matmul.py [--torch-ops]

Shapes are SmolLM2-135M's projections (qkv 576->960, o 576->576, gate/up 576->3072, down 1536->576, LM
head 576->49152) and one Llama-7B projection (4096->4096). ``--torch-ops`` adds torch's own weight-only
ops (``_weight_int8pack_mm`` per-channel int8, ``_weight_int4pack_mm_for_cpu`` with groups of 32).
Prints microseconds (median) per call and the bytes/s the quantized weights stream at.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import gguf
import torch
import torch.nn.functional as F

from iterserve.formats.gguf.tensors import from_gguf
from iterserve.quantization import packed as P

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152), (4096, 4096)]
ROWS = [1, 2, 4, 8, 16, 32, 64]


def median_us(fn: Callable[[], object], min_time: float = 0.1) -> float:
    fn()
    times: list[float] = []
    end = time.perf_counter() + min_time
    while time.perf_counter() < end or len(times) < 5:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def torch_ops(w: torch.Tensor, q41: P.PackedWeight) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    scale = w.abs().amax(1) / 127
    w8 = (w / scale[:, None]).round().to(torch.int8)
    q, d, c = P.unpack(q41)  # torch's int4 value is (q - 8) * scale + zero: zero = c + 8 d
    w4 = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    sz = torch.stack([d.float(), c.float() + 8 * d.float()], -1).transpose(0, 1).contiguous()
    return {"torch_int8": lambda x: torch._weight_int8pack_mm(x, w8, scale),
            "torch_int4": lambda x: torch._weight_int4pack_mm_for_cpu(x, w4, 32, sz)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch-ops", action="store_true", help="also time torch's weight-only int8/int4 ops")
    parser.add_argument("--rows", type=int, nargs="*", default=ROWS)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, kernel isa {P.best_isa()}")
    for k, n in SHAPES:
        w = torch.randn(n, k) * 0.02
        q41 = P.pack(from_gguf(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_1), "Q4_1", n, k))
        q8 = P.pack(P.quantize_int8(w))
        wb = w.to(torch.bfloat16)
        fns: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
            "f32": lambda x: F.linear(x, w), "bf16": lambda x: F.linear(x, wb), "Q4_1": lambda x: P.linear(x, q41),
            "int8": lambda x: P.linear(x, q8)}
        if args.torch_ops:
            fns.update(torch_ops(w, q41))
        for m in args.rows:
            x = torch.randn(m, k)
            xs = {name: x.to(torch.bfloat16) if name == "bf16" else x for name in fns}
            us = {name: median_us(lambda: fn(xs[name])) for name, fn in fns.items()}
            cells = " ".join(f"{name}={t:.0f}us" for name, t in us.items())
            ratios = (f"f32/Q4_1={us['f32'] / us['Q4_1']:.2f} bf16/Q4_1={us['bf16'] / us['Q4_1']:.2f} "
                      f"f32/int8={us['f32'] / us['int8']:.2f}")
            gbs = f"Q4_1 {q41.nbytes / us['Q4_1'] / 1e3:.1f} GB/s"
            print(f"{k}->{n} rows={m}: {cells}  {ratios}  {gbs}", flush=True)


if __name__ == "__main__":
    main()

"""Decode steps of one model loaded float and quantized, timed in the same run: rounds of ``--steps``
consecutive steps of each format in turn (as a server runs step after step of one model, so a model that
fits the last-level cache stays there; alternating every step would evict it), medians over the rounds.

    .venv/bin/python scripts/bench_quant_decode.py --batches 1,64

For each weight format (``none``: float32 dense, ``bf16`` dense, ``gguf`` blocks, ``int8`` blocks) and decode
batch this prints ms per step, tokens/s, the speed-up over float32, the matmul weight bytes a step streams, and
how close the step comes to its memory floor (those bytes at the streaming read bandwidth measured here, as a fraction).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from iterserve import kernels
from iterserve.attention import AttentionMetadata
from iterserve.attention.selector import select_backend
from iterserve.engine.worker import prepare_cpu
from iterserve.models.loader import load_model
from iterserve.models.native_decoder import NativeDecoder
from iterserve.quantization.model import describe, streamed_weight_bytes, weight_formats


def peak_read_gbs() -> float:
    """Streaming read bandwidth: summing a tensor far larger than the caches (median of 5), on as many threads
    as the engine's kernels use (``prepare_cpu`` leaves torch one thread; one thread read 29 GB/s where two
    read 36 on a 2-core EPYC, and the kernels stream the weights on two). A median, not the best of many as
    :func:`iterserve.bench.microbench.measure_bandwidth` takes: the floor is set against this VM's usual
    bandwidth, not its best moment."""
    x = torch.ones(128 * 2**20, dtype=torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(kernels.ops.threads() if kernels.ops is not None else threads)
    times = []
    for _ in range(6):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    torch.set_num_threads(threads)
    return x.numel() * 4 / statistics.median(times[1:]) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--formats", default="none,bf16,gguf,int8",
                    help="quantizations to load (none: float32 weights, bf16: bfloat16 weights)")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--context", type=int, default=128, help="tokens already cached per sequence")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="consecutive steps of one format per round")
    ap.add_argument("--layer-by-layer", action="store_true",
                    help="also time each format with the layers called one by one from Python (rows '/py'): the "
                         "same kernels without the CPU backend's native decode loop")
    args = ap.parse_args()
    prepare_cpu()  # as a CPU engine does: malloc tuning, the kernels' thread pool
    block = 16
    batches = [int(b) for b in args.batches.split(",")]
    print(f"model={args.model} context={args.context} threads={kernels.ops.threads() if kernels.ops else 1}")
    models = {}
    for fmt in args.formats.split(","):
        dense = fmt in ("none", "bf16")
        loaded = load_model(args.model, dtype="bfloat16" if fmt == "bf16" else "float32", device="cpu",
                            quantization=None if dense else fmt)
        models[fmt] = loaded.model
        print(f"{fmt}: {describe(weight_formats(loaded.model))}; streamed per step "
              f"{streamed_weight_bytes(loaded.model) / 1e6:.1f} MB")
    cfg = next(iter(models.values())).config
    blocks_per_seq = -(-(args.context + 1) // block)
    backend = select_backend("cpu")
    caches = {f: m.allocate_kv_cache(max(batches) * blocks_per_seq, block, backend) for f, m in models.items()}
    decoders = {"": NativeDecoder.for_device("cpu")}  # as the engine runs a step of decodes
    if args.layer_by_layer:
        decoders["/py"] = None
    print(f"{'format':<9} {'batch':>5} {'ms':>8} {'tokens/s':>9} {'vs f32':>7} {'floor ms':>9} {'of floor':>9}")
    for b in batches:
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(b)]
        meta = AttentionMetadata.build(block_size=block, block_tables=tables, num_cached=[args.context] * b,
                                       query_lens=[1] * b, sliding_window=cfg.sliding_window)
        ids, pos = torch.randint(100, cfg.vocab_size, (b,)), torch.full((b,), args.context)
        steps = {f + tag: functools.partial(m, ids, pos, caches[f], meta, backend, decoder=decoder)
                 for tag, decoder in decoders.items() for f, m in models.items()}
        times: dict[str, list[float]] = {f: [] for f in steps}
        reads = []
        for i in range(args.rounds + 1):  # the first round warms up
            if i:
                reads.append(peak_read_gbs())
            for f, step in steps.items():
                for _ in range(args.steps):
                    start = time.perf_counter()
                    step()
                    if i:
                        times[f].append(time.perf_counter() - start)
        read = statistics.median(reads)
        print(f"batch {b}: streaming read {read:.1f} GB/s (median of the rounds' probes, "
              f"{min(reads):.1f}-{max(reads):.1f})")
        base = {tag: statistics.median(times["none" + tag]) for tag in decoders if "none" + tag in times}
        for f, t in times.items():
            s = statistics.median(t)
            fmt, tag = f.split("/")[0], f[len(f.split("/")[0]):]
            floor = streamed_weight_bytes(models[fmt], b) / (read * 1e9)
            ratio = f"{base[tag] / s:6.2f}x" if tag in base else "-"
            print(f"{f:<9} {b:>5} {s * 1e3:8.2f} {b / s:9.1f} {ratio:>7} {floor * 1e3:9.2f} {floor / s:9.2f}")
    if kernels.ops is not None:
        print(kernels.pool_solos_line())

if __name__ == "__main__":
    main()

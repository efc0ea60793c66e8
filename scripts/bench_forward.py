"""Time single forward passes of the model layer: decode batches and prefill chunks.

For each dtype this prints ms per step, tokens/s, and the achieved memory bandwidth and FLOP/s
implied by the planner's cost model (weights streamed once per step plus the K/V read), beside this
machine's peaks measured by the same script: a streaming read (sum of a 512 MiB tensor) and a large
F.linear in the benchmarked dtype. ``floor ms`` is the step's bytes at the streaming read bandwidth, that
read timed in turn with the steps (the VM's bandwidth moves by half within minutes), ``floor`` that time
over the measured one (1.0: the step runs at the memory floor), ``xB=1`` a decode step's time over the
batch-1 step's on the same path.

When the C++ CPU kernels are built, each shape runs on both paths: ``fused`` (the kernels, the
linear methods chosen at load, listed first, and the kernels' thread pool as an engine runs them) and
``reference`` (PyTorch and F.linear on torch's threads, as with ITERSERVE_CPU_KERNELS=0). Passes
alternate (every decode batch and path in turn, then each prefill chunk's paths) so that load from
other processes and the VM's moving bandwidth hit them alike, and the xB=1 ratios compare steps taken
side by side. ``--busy N`` runs N busy-looping
processes beside the steps: what a step costs on a shared machine. ``--paths fused`` keeps one copy of the
weights in memory, as an engine does (two copies evict each other from the last-level cache).

    .venv/bin/python scripts/bench_forward.py --dtypes float32,bfloat16 --context 512
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Hashable, Iterator
from typing import TypeVar

import torch
import torch.nn.functional as F

from iterserve import kernels
from iterserve.attention import AttentionBackend, AttentionMetadata
from iterserve.attention.cpu import CpuBackend
from iterserve.attention.reference import ReferenceBackend
from iterserve.bench.microbench import median_seconds, streaming_read_gbs
from iterserve.config.dtypes import canonical_dtype
from iterserve.models import cpu_linear
from iterserve.models.linear import dense_chooser
from iterserve.models.loader import load_model
from iterserve.models.native_decoder import NativeDecoder
from iterserve.planner import decode_cost, prefill_cost
from iterserve.platforms.malloc import tune_allocator
from iterserve.platforms.ops import CpuOps, cpu_kernels

Key = TypeVar("Key", bound=Hashable)


def interleaved_medians(fns: dict[Key, Callable[[], object]], threads: dict[Key, int],
                        repeats: int) -> dict[Key, float]:
    """Median seconds of each ``fn`` (on its torch thread count), all of them alternating pass by pass."""
    times: dict[Key, list[float]] = {p: [] for p in fns}
    for i in range(repeats + 1):  # the first round warms up
        for path, fn in fns.items():
            torch.set_num_threads(threads[path])
            start = time.perf_counter()
            fn()
            if i:
                times[path].append(time.perf_counter() - start)
    return {p: statistics.median(t) for p, t in times.items()}


@contextlib.contextmanager
def busy_processes(n: int) -> Iterator[None]:
    """``n`` processes spinning on a core each, as other work on a shared machine does."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


class StreamingRead:
    """A sum of 512 MiB timed in turn with the steps: the floor's bandwidth as the steps meet it. After each
    read it idles 20 ms, so that torch's OpenMP threads stop spinning before the next step: right after the
    read, a bf16 batch-1 step took 16.1 against 10.5 ms."""

    def __init__(self) -> None:
        self.data = torch.ones(128 * 2**20)
        self.seconds: list[float] = []

    def __call__(self) -> None:
        start = time.perf_counter()
        self.data.sum()
        self.seconds.append(time.perf_counter() - start)
        time.sleep(0.02)

    def gbs(self) -> float:
        """The median read since the last call, in GB/s."""
        seconds, self.seconds = statistics.median(self.seconds), []
        return self.data.nbytes / seconds / 1e9


def peak_linear_gflops(dtype: torch.dtype) -> float:
    """F.linear on a large square problem in ``dtype``: the best the matmul library does here."""
    n = 2048
    x, w = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / median_seconds(lambda: F.linear(x, w), 5) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--context", type=int, default=512, help="tokens already cached per decoding sequence")
    ap.add_argument("--prefill", default="128,512", help="prefill chunk lengths ('' for none)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--paths", default="fused,reference", help="fused (when built) and/or reference")
    ap.add_argument("--busy", type=int, default=0, help="busy-looping processes to run beside the benchmark")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tune_allocator()
    batches = [int(b) for b in args.batches.split(",")]
    chunks = [int(c) for c in args.prefill.split(",") if c]
    if min(batches + chunks) < 1:
        ap.error("--batches and --prefill take lengths of at least 1 ('' for no prefill chunk)")
    wanted = args.paths.split(",")
    paths: dict[str, AttentionBackend] = {}
    ops = cpu_kernels()
    if "fused" in wanted and ops is not None:
        paths["fused"] = CpuBackend(ops)
    if "reference" in wanted or not paths:
        paths["reference"] = ReferenceBackend()
    read_gbs = streaming_read_gbs()
    threads = {"reference": torch.get_num_threads(), "read": torch.get_num_threads()}
    if "fused" in paths:
        kernels.run_on_pool()  # as an engine does: the kernels' pool gets the threads, torch keeps one
        threads["fused"] = 1
    print(f"model={args.model} context={args.context} threads={threads['reference']} paths={','.join(paths)} "
          f"busy={args.busy}")
    print(f"measured peaks: streaming read {read_gbs:.1f} GB/s at the start (each floor uses the read beside it)")
    linear = {dtype: peak_linear_gflops(getattr(torch, dtype)) for dtype in args.dtypes.split(",")}
    for dtype, gflops in linear.items():
        print(f"measured peaks: {dtype} F.linear {gflops:.1f} GFLOP/s")
    models = {dtype: {path: load_model(args.model, dtype=dtype, device="cpu",
                                       linear=None if path == "fused" else dense_chooser) for path in paths}
              for dtype in linear}
    torch.set_num_threads(threads["fused" if "fused" in paths else "reference"])
    chooser = cpu_linear.chooser()
    for line in chooser.report() if isinstance(chooser, cpu_linear.MeasuredChooser) else []:
        print(f"linear method: {line}")
    print(f"{'dtype':<9} {'step':<14} {'path':<10} {'ms':>9} {'tokens/s':>10} {'GB/s':>7} {'floor ms':>8} "
          f"{'floor':>6} {'GFLOP/s':>8} {'%linear':>7} {'xB=1':>6}")
    with busy_processes(args.busy):
        for dtype, linear_gflops in linear.items():
            run_dtype(args, dtype, models.pop(dtype), paths, threads, linear_gflops, batches, chunks)
    if "fused" in paths:
        print(kernels.pool_solos_line())


def run_dtype(args, dtype: str, loaded: dict, paths: dict[str, AttentionBackend], threads: dict[str, int],
              linear_gflops: float, batches: list[int], chunks: list[int]) -> None:
    """Every decode batch and prefill chunk of one dtype, each path on its own copy of the model and its own
    KV cache, laid out as its backend reads it (each pass rewrites the slots it reads)."""
    reading = StreamingRead()
    block = 16
    cfg = next(iter(loaded.values())).config
    blocks_per_seq = -(-(args.context + 1) // block)
    num_blocks = max(max(batches) * blocks_per_seq, -(-max(chunks, default=1) // block))
    caches = {path: m.model.allocate_kv_cache(num_blocks, block, paths[path]) for path, m in loaded.items()}
    pdt = canonical_dtype(dtype)
    decoders = {path: NativeDecoder(b.ops) if isinstance(b.ops, CpuOps) else None for path, b in paths.items()}

    batch1: dict[str, float] = {}  # each path's batch-1 decode step

    def report(label: str, tokens: int, cost, medians: dict[str, float], read_gbs: float) -> None:
        floor = cost.bytes / (read_gbs * 1e9)
        for path, seconds in medians.items():
            gbs, gflops = cost.bytes / seconds / 1e9, cost.flops / seconds / 1e9
            if label == "decode B=1":
                batch1[path] = seconds
            vs1 = f"{seconds / batch1[path]:6.2f}" if label.startswith("decode") and path in batch1 else ""
            print(f"{dtype:<9} {label:<14} {path:<10} {seconds * 1e3:9.1f} {tokens / seconds:10.1f} "
                  f"{gbs:7.2f} {floor * 1e3:8.1f} {floor / seconds:6.2f} {gflops:8.1f} "
                  f"{100 * gflops / linear_gflops:6.0f}% {vs1:>6}")
        if len(medians) == 2:
            print(f"{'':<9} {label:<14} {'speed-up':<10} {medians['reference'] / medians['fused']:8.2f}x")

    def passes(ids, pos, meta, rows) -> dict[str, Callable[[], object]]:
        return {path: functools.partial(m.model, ids, pos, caches[path], meta, paths[path], logits_indices=rows,
                                        decoder=decoders[path]) for path, m in loaded.items()}

    # Every decode batch and path alternate pass by pass, so the xB=1 ratios compare steps taken under
    # the same load and bandwidth (the VM's streaming read moves within minutes).
    decodes: dict[tuple[int, str], Callable[[], object]] = {}
    for b in batches:
        perm = torch.randperm(num_blocks).tolist()
        tables = [perm[i * blocks_per_seq:(i + 1) * blocks_per_seq] for i in range(b)]
        meta = AttentionMetadata.build(block_size=block, block_tables=tables, num_cached=[args.context] * b,
                                       query_lens=[1] * b, sliding_window=cfg.sliding_window)
        ids = torch.randint(100, cfg.vocab_size, (b,))
        for path, fn in passes(ids, torch.full((b,), args.context), meta, torch.arange(b)).items():
            decodes[(b, path)] = fn
    decodes[(0, "read")] = reading
    medians = interleaved_medians(decodes, {key: threads[key[1]] for key in decodes}, args.repeats)
    read_gbs = reading.gbs()
    print(f"{dtype:<9} streaming read beside the decode steps: {read_gbs:.1f} GB/s")
    for b in batches:
        report(f"decode B={b}", b, decode_cost(cfg, b, args.context, pdt),
               {path: medians[(b, path)] for path in loaded}, read_gbs)
    for n in chunks:
        meta = AttentionMetadata.build(block_size=block, block_tables=[list(range(-(-n // block)))],
                                       num_cached=[0], query_lens=[n], sliding_window=cfg.sliding_window)
        ids = torch.randint(100, cfg.vocab_size, (n,))
        fns = {**passes(ids, torch.arange(n), meta, torch.tensor([n - 1])), "read": reading}
        medians = interleaved_medians(fns, threads, args.repeats)
        del medians["read"]
        report(f"prefill N={n}", n, prefill_cost(cfg, n, 1, pdt), medians, reading.gbs())


if __name__ == "__main__":
    main()

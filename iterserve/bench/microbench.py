"""Microbenchmarks of the machine they run on: memory bandwidth and matmul FLOP/s per dtype.

:func:`measure_local` packs them into an :class:`~iterserve.planner.hardware.Accelerator`, so the
planner takes a measured machine where it takes a datasheet entry.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from iterserve.config.dtypes import canonical_dtype, torch_dtype
from iterserve.planner.hardware import Accelerator, GiB, match_device_name
from iterserve.platforms.cpu import cpu_model_name
from iterserve.platforms.memory import available_memory_bytes, physical_memory_bytes


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _time_op(fn: Callable[[], Any], device: str, budget_s: float, min_iters: int = 3) -> float:
    """Best (minimum) seconds per call of ``fn`` within a time budget, after one warm-up."""
    fn()
    _sync(device)
    best = float("inf")
    deadline = time.perf_counter() + budget_s
    iters = 0
    while iters < min_iters or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
        iters += 1
        if iters >= 1000:
            break
    return best


def median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """Median wall seconds of ``fn`` over ``repeats`` calls, after one warm-up call (on the CPU). The median,
    not the best: what a run of steps meets on a machine whose bandwidth moves."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def streaming_read_gbs(repeats: int = 5) -> float:
    """The CPU's streaming read in GB/s: the median of summing a 512 MiB tensor, far larger than the caches."""
    x = torch.ones(128 * 2**20, dtype=torch.float32)
    return x.numel() * 4 / median_seconds(x.sum, repeats) / 1e9


def _cpu_llc_bytes() -> int:
    try:
        sizes = []
        base = "/sys/devices/system/cpu/cpu0/cache"
        for entry in os.listdir(base):
            if entry.startswith("index"):
                with open(os.path.join(base, entry, "size")) as f:
                    text = f.read().strip().upper()
                mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
                sizes.append(int(text.rstrip("KMG")) * mult)
        return max(sizes) if sizes else 32 * 2**20
    except OSError:
        return 32 * 2**20


def measure_bandwidth(device: str = "cpu", budget_s: float = 0.6) -> dict[str, float]:
    """Achievable memory bandwidth in B/s from a large copy and a large sum (read-only).

    The buffer is sized well past the last-level cache (8x LLC on CPU, 1 GiB on CUDA) so the
    numbers reflect DRAM/HBM, not cache. Returns ``{"copy": ..., "read": ..., "buffer_bytes": ...}``
    (copy counts the bytes read plus the bytes written).
    """
    if device.startswith("cuda"):
        nbytes = 1 * GiB
    else:
        nbytes = max(256 * 2**20, 8 * _cpu_llc_bytes())
        nbytes = min(nbytes, max(64 * 2**20, available_memory_bytes() // 8))
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    t_copy = _time_op(functools.partial(dst.copy_, src), device, budget_s / 2)
    t_read = _time_op(src.sum, device, budget_s / 2)
    return {"copy": 2 * n * 4 / t_copy, "read": n * 4 / t_read, "buffer_bytes": float(n * 4)}


def _dtype_supported(dtype: torch.dtype, device: str) -> bool:
    try:
        a = torch.ones(8, 8, dtype=dtype, device=device)
        (a @ a).sum().item()
        return True
    except (RuntimeError, TypeError):
        return False


def measure_matmul_flops(
    dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16"),
    device: str = "cpu",
    budget_s: float = 0.4,
    rounds: int = 2,
) -> dict[str, float]:
    """Achievable square-matmul FLOP/s per dtype (skipping dtypes the device cannot multiply).

    Each dtype takes about ``budget_s`` in all: on CPU the size (256 to 2048) comes from a
    quick probe, so a dtype without a fast kernel does not stall the run; CUDA uses 8192. The
    dtypes are timed in ``rounds`` interleaved rounds and the best round is kept, so a burst of
    load from other processes does not sink one dtype. ``tf32`` is measured on CUDA only.
    """
    cuda = device.startswith("cuda")
    operands: dict[str, tuple[Any, Any, int]] = {}
    for name in dtypes:
        if name not in ("fp32", "tf32", "bf16", "fp16") or (name == "tf32" and not cuda):
            continue
        td = torch_dtype(name)
        if not _dtype_supported(td, device):
            continue
        if cuda:
            n = 8192
        else:
            # probe at a small size, then pick n so one multiply takes ~budget/8
            p = 256
            a = torch.randn(p, p).to(td)
            rate = 2 * p**3 / _time_op(functools.partial(torch.matmul, a, a), device, 0.0, min_iters=2)
            n = int((rate * budget_s / 8 / 2) ** (1 / 3)) // 64 * 64
            n = min(max(n, 256), 2048)
        a = torch.randn(n, n, device=device).to(td)
        b = torch.randn(n, n, device=device).to(td)
        operands[name] = (a, b, n)
    out: dict[str, float] = {}
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        for _ in range(max(1, rounds)):
            for name, (a, b, n) in operands.items():
                if cuda:
                    torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
                t = _time_op(functools.partial(torch.matmul, a, b), device, budget_s / max(1, rounds))
                out[name] = max(out.get(name, 0.0), 2 * n**3 / t)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    return out


def measure_local(device: str | None = None, budget_s: float = 2.0) -> Accelerator:
    """Measure this machine (``"cpu"``, ``"cuda"``; default: CUDA when available, else CPU).

    Runs a bandwidth benchmark and a matmul benchmark per dtype, a few seconds in all, and
    returns an :class:`Accelerator` whose ``bandwidth`` is the better of copy and read
    bandwidth and whose ``memory_bytes`` is the device memory (physical RAM on CPU).
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA device")
    bw = measure_bandwidth(device, budget_s=budget_s * 0.3)
    dtypes = ("fp32", "tf32", "bf16", "fp16") if device.startswith("cuda") else ("fp32", "bf16", "fp16")
    flops = measure_matmul_flops(dtypes, device=device, budget_s=budget_s * 0.7 / len(dtypes))
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        memory = int(props.total_memory)
        label = props.name
    else:
        memory = physical_memory_bytes()
        label = cpu_model_name()
    threads = torch.get_num_threads()
    details: dict[str, Any] = {"copy_bandwidth": bw["copy"], "read_bandwidth": bw["read"],
                               "buffer_bytes": bw["buffer_bytes"], "device": device,
                               "device_name": label, "torch": torch.__version__}
    if not device.startswith("cuda"):
        details["threads"] = threads
    datasheet = match_device_name(label) if device.startswith("cuda") else None
    if datasheet is not None:
        details["datasheet_entry"] = datasheet.name
    return Accelerator(
        name=f"local {device} (measured)",
        flops=flops,
        bandwidth=max(bw["copy"], bw["read"]),
        memory_bytes=memory,
        source=f"measured on {label} with torch {torch.__version__}"
        + ("" if device.startswith("cuda") else f", {threads} threads"),
        measured=True,
        details=details,
    )


# a measurement of this machine is printed only when its repeats agree this closely (max - min over median)
MAX_MEASURE_SPREAD = 0.2


def _spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values)


def measure_local_repeated(device: str | None = None, dtype: str = "fp32", repeats: int = 3,
                           max_spread: float = MAX_MEASURE_SPREAD) -> Accelerator:
    """:func:`measure_local` ``repeats`` times; the medians, with every run kept in ``details``.

    Raises ValueError when the runs' bandwidth, ``dtype`` FLOP/s or ops:byte disagree by more than
    ``max_spread`` (max - min over the median): a machine busy with other work gives a different
    figure each time, and a figure that does not repeat is not this machine's.
    """
    if repeats < 1:
        raise ValueError(f"measure repeats must be >= 1, got {repeats}")
    runs = [measure_local(device) for _ in range(repeats)]
    key = canonical_dtype(dtype)
    if key not in runs[0].flops:
        raise ValueError(f"this machine cannot multiply {key}; measured {', '.join(runs[0].flops)}")
    series = {"bandwidth": [r.bandwidth for r in runs], f"{key} FLOP/s": [r.flops[key] for r in runs],
              "ops:byte": [r.ops_per_byte(key) for r in runs]}
    spreads = {name: _spread(values) for name, values in series.items()}
    if repeats > 1 and max(spreads.values()) > max_spread:
        worst = max(spreads, key=spreads.__getitem__)
        shown = ", ".join(f"{v:.3g}" for v in series[worst])
        raise ValueError(f"{repeats} measurements of this machine disagree: {worst} {shown} (spread "
                         f"{spreads[worst]:.0%}, more than {max_spread:.0%}); a figure that does not repeat is not "
                         "this machine's, so none is printed: rerun when the machine is quiet")
    first = runs[0]
    flops = {k: statistics.median(r.flops[k] for r in runs) for k in first.flops}
    details = {**first.details, "repeats": repeats, "spread": spreads,
               "runs": [{"bandwidth": r.bandwidth, "flops": r.flops} for r in runs]}
    spread_text = f"; {repeats} runs, spread {max(spreads.values()):.0%}" if repeats > 1 else ""
    return dataclasses.replace(first, flops=flops, bandwidth=statistics.median(series["bandwidth"]),
                               details=details, source=first.source + spread_text)

"""The CPU's linear methods and the choice among them, by measurement, when a model loads.

:class:`PackedLinear` runs the C++ kernel of ``csrc/linear.cpp`` on a weight re-laid out once: it streams
the weight once per call however few rows a decode step has (the BLAS behind ``F.linear`` re-reads or
re-packs it per call, so its time grows with the rows), and on a CPU with AMX it multiplies bf16 on the tiles
(docs/benchmarks-history.md has the figures). ``F.linear``
keeps the large-row float32 shapes where the BLAS's cache blocking wins.

:class:`MeasuredChooser` times every candidate on each distinct layer shape at 1, 8 and 64 rows (a
decode step, a small batch, a large batch or prompt chunk) and gives the layer the one with the least
total time relative to the best at each row count; a batch-invariant dtype (:mod:`iterserve.platforms.invariance`)
takes the packed kernel unmeasured. Choices are kept per process, keyed by shape, dtype and thread count, and
logged with their times (``scripts/bench_forward.py`` prints them).
"""

from __future__ import annotations

import logging
import statistics
import time
import typing

import torch
from torch import nn

from iterserve.models.linear import DENSE, LinearBase, LinearMethod, MethodChooser, dense_chooser
from iterserve.models.native_decoder import LinearKind, NativeLinear
from iterserve.platforms import huge_pages
from iterserve.platforms.invariance import batch_invariant
from iterserve.platforms.ops import CpuOps, cpu_kernels

logger = logging.getLogger(__name__)

PROBE_ROWS = (1, 8, 64)

# Rows from which bf16 runs on AMX tiles (where built) rather than vdpbf16ps: tiles won at every row count
# measured, even below 16 rows where they are mostly padding (docs/benchmarks-history.md).
AMX_MIN_ROWS = 1


class PackedLinear(LinearMethod):
    """``csrc/linear.cpp``'s kernel on the weight packed into column blocks (``layer.packed``)."""

    name = "packed"
    keeps_weight = False

    def __init__(self, ops: CpuOps) -> None:
        self.ops = ops

    def supports(self, layer: LinearBase) -> bool:
        w = layer.weight
        return w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16, torch.float16)

    def process_weights(self, layer: LinearBase) -> None:
        # A buffer, not a parameter: the model's parameters stay the checkpoint's tensors. Every step streams
        # it: on 2 MiB pages.
        packed = huge_pages.copy(self.ops.pack_linear_weight(layer.weight.detach()))
        layer.register_buffer("packed", packed, persistent=False)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        packed = typing.cast(torch.Tensor, layer.packed)  # a buffer: get_buffer's lookup would cost every call
        return self.ops.packed_linear(x, packed, layer.out_features, layer.bias, AMX_MIN_ROWS)

    def logits(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        packed = typing.cast(torch.Tensor, layer.packed)
        return self.ops.packed_linear(x, packed, layer.out_features, layer.bias, AMX_MIN_ROWS, float_out=True)

    def native(self, layer: LinearBase) -> NativeLinear:
        return NativeLinear(LinearKind.COLUMN_BLOCKED, [layer.get_buffer("packed")], layer.out_features, layer.bias,
                            amx_min_rows=AMX_MIN_ROWS)

    def dense_weight(self, layer: LinearBase) -> torch.Tensor:
        p = layer.get_buffer("packed")
        n, k = layer.out_features, layer.in_features
        if p.dim() == 4:  # [blocks, k-pairs, 16, 2]
            return p.permute(0, 2, 1, 3).reshape(p.shape[0] * p.shape[2], -1)[:n, :k]
        return p.transpose(1, 2).reshape(-1, k)[:n]  # [blocks, k, V]


class MeasuredChooser:
    """Gives each layer the fastest of ``candidates`` on its shape, measured once per shape."""

    def __init__(self, candidates: list[LinearMethod]) -> None:
        self.candidates = candidates
        self.measured: dict[tuple, dict[str, list[float]]] = {}  # key -> method -> seconds per PROBE_ROWS
        self._choice: dict[tuple, LinearMethod] = {}

    def __call__(self, layer: LinearBase) -> LinearMethod:
        usable = [m for m in self.candidates if m.supports(layer)]
        if len(usable) <= 1:
            return usable[0] if usable else DENSE
        w = layer.weight
        invariant = [m for m in usable if isinstance(m, PackedLinear)] if batch_invariant(w.dtype) else []
        if invariant:  # oneDNN picks its kernel and k blocking by row count: not one order per row
            return invariant[0]
        key = (layer.in_features, layer.out_features, w.dtype, layer.bias is not None, torch.get_num_threads())
        if key not in self._choice:
            times = {m.name: _time_method(m, layer) for m in usable}
            best = [min(t[i] for t in times.values()) for i in range(len(PROBE_ROWS))]
            score = {name: sum(s / b for s, b in zip(t, best, strict=True)) for name, t in times.items()}
            choice = min(usable, key=lambda m: score[m.name])
            self.measured[key], self._choice[key] = times, choice
            logger.info("linear %d->%d %s: %s -> %s", key[0], key[1], str(w.dtype).removeprefix("torch."),
                        ", ".join(f"{n} {'/'.join(f'{s * 1e3:.3g}' for s in t)} ms" for n, t in times.items()),
                        choice.name)
        return self._choice[key]

    def report(self) -> list[str]:
        """One line per measured shape: each method's ms at PROBE_ROWS rows, and the choice."""
        rows = "/".join(map(str, PROBE_ROWS))
        return [f"{k} -> {n} {str(dt).removeprefix('torch.')}{' +bias' if b else ''} ({threads} threads): "
                + ", ".join(f"{name} {'/'.join(f'{s * 1e3:.3g}' for s in t)} ms" for name, t in times.items())
                + f" at {rows} rows -> {self._choice[(k, n, dt, b, threads)].name}"
                for (k, n, dt, b, threads), times in self.measured.items()]


def _time_method(method: LinearMethod, layer: LinearBase) -> list[float]:
    """Median seconds of ``method`` on a copy of ``layer`` at each of PROBE_ROWS rows."""
    with torch.device("meta"):
        probe = LinearBase(layer.in_features, layer.out_features, bias=layer.bias is not None)
    probe.weight = nn.Parameter(layer.weight.detach().clone(), requires_grad=False)
    if layer.bias is not None:
        probe.bias = nn.Parameter(layer.bias.detach().clone(), requires_grad=False)
    method.process_weights(probe)
    out = []
    for rows in PROBE_ROWS:
        x = torch.randn(rows, layer.in_features).to(layer.weight.dtype)
        method.apply(probe, x)  # warm-up: the first call sizes buffers and picks kernels
        times = []
        for _ in range(3):
            start = time.perf_counter()
            method.apply(probe, x)
            times.append(time.perf_counter() - start)
        out.append(statistics.median(times))
    return out


_CHOOSER: MeasuredChooser | None = None


def chooser() -> MethodChooser | None:
    """The process's measured chooser over ``F.linear`` and the packed kernel; None without the kernels."""
    global _CHOOSER
    ops = cpu_kernels()
    if ops is None:
        return None
    if _CHOOSER is None:
        _CHOOSER = MeasuredChooser([PackedLinear(ops), DENSE])
    return _CHOOSER


def default_chooser() -> MethodChooser:
    """The CPU's methods chosen by measurement when the C++ kernels are built, else ``F.linear``."""
    return chooser() or dense_chooser

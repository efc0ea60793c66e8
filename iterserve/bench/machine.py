"""Was the machine busy while a benchmark ran?

Wall-clock figures from a machine shared with other work can swing several-fold between runs while
step counts do not move, so every timed report says whether the machine looked busy. Two readings
are taken before and after the run: the 1-minute load average against the number of cores, and
the time of a fixed small matmul loop (a calibration probe) against the fastest probe seen. Either
one crossing its threshold marks the run as busy.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from iterserve.platforms.cpu import cpu_description

# load average above this many runnable tasks per core counts as busy
BUSY_LOAD_PER_CORE = 1.0
# a probe this many times slower than the fastest one of the run counts as busy
BUSY_PROBE_SLOWDOWN = 1.5


def calibration_probe(iterations: int = 20, size: int = 128, tries: int = 3) -> float:
    """Seconds for a fixed loop of small float32 matmuls on one thread: the same work on every call.

    The fastest of ``tries`` loops: a single loop of a few milliseconds jittered 1.6-fold on an idle
    machine (a timer tick, a page fault), enough to call it busy."""
    a = torch.ones(size, size)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = float("inf")
        for _ in range(tries):
            start = time.perf_counter()
            for _ in range(iterations):
                a = (a @ a) * (1.0 / size)
            best = min(best, time.perf_counter() - start)
        return best
    finally:
        torch.set_num_threads(threads)


def load_average() -> float | None:
    """The 1-minute load average, or None where the platform has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


@dataclass
class MachineCheck:
    """Probe times and load averages taken around a run, and the verdict drawn from them."""

    cpu_count: int
    probe_s: list[float] = field(default_factory=list)
    load_avg: list[float] = field(default_factory=list)

    @property
    def probe_slowdown(self) -> float:
        """The slowest probe over the fastest: 1.0 on a quiet machine."""
        return max(self.probe_s) / min(self.probe_s) if self.probe_s else 1.0

    @property
    def load_per_core(self) -> float | None:
        return max(self.load_avg) / self.cpu_count if self.load_avg else None

    @property
    def reasons(self) -> list[str]:
        """Why the machine counts as busy; empty when it does not."""
        out = []
        if (load := self.load_per_core) is not None and load > BUSY_LOAD_PER_CORE:
            out.append(f"load average {max(self.load_avg):.2f} on {self.cpu_count} cores")
        if self.probe_slowdown > BUSY_PROBE_SLOWDOWN:
            out.append(f"calibration probe {self.probe_slowdown:.1f}x slower at its slowest than its fastest")
        return out

    @property
    def busy(self) -> bool:
        return bool(self.reasons)

    def warning(self) -> str | None:
        """One line for reports, or None on a quiet machine."""
        if not self.busy:
            return None
        return ("warning: the machine was busy (" + "; ".join(self.reasons) + "): wall-clock figures are noisy, "
                "step counts are not")

    def to_dict(self) -> dict[str, object]:
        return {
            "cpu": cpu_description(),
            "busy": self.busy, "reasons": self.reasons, "cpu_count": self.cpu_count, "load_avg": self.load_avg,
            "probe_s": self.probe_s, "probe_slowdown": self.probe_slowdown,
        }


class MachineMonitor:
    """Takes a reading (probe time, load average) each time :meth:`sample` is called.

    ``probe`` and ``loadavg`` are injectable so the busy path can be tested on any machine.
    """

    def __init__(
        self,
        probe: Callable[[], float] = calibration_probe,
        loadavg: Callable[[], float | None] = load_average,
        cpu_count: int | None = None,
    ) -> None:
        self.probe = probe
        self.loadavg = loadavg
        self.check = MachineCheck(cpu_count or os.cpu_count() or 1)

    def sample(self) -> None:
        self.check.probe_s.append(self.probe())
        if (load := self.loadavg()) is not None:
            self.check.load_avg.append(load)


def machine_stamp(machine: dict[str, Any] | None = None) -> str:
    """What a timing figure must carry: the CPU, its cores, the load while it was measured (a
    :meth:`MachineCheck.to_dict`, as results hold it), the date."""
    machine = machine or {}
    text = f"{machine.get('cpu') or cpu_description()}, {machine.get('cpu_count') or os.cpu_count()} cores"
    if loads := machine.get("load_avg"):
        lo, hi = min(loads), max(loads)
        text += f"; load average {lo:.2f}" + (f"-{hi:.2f}" if hi - lo >= 0.005 else "") + " during the run"
    if machine.get("busy"):
        text += " (busy: " + "; ".join(machine["reasons"]) + ")"
    return f"{text}; torch {torch.__version__}, {datetime.date.today().isoformat()}"


def stamp_figure(fig: Any, stamp: str | None) -> None:
    """Write ``stamp`` along the figure's bottom edge (the caller leaves room for it)."""
    if stamp:
        fig.text(0.005, 0.005, stamp, fontsize=6.5, color="#555555", ha="left", va="bottom")

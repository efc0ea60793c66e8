"""Was the machine busy while a benchmark ran?

Wall-clock figures from a machine shared with other work can swing several-fold between runs while
step counts do not move, so every timed report says whether the machine looked busy. Two readings
are taken before and after the run: the 1-minute load average against the number of cores, and
the time of a fixed small matmul loop (a calibration probe) against the fastest probe seen. Either
one crossing its threshold marks the run as busy.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# load average above this many runnable tasks per core counts as busy
BUSY_LOAD_PER_CORE = 1.0
# a probe this many times slower than the fastest one of the run counts as busy
BUSY_PROBE_SLOWDOWN = 1.5


def calibration_probe(iterations: int = 20, size: int = 128) -> float:
    """Seconds for a fixed loop of small float32 matmuls on one thread: the same work on every call."""
    a = torch.ones(size, size)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = time.perf_counter()
        for _ in range(iterations):
            a = (a @ a) * (1.0 / size)
        return time.perf_counter() - start
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

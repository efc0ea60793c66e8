"""Was the machine busy while a benchmark ran?

Wall-clock figures from a machine shared with other work can swing several-fold between runs while
step counts do not move, so every timed report says whether the machine looked busy. Two readings
are taken before and after the run: the CPU time other processes used during a short idle window,
the time of a fixed small matmul loop (a calibration probe) against the fastest probe seen, and the
1-minute load average. The first two are read now; the load average trails the last minute, so a
quiet run just after a busy one would look busy by it: it only warns.

Timing figures (a knee, a roofline's ops:byte, a throughput-latency curve) drawn on a busy machine
teach the wrong lesson, so :func:`may_draw_timing_figure` refuses them unless the caller insists.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch

from iterserve.platforms.cpu import cpu_description

# load average above this many runnable tasks per core counts as busy
BUSY_LOAD_PER_CORE = 1.0
# a probe this many times slower than the fastest one of the run counts as busy
BUSY_PROBE_SLOWDOWN = 1.5
# other processes using more than this share of all cores while the benchmark idles counts as busy
BUSY_OTHERS_SHARE = 0.25
# the idle window in which the others' CPU time is read
OTHERS_WINDOW_S = 0.3


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


def others_cpu_share(window_s: float = OTHERS_WINDOW_S) -> float:
    """The share of all cores (0-1) that other processes kept busy while this one slept ``window_s``.

    This process's own CPU time (threads still spinning after a parallel region) is subtracted, so
    only work that competes with the benchmark counts."""
    me = psutil.Process()

    def busy_s() -> float:
        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0)

    def own_s() -> float:
        t = me.cpu_times()
        return t.user + t.system

    start, busy0, own0 = time.perf_counter(), busy_s(), own_s()
    time.sleep(window_s)
    wall = time.perf_counter() - start
    others = (busy_s() - busy0) - (own_s() - own0)
    return min(max(others / (wall * (psutil.cpu_count() or 1)), 0.0), 1.0)


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
    others_share: list[float] = field(default_factory=list)

    @property
    def probe_slowdown(self) -> float:
        """The slowest probe over the fastest: 1.0 on a quiet machine."""
        return max(self.probe_s) / min(self.probe_s) if self.probe_s else 1.0

    @property
    def load_per_core(self) -> float | None:
        return max(self.load_avg) / self.cpu_count if self.load_avg else None

    @property
    def refusals(self) -> list[str]:
        """What was measured busy while the run was on: enough to refuse a timing figure."""
        out = []
        if self.others_share and max(self.others_share) > BUSY_OTHERS_SHARE:
            out.append(f"other processes used {max(self.others_share):.0%} of the {self.cpu_count} cores")
        if self.probe_slowdown > BUSY_PROBE_SLOWDOWN:
            out.append(f"calibration probe {self.probe_slowdown:.1f}x slower at its slowest than its fastest")
        return out

    @property
    def reasons(self) -> list[str]:
        """Why the machine counts as busy; empty when it does not."""
        out = self.refusals
        if (load := self.load_per_core) is not None and load > BUSY_LOAD_PER_CORE:
            out.append(f"load average {max(self.load_avg):.2f} on {self.cpu_count} cores")
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
            "busy": self.busy, "reasons": self.reasons, "refusals": self.refusals, "cpu_count": self.cpu_count,
            "load_avg": self.load_avg, "others_share": self.others_share, "probe_s": self.probe_s,
            "probe_slowdown": self.probe_slowdown,
        }


class MachineMonitor:
    """Takes a reading (others' CPU share, probe time, load average) each time :meth:`sample` is called.

    ``probe``, ``loadavg`` and ``others`` are injectable so the busy path can be tested on any machine.
    """

    def __init__(
        self,
        probe: Callable[[], float] = calibration_probe,
        loadavg: Callable[[], float | None] = load_average,
        cpu_count: int | None = None,
        others: Callable[[], float] | None = None,
    ) -> None:
        self.probe = probe
        self.loadavg = loadavg
        self.others = others or others_cpu_share
        self.check = MachineCheck(cpu_count or os.cpu_count() or 1)

    def sample(self) -> None:
        self.check.others_share.append(self.others())
        self.check.probe_s.append(self.probe())
        if (load := self.loadavg()) is not None:
            self.check.load_avg.append(load)


def may_draw_timing_figure(machine: dict[str, Any], what: str, allow_busy: bool) -> bool:
    """Whether to draw a timing figure from a run with these readings (a :meth:`MachineCheck.to_dict`);
    says why not. ``allow_busy`` draws it anyway: its stamp then says the machine was busy."""
    refusals = machine.get("refusals") or []
    if not refusals or allow_busy:
        return True
    print(f"not drawing {what}: the machine was busy while it was measured ({'; '.join(refusals)}); its timings "
          "would teach the wrong shape. Rerun on a quiet machine, or pass --allow-busy to draw it anyway.")
    return False


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

"""Reading the knee off a measured curve: where a larger batch stops paying for itself.

Pure arithmetic on (batch, time) pairs, shared by the batch sweep, the serving charts and the
planner's validation against measured decode steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

DEFAULT_ELASTICITY = 0.5
# a larger batch's step may come out this much faster than a smaller one's before the sweep counts as noise
NOISE_TOLERANCE = 0.1
N = TypeVar("N", int, float)  # batch sizes, or any other load axis


def measured_knee(batches: Sequence[N], times: Sequence[float], elasticity: float = DEFAULT_ELASTICITY) -> N | None:
    """The first swept batch past the bend of a measured step-time curve.

    On a roofline, step time is flat in batch while memory-bound and proportional to batch
    once compute-bound, so the elasticity ``dlog t / dlog B`` jumps from ~0 to 1 at the knee.
    Returns the first batch ``B_i`` whose elasticity from ``B_{i-1}`` reaches ``elasticity``
    (None if no step of the sweep does).
    """
    pairs = sorted(zip(batches, times))
    for (b0, t0), (b1, t1) in zip(pairs, pairs[1:]):
        if b1 > b0 and t0 > 0 and t1 > 0 and math.log(t1 / t0) / math.log(b1 / b0) >= elasticity:
            return b1
    return None


def non_monotone_steps(batches: Sequence[N], times: Sequence[float], tolerance: float = NOISE_TOLERANCE) -> list[N]:
    """The batches whose step time fell more than ``tolerance`` below the previous (smaller) batch's."""
    pairs = sorted(zip(batches, times))
    return [b1 for (_, t0), (b1, t1) in zip(pairs, pairs[1:]) if t1 < t0 * (1 - tolerance)]


def read_knee(
    batches: Sequence[N], times: Sequence[float], elasticity: float = DEFAULT_ELASTICITY,
    tolerance: float = NOISE_TOLERANCE, axis: str = "B",
) -> tuple[N | None, str | None]:
    """``(knee, None)`` on a sweep whose step time grows with the load, ``(None, why)`` on one that
    does not: a knee read off noise would be a guess. ``axis`` names the load in the message."""
    falls = non_monotone_steps(batches, times, tolerance)
    if falls:
        where = ", ".join(f"{axis}={b:g}" for b in falls)
        return None, (
            f"not called: the step time fell as the load grew (at {where}), so the sweep measured "
            "other load on the machine; rerun it with more --repeats on a quieter machine"
        )
    return measured_knee(batches, times, elasticity), None

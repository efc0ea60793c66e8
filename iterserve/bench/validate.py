"""The planner checked against this machine: predicted vs measured decode step times over a batch sweep.

The measured side is the engine's own decode step (:class:`iterserve.bench.batch.StepTimer`) on the
model, or on a preset's architecture with random weights when the name is not a loadable model
(random weights time the same as trained ones); any ``measure(batch, context) -> seconds`` can stand in.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from iterserve.bench.batch import decode_step_timer, median_time
from iterserve.bench.knee import measured_knee
from iterserve.bench.microbench import measure_local
from iterserve.config import ModelConfig
from iterserve.config.dtypes import canonical_dtype
from iterserve.models.loader import load_model, load_model_config
from iterserve.models.sources import Preset, resolve_model
from iterserve.planner.hardware import Accelerator
from iterserve.planner.roofline import check_context, check_positive, decode_cost, decode_knee, model_label, roofline

DEFAULT_VALIDATION_BATCHES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_VALIDATION_CONTEXT = 256

DecodeTimer = Callable[[int, int], float]


@dataclass(frozen=True)
class ValidationRow:
    batch: int
    predicted_s: float
    measured_s: float
    relative_error: float  # (predicted - measured) / measured
    bound: str


@dataclass
class Validation:
    model: str
    dtype: str
    context: int
    hardware: Accelerator
    rows: list[ValidationRow]
    predicted_knee: int | None  # closed form at `context`
    predicted_knee_on_sweep: int | None  # measured_knee() applied to the predicted curve
    measured_knee: int | None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["hardware"] = self.hardware.to_dict()
        return d


def validate(
    model: str | os.PathLike[str] | ModelConfig,
    measure_decode_step: DecodeTimer,
    *,
    hardware: Accelerator | None = None,
    device: str | None = None,
    dtype: str = "fp32",
    kv_dtype: str | None = None,
    context: int = DEFAULT_VALIDATION_CONTEXT,
    batches: Sequence[int] = DEFAULT_VALIDATION_BATCHES,
    repeats: int = 3,
) -> Validation:
    """Predicted vs measured decode step time over a batch sweep at a fixed context.

    ``measure_decode_step(batch_size, context_len)`` returns the seconds of one decode step;
    each batch is timed once to warm up and then ``repeats`` times (median kept).
    ``hardware`` defaults to :func:`~iterserve.bench.microbench.measure_local` on ``device``.
    """
    cfg = load_model_config(model)
    dtype = canonical_dtype(dtype)
    check_context(cfg, context)
    check_positive(repeats, "repeats")
    batches = sorted({check_positive(b, "batch size") for b in batches})
    if not batches:
        raise ValueError("validation needs at least one batch size")
    hw = hardware if hardware is not None else measure_local(device)
    hw.peak_flops(dtype)  # fail early when the device has no figure for dtype
    rows = []
    for b in batches:
        measured = median_time(measure_decode_step, b, context, repeats)
        pred = roofline(decode_cost(cfg, b, context, dtype, kv_dtype), hw, dtype)
        rows.append(ValidationRow(b, pred.time_s, measured, (pred.time_s - measured) / measured, pred.bound))
    return Validation(
        model=model_label(cfg),
        dtype=dtype,
        context=context,
        hardware=hw,
        rows=rows,
        predicted_knee=decode_knee(cfg, hw, context, dtype, kv_dtype),
        predicted_knee_on_sweep=measured_knee([r.batch for r in rows], [r.predicted_s for r in rows]),
        measured_knee=measured_knee([r.batch for r in rows], [r.measured_s for r in rows]),
    )


def default_decode_timer(model_name: str, dtype: str, *, device: str = "cpu") -> DecodeTimer:
    """One real engine decode step of ``model_name``, or of its preset's shapes with random weights.

    Returns ``measure_decode_step(batch_size, context_len) -> seconds``
    (:func:`iterserve.bench.batch.decode_step_timer`).
    """
    source = resolve_model(model_name)
    name = f"random:{source.name}" if isinstance(source, Preset) else model_name
    return decode_step_timer(load_model(name, dtype, device))

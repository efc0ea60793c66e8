"""Capacity planner: how a model serves on an accelerator, from closed-form roofline arithmetic.

``roofline`` holds the arithmetic (no torch), ``hardware`` the accelerator datasheets (package data
in ``data/``); the model a plan is for is read by :func:`iterserve.models.loader.load_model_config`,
the one reading of a model name. Measuring this machine, and checking a plan
against measured decode steps, is benchmarking: :mod:`iterserve.bench.microbench` and
:mod:`iterserve.bench.validate`.
"""

from __future__ import annotations

import os
from typing import Any

from iterserve.config import ModelConfig, find_preset
from iterserve.models.loader import load_model_config
from iterserve.planner.hardware import ACCELERATORS, Accelerator, custom_accelerator, get_accelerator
from iterserve.planner.roofline import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CONTEXT,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    Cost,
    MemoryPlan,
    Plan,
    RooflinePoint,
    SweepPoint,
    attention_flops_per_token,
    build_plan,
    check_context,
    check_positive,
    decode_cost,
    decode_knee,
    default_batches,
    kv_bytes_per_token,
    kv_capacity,
    layer_matmul_parameters,
    matmul_parameters,
    prefill_cost,
    roofline,
    streamed_weight_bytes,
    weight_bytes,
)

__all__ = [
    "ACCELERATORS", "DEFAULT_BLOCK_SIZE", "DEFAULT_CONTEXT", "DEFAULT_GPU_MEMORY_UTILIZATION", "Accelerator",
    "Cost", "MemoryPlan",
    "Plan", "RooflinePoint", "SweepPoint", "attention_flops_per_token", "build_plan", "check_context",
    "check_positive", "custom_accelerator", "decode_cost", "decode_knee", "default_batches",
    "find_preset", "get_accelerator", "kv_bytes_per_token", "kv_capacity", "layer_matmul_parameters",
    "load_model_config", "matmul_parameters", "plan", "prefill_cost", "roofline", "streamed_weight_bytes",
    "weight_bytes",
]


def plan(model: str | os.PathLike[str] | ModelConfig, hardware: str | Accelerator, **options: Any) -> Plan:
    """:func:`~iterserve.planner.roofline.build_plan` for a model name or path and a GPU name.

    ``model`` is anything :func:`load_model_config` reads; ``hardware`` a table name or an
    :class:`Accelerator`; ``options`` are :func:`build_plan`'s keywords.
    """
    hw = get_accelerator(hardware) if isinstance(hardware, str) else hardware
    return build_plan(load_model_config(model), hw, **options)

"""Capacity planner: how a model serves on an accelerator, from closed-form roofline arithmetic.

``roofline`` holds the arithmetic (no torch), ``hardware`` the accelerator datasheets (package data
in ``data/``); the model a plan is for is read by :func:`iterserve.models.loader.load_model_config`,
the one reading of a model name; ``weights`` the bytes of each weight format (``--quantization``),
which :func:`quantization_for` resolves for a model. Measuring this machine, and checking a plan
against measured decode steps, is benchmarking: :mod:`iterserve.bench.microbench` and
:mod:`iterserve.bench.validate`.
"""

from __future__ import annotations

import os
from typing import Any

from iterserve.config import ModelConfig, find_preset
from iterserve.models.loader import load_model_config
from iterserve.models.sources import GGUFFile, resolve_model
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
from iterserve.planner.weights import QUANTIZATION_CHOICES, Quantization, as_quantization, gguf_quantization

__all__ = [
    "ACCELERATORS", "DEFAULT_BLOCK_SIZE", "DEFAULT_CONTEXT", "DEFAULT_GPU_MEMORY_UTILIZATION", "QUANTIZATION_CHOICES",
    "Accelerator", "Cost", "MemoryPlan", "Plan", "Quantization", "RooflinePoint", "SweepPoint",
    "attention_flops_per_token", "build_plan", "check_context", "check_positive", "custom_accelerator", "decode_cost",
    "decode_knee", "default_batches", "find_preset", "get_accelerator", "kv_bytes_per_token", "kv_capacity",
    "layer_matmul_parameters", "load_model_config", "matmul_parameters", "plan", "prefill_cost", "quantization_for",
    "roofline", "streamed_weight_bytes", "weight_bytes",
]


def plan(model: str | os.PathLike[str] | ModelConfig, hardware: str | Accelerator, **options: Any) -> Plan:
    """:func:`~iterserve.planner.roofline.build_plan` for a model name or path and a GPU name.

    ``model`` is anything :func:`load_model_config` reads; ``hardware`` a table name or an
    :class:`Accelerator`; ``options`` are :func:`build_plan`'s keywords (a ``quantization`` named by its
    flag's value is resolved by :func:`quantization_for`: ``gguf`` reads a GGUF model's own mix).
    """
    hw = get_accelerator(hardware) if isinstance(hardware, str) else hardware
    if not isinstance(options.get("quantization"), (Quantization, type(None))):
        options["quantization"] = quantization_for(model, options["quantization"])
    return build_plan(load_model_config(model), hw, **options)


def quantization_for(model: str | os.PathLike[str] | ModelConfig, quantization: str | None) -> Quantization:
    """The weights' formats for ``--quantization`` on ``model``: ``gguf`` is the file's own mix of tensor
    types where the model is a GGUF file (an embedded one included), else a labelled approximation."""
    if quantization is None or quantization.lower() != "gguf" or isinstance(model, ModelConfig):
        return as_quantization(quantization)
    source = resolve_model(os.fspath(model))
    if not isinstance(source, GGUFFile):
        return as_quantization(quantization)
    return gguf_quantization((t.name, t.tensor_type.name, int(t.n_elements)) for t in source.reader.tensors)

"""The simulator's one door into the planner: the model and accelerator numbers a cost model needs.

Everything the simulator takes from :mod:`iterserve.planner` passes
through :func:`planner_terms`, so the rest of the package depends on plain numbers only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from iterserve.config import ModelConfig

if TYPE_CHECKING:
    from iterserve.planner.weights import Quantization


@dataclass(frozen=True)
class PlannerTerms:
    """Per-step constants of a model (and, for the roofline, of an accelerator)."""

    model_name: str
    vocab_size: int
    max_position_embeddings: int
    kv_bytes_per_token: int  # at the simulated dtype
    layer_matmul_params: int  # linear layers of all decoder layers
    lm_head_params: int  # V x h, run once per sampled token
    streamed_weight_bytes: int  # matmul weights every forward step reads (all but experts), in the weights' formats
    attention_flops_per_pair: int  # FLOPs of one query attending one key over all layers: 4 L H d
    weight_bytes: int  # every parameter, for the KV pool left beside the weights
    accelerator: str | None = None
    peak_flops: float | None = None
    bandwidth: float | None = None
    memory_bytes: int | None = None
    kv_pool_bytes: int | None = None  # memory x utilization - weights, on the accelerator
    quantization: str = "none"  # the weights' formats (a planner Quantization's label)
    expert_weight_bytes: int = 0  # a MoE model's experts, all of them, of which a step reads a share
    num_experts: int = 0
    experts_per_token: int = 0

    def weight_bytes_read(self, tokens: int) -> float:
        """Matmul weight bytes a step of ``tokens`` tokens reads: of a MoE model's experts the expected share
        those tokens run (:func:`iterserve.planner.weights.expert_share`)."""
        if not self.expert_weight_bytes:
            return self.streamed_weight_bytes
        from iterserve.planner.weights import expert_share

        share = expert_share(self.num_experts, self.experts_per_token, tokens)
        return self.streamed_weight_bytes + self.expert_weight_bytes * share


def planner_terms(
    model: str | ModelConfig, dtype: str = "bf16", *, gpu: str | None = None, flops: str | None = None,
    bandwidth: str | None = None, memory: str | None = None, gpu_memory_utilization: float = 0.9,
    quantization: Quantization | str | None = None, kv_dtype: str | None = None,
) -> PlannerTerms:
    """Terms for ``model`` (a preset, config.json, folder or .gguf, or its config already read) and
    optionally an accelerator: a named one (``gpu``) with any of ``flops``/``bandwidth``/``memory``
    replaced, or, without a name, ``flops`` and ``bandwidth`` given. Quantities are read as
    ``iterserve plan`` reads them ("312" is TFLOP/s, "2039" GB/s, "40" GiB, or with a unit); ``quantization``
    the weights' formats, as :func:`iterserve.planner.quantization_for` resolves them; ``kv_dtype`` the KV
    cache's, by default ``dtype``."""
    from iterserve.config.units import parse_bandwidth, parse_flops, parse_size
    from iterserve.models.loader import load_model_config
    from iterserve.planner import quantization_for
    from iterserve.planner.hardware import GiB, custom_accelerator, get_accelerator
    from iterserve.planner.roofline import (
        attention_flops_per_token,
        kv_bytes_per_token,
        layer_matmul_parameters,
        matmul_parameters,
        streamed_weight_bytes,
        weight_bytes,
    )

    cfg = load_model_config(model)
    q = quantization if quantization is None or not isinstance(quantization, str) else quantization_for(
        model, quantization)
    layer = layer_matmul_parameters(cfg)
    terms: dict[str, Any] = {
        "model_name": cfg.name or str(model), "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "kv_bytes_per_token": kv_bytes_per_token(cfg, kv_dtype or dtype), "layer_matmul_params": layer,
        "lm_head_params": matmul_parameters(cfg) - layer,
        "streamed_weight_bytes": streamed_weight_bytes(cfg, dtype, q, 0),  # tokens=0: no expert
        "expert_weight_bytes": streamed_weight_bytes(cfg, dtype, q) - streamed_weight_bytes(cfg, dtype, q, 0),
        "num_experts": cfg.num_experts, "experts_per_token": cfg.num_experts_per_tok,
        "attention_flops_per_pair": attention_flops_per_token(cfg, 1),
        "weight_bytes": weight_bytes(cfg, dtype, q), "quantization": "none" if q is None else q.label,
    }
    if gpu is None and flops is None and bandwidth is None and memory is None:
        return PlannerTerms(**terms)
    f = parse_flops(flops) if flops is not None else None
    bw = parse_bandwidth(bandwidth) if bandwidth is not None else None
    mem = parse_size(memory) if memory is not None else None
    if gpu is not None:
        hw = get_accelerator(gpu).with_overrides(flops=f, dtype=dtype, bandwidth=bw, memory_bytes=mem)
    elif f is None or bw is None:
        raise ValueError("a roofline without --gpu needs both --flops and --bandwidth")
    else:
        hw = custom_accelerator(flops=f, bandwidth=bw, memory_bytes=mem or 80 * GiB, dtype=dtype)
    usable = int(hw.memory_bytes * gpu_memory_utilization)
    return PlannerTerms(
        **terms, accelerator=hw.name, peak_flops=hw.peak_flops(dtype), bandwidth=hw.bandwidth,
        memory_bytes=hw.memory_bytes, kv_pool_bytes=usable - terms["weight_bytes"],
    )

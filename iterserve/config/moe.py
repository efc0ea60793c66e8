"""Mixture-of-experts shapes (Mixtral, Qwen3-MoE): parsing them from a Hugging Face config and counting the
parameters a model holds against those one token reads.

A MoE layer replaces the dense MLP by ``num_experts`` small MLPs and a router that sends each token to
``num_experts_per_tok`` of them; a model with ``num_experts == 0`` is dense and nothing here changes it.
"""

from __future__ import annotations

from typing import Any, Protocol

MOE_ARCHITECTURES = ("mixtral", "qwen3_moe")


class ModelConfig(Protocol):
    """The fields of :class:`iterserve.config.model.ModelConfig` read here (which imports this module)."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: list[int]

    @property
    def expert_intermediate_size(self) -> int: ...


def moe_fields_from_hf(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """The MoE fields of a ``config.json`` (none for a dense architecture).

    Qwen3-MoE names the expert count ``num_experts`` on the Hub, and transformers 5 writes
    ``num_local_experts`` (Mixtral's name); both are read.
    """
    if arch not in MOE_ARCHITECTURES:
        return {}
    experts = int(cfg.get("num_experts", cfg.get("num_local_experts")) or 0)
    fields: dict[str, Any] = {"num_experts": experts, "num_experts_per_tok": int(cfg.get("num_experts_per_tok", 2))}
    if arch == "qwen3_moe":
        fields.update(moe_intermediate_size=int(cfg.get("moe_intermediate_size", cfg["intermediate_size"])),
                      norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                      decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1)),
                      mlp_only_layers=list(cfg.get("mlp_only_layers") or []))
    return fields


def moe_hf_fields(config: ModelConfig) -> dict[str, Any]:
    """The MoE entries of the equivalent Hugging Face config (none for a dense model)."""
    if config.architecture == "mixtral":
        return {"num_local_experts": config.num_experts, "num_experts_per_tok": config.num_experts_per_tok,
                "router_jitter_noise": 0.0}
    if config.architecture == "qwen3_moe":
        return {"num_experts": config.num_experts, "num_experts_per_tok": config.num_experts_per_tok,
                "moe_intermediate_size": config.expert_intermediate_size, "norm_topk_prob": config.norm_topk_prob,
                "decoder_sparse_step": config.decoder_sparse_step, "mlp_only_layers": list(config.mlp_only_layers)}
    return {}


def check_moe(config: ModelConfig) -> None:
    """A clear error for MoE fields that cannot run (top-k over more experts than there are)."""
    if config.num_experts and not 0 < config.num_experts_per_tok <= config.num_experts:
        raise ValueError(f"num_experts_per_tok ({config.num_experts_per_tok}) must be between 1 and "
                         f"num_experts ({config.num_experts})")
    if config.decoder_sparse_step < 1:
        raise ValueError(f"decoder_sparse_step must be >= 1, got {config.decoder_sparse_step}")


def is_moe_layer(config: ModelConfig, layer: int) -> bool:
    """Whether decoder layer ``layer`` is sparse: the rule of transformers' Qwen3-MoE (Mixtral: every layer)."""
    return (config.num_experts > 0 and layer not in config.mlp_only_layers
            and (layer + 1) % config.decoder_sparse_step == 0)


def mlp_parameters(config: ModelConfig, active: bool = False) -> int:
    """The MLP weights of all layers: dense gate/up/down, or a MoE layer's router and experts (every
    expert, or with ``active`` the ``num_experts_per_tok`` one token runs)."""
    h = config.hidden_size
    dense = 3 * h * config.intermediate_size
    experts = config.num_experts_per_tok if active else config.num_experts
    sparse = config.num_experts * h + experts * 3 * h * config.expert_intermediate_size
    return sum(sparse if is_moe_layer(config, n) else dense for n in range(config.num_layers))

"""Hugging Face configs of the architectures that differ from the Llama layout: Phi-3 and Gemma 3 (text).

:meth:`ModelConfig.from_hf_config <iterserve.config.model.ModelConfig.from_hf_config>` reads the fields every
architecture shares; :func:`text_config` first fills what a Gemma 3 folder leaves to transformers' defaults, and
:func:`arch_fields` then gives what only these architectures have: Phi-3's "longrope" scaling and partial rotary,
Gemma 3's local and global layers, its attention scale and its logit soft-capping. Fields without a ModelConfig
slot go into its ``extra`` dict (read by :mod:`iterserve.models.phi3` and :mod:`iterserve.models.gemma3`).
"""

from __future__ import annotations

from typing import Any

HF_ARCH_NAMES = {
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForConditionalGeneration": "gemma3",  # its text decoder; the vision tower is not loaded
    "Gemma3ForCausalLM": "gemma3",
}
MODEL_TYPES = {"phi3": "phi3", "gemma3_text": "gemma3", "gemma3": "gemma3"}

# transformers' Gemma3TextConfig defaults: hub folders (the multimodal ones above all) leave most fields out.
_GEMMA3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "tie_word_embeddings": True,
    "hidden_activation": "gelu_pytorch_tanh", "bos_token_id": 2, "eos_token_id": 1,
}


def _is_gemma3(cfg: dict[str, Any]) -> bool:
    return cfg.get("model_type") in ("gemma3", "gemma3_text") or any(
        str(a).startswith("Gemma3") for a in cfg.get("architectures") or [])


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config: a Gemma 3 folder's ``text_config`` (multimodal) or itself, over transformers'
    defaults; any other config unchanged."""
    if not _is_gemma3(cfg):
        return cfg
    text = cfg.get("text_config") or cfg
    merged = {**_GEMMA3_DEFAULTS, **{k: v for k, v in text.items() if v is not None}}
    for key in ("architectures", "bos_token_id", "eos_token_id", "_name_or_path"):  # the outer config's win
        if cfg.get(key) is not None:
            merged[key] = cfg[key]
    return merged


def arch_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields that only architecture ``arch`` reads from ``cfg`` (none for the Llama family)."""
    if arch == "phi3":
        return _phi3(cfg)
    if arch == "gemma3":
        return _gemma3(cfg)
    return {}


def _phi3(cfg: dict[str, Any]) -> dict[str, Any]:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    partial = float(params.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0)
    kind = params.get("rope_type", params.get("type", "default"))
    scaling = None
    if kind in ("longrope", "su", "yarn"):  # transformers reads Phi-3's older names as longrope
        original = params.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
        if not original:
            raise ValueError("Phi-3 longrope scaling needs original_max_position_embeddings")
        scaling = {"rope_type": "longrope", "short_factor": list(params["short_factor"]),
                   "long_factor": list(params["long_factor"]), "original_max_position_embeddings": int(original),
                   "factor": params.get("factor"), "attention_factor": params.get("attention_factor")}
    elif kind != "default":
        raise ValueError(f"unsupported rope scaling {kind!r} for Phi-3; iterserve runs 'default' and 'longrope'")
    return {"rope_scaling": scaling, "extra": {"partial_rotary_factor": partial}}


def _gemma3(cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError("Gemma 3 attention logit soft-capping (attn_logit_softcapping) is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 bidirectional attention (use_bidirectional_attention) is not supported")
    if cfg.get("hidden_activation") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"unsupported Gemma 3 activation {cfg.get('hidden_activation')!r}; "
                         "iterserve runs gelu_pytorch_tanh")
    params = cfg.get("rope_parameters") or {}
    full = dict(params.get("full_attention") or {"rope_theta": cfg["rope_theta"], **(cfg.get("rope_scaling") or {})})
    local = params.get("sliding_attention") or {"rope_theta": cfg["rope_local_base_freq"]}
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"unsupported rope scaling {local['rope_type']!r} on Gemma 3's sliding-window layers")
    theta = float(full.pop("rope_theta", cfg["rope_theta"]))
    scaling = full if full.get("rope_type", full.get("type", "default")) != "default" else None
    pattern, num_layers = int(cfg["sliding_window_pattern"]), int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                       for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"Gemma 3 layer_types must name {num_layers} layers, each 'sliding_attention' "
                         f"or 'full_attention'; got {types!r}")
    extra = {"layer_types": list(types), "query_pre_attn_scalar": float(cfg["query_pre_attn_scalar"]),
             "rope_local_base_freq": float(local.get("rope_theta", cfg["rope_local_base_freq"])),
             "final_logit_softcapping": cfg.get("final_logit_softcapping")}
    return {"rope_theta": theta, "rope_scaling": scaling, "qk_norm": True, "attention_bias": False,
            "sliding_window": cfg.get("sliding_window"), "extra": extra}


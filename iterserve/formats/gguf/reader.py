"""The one place a GGUF file is opened (the loader, the tokenizer, the planner and the LoRA adapters all read
through here), and its metadata read as a model's config."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import gguf
import numpy as np

from iterserve.config import ModelConfig

REQUIRED = object()  # the default of a metadata key a model cannot do without

_GGUF_ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3",
               "gemma3": "gemma3", "phi3": "phi3"}


def open_gguf(path: str | os.PathLike[str]) -> gguf.GGUFReader:
    """A memory-mapped reader (tensor data stays unread until used).

    A missing file raises :class:`OSError` as usual; gguf's assorted parse errors on a damaged file
    (ValueError, numpy reshape or struct errors) become one ValueError that names the file.
    """
    try:
        return gguf.GGUFReader(path)
    except OSError:
        raise
    except Exception as exc:
        raise ValueError(f"cannot read GGUF file {os.fspath(path)!r}: it is corrupt or truncated ({exc})") from None


def gguf_field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """The value of one metadata key, or ``default`` when the file lacks it."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def interleaves_rope(reader: gguf.GGUFReader) -> bool:
    """Whether llama.cpp interleaved the rotary halves of Q and K's rows (it does for llama and mistral)."""
    return gguf_field(reader, "general.architecture") in ("llama", "mistral")


def gguf_config(reader: gguf.GGUFReader, name: str = "") -> ModelConfig:
    """A ModelConfig from GGUF metadata (llama, qwen2, qwen3, gemma3 and phi3 architectures)."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ValueError(
            f"unsupported architecture {arch!r} in GGUF file; iterserve runs {', '.join(sorted(_GGUF_ARCHS))}"
        )
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError("GGUF files with per-frequency RoPE factors (rope_freqs.weight) are not supported yet")

    def g(key: str, default: Any = None) -> Any:
        value = gguf_field(reader, f"{arch}.{key}", default)
        if value is REQUIRED:
            raise ValueError(f"{name or 'GGUF file'}: its metadata lacks {arch}.{key}, which a {arch} model needs")
        return value

    vocab = g("vocab_size") or len(gguf_field(reader, "tokenizer.ggml.tokens") or ())
    if not vocab:
        raise ValueError(f"{name or 'GGUF file'}: its metadata has neither {arch}.vocab_size nor a vocabulary")
    heads = int(g("attention.head_count", REQUIRED))
    shape = {  # what every architecture's metadata says, under config.json's names
        "vocab_size": int(vocab), "hidden_size": int(g("embedding_length", REQUIRED)),
        "intermediate_size": int(g("feed_forward_length", REQUIRED)),
        "num_hidden_layers": int(g("block_count", REQUIRED)), "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv", heads)),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "bos_token_id": gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": gguf_field(reader, "tokenizer.ggml.eos_token_id"),
    }
    rope_scaling = None
    if g("rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": g("rope.scaling.factor", REQUIRED)}
    elif g("rope.scaling.type") not in (None, "none"):
        raise ValueError(f"unsupported RoPE scaling {g('rope.scaling.type')!r} in GGUF file")
    if arch in ("gemma3", "phi3"):
        hf = gemma3_hf_config(g, shape, rope_scaling) if arch == "gemma3" else phi3_hf_config(reader, g, shape)
        return ModelConfig.from_hf_config(hf, name or gguf_field(reader, "general.name", ""))
    hidden = shape["hidden_size"]
    return gguf_moe_config(ModelConfig(
        architecture=_GGUF_ARCHS[arch],
        vocab_size=shape["vocab_size"],
        hidden_size=hidden,
        intermediate_size=shape["intermediate_size"],
        num_layers=shape["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=shape["num_key_value_heads"],
        head_dim=int(g("attention.key_length", hidden // heads)),
        max_position_embeddings=int(g("context_length", 2048)),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings=shape["tie_word_embeddings"],
        attention_bias=_GGUF_ARCHS[arch] == "qwen2",
        qk_norm=_GGUF_ARCHS[arch] == "qwen3",
        bos_token_id=shape["bos_token_id"],
        eos_token_id=shape["eos_token_id"],
        name=name or gguf_field(reader, "general.name", ""),
    ), g)


def gemma3_hf_config(g: Callable[..., Any], shape: dict[str, Any],
                     rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """Gemma 3's ``config.json`` rebuilt from what llama.cpp writes (its ``Gemma3Model`` conversion) and assumes
    (``llama_model_gemma3``): five local layers to one global unless ``attention.sliding_window_pattern`` says
    otherwise (a period or one flag a layer), the local RoPE base 10,000 unless ``rope.freq_base_swa``, and
    attention scaled by ``head_dim`` except in the 62-layer 27B model (``hidden / heads``). ``shape``: the keys
    every architecture has (:func:`gguf_config`)."""
    layers, hidden, heads = shape["num_hidden_layers"], shape["hidden_size"], shape["num_attention_heads"]
    head_dim, window = int(g("attention.key_length", 256)), g("attention.sliding_window")
    pattern = g("attention.sliding_window_pattern", 6)
    if window is None:
        types = ["full_attention"] * layers
    elif isinstance(pattern, list):
        types = ["sliding_attention" if local else "full_attention" for local in pattern]
    else:
        types = ["sliding_attention" if i % int(pattern) < int(pattern) - 1 else "full_attention"
                 for i in range(layers)]
    return {
        **shape, "architectures": ["Gemma3ForCausalLM"], "head_dim": head_dim,
        "max_position_embeddings": int(g("context_length", 131072)),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(g("rope.freq_base", 1_000_000.0)), "rope_scaling": rope_scaling,
        "rope_local_base_freq": float(g("rope.freq_base_swa", 10_000.0)), "sliding_window": window,
        "layer_types": types, "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
        "final_logit_softcapping": g("final_logit_softcapping"),
    }


def phi3_hf_config(reader: gguf.GGUFReader, g: Callable[..., Any], shape: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's ``config.json`` rebuilt from what llama.cpp writes (its ``Phi3MiniModel`` conversion): longrope's
    factors as the ``rope_factors_long``/``rope_factors_short`` tensors, the rotated share of a head as
    ``rope.dimension_count``, no window written as 0 (Phi-4). ``shape`` as for :func:`gemma3_hf_config`."""
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    factors = {t.name: [float(x) for x in np.asarray(t.data, dtype=np.float32)] for t in reader.tensors
               if t.name in ("rope_factors_long.weight", "rope_factors_short.weight")}
    context = int(g("context_length", 4096))
    original = int(g("rope.scaling.original_context_length", context))
    rope_scaling = None
    if factors:
        rope_scaling = {"rope_type": "longrope", "long_factor": factors["rope_factors_long.weight"],
                        "short_factor": factors["rope_factors_short.weight"],
                        "original_max_position_embeddings": original,
                        "attention_factor": g("rope.scaling.attn_factor")}
    return {
        **shape, "architectures": ["Phi3ForCausalLM"], "max_position_embeddings": context,
        "original_max_position_embeddings": original,
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(g("rope.freq_base", 10000.0)), "rope_scaling": rope_scaling,
        "partial_rotary_factor": int(g("rope.dimension_count", head_dim)) / head_dim,
        "sliding_window": g("attention.sliding_window") or None,
    }


def gguf_moe_config(config: ModelConfig, field: Callable[..., Any]) -> ModelConfig:
    """``config`` (read from a GGUF's metadata) with its experts: ``<arch>.expert_count``,
    ``expert_used_count`` and ``expert_feed_forward_length`` (``field`` reads ``<arch>.<key>``).

    llama.cpp writes Mixtral as a ``llama`` with experts, and Qwen3-MoE as ``qwen3moe`` (read as qwen3);
    it renormalises Mixtral's top-k weights always, Qwen3-MoE's unless ``expert_weights_norm`` is false.
    """
    experts = int(field("expert_count", 0) or 0)
    if not experts:
        return config
    arch = {"llama": "mixtral", "mistral": "mixtral", "qwen3": "qwen3_moe"}.get(config.architecture)
    if arch is None:
        raise ValueError(f"GGUF {config.architecture} models with experts are not supported; iterserve runs "
                         "Mixtral (llama with experts) and qwen3moe")
    return config.replace(
        architecture=arch, num_experts=experts, num_experts_per_tok=int(field("expert_used_count", 2)),
        moe_intermediate_size=int(field("expert_feed_forward_length", 0) or 0),
        norm_topk_prob=arch == "mixtral" or bool(field("expert_weights_norm", True)))

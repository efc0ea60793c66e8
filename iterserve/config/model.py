"""The model's architecture: ``ModelConfig`` for a Llama-family decoder, and the presets.

A ``ModelConfig`` comes from a Hugging Face ``config.json`` (parsed here), from GGUF metadata (parsed where
GGUF files are read, :mod:`iterserve.models.loader`), or from a preset: the real shapes of well-known
models, used with random weights and by the capacity planner.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from iterserve.config import arch_configs
from iterserve.config.moe import (
    MOE_ARCHITECTURES,
    check_moe,
    is_moe_layer,
    mlp_parameters,
    moe_fields_from_hf,
    moe_hf_fields,
)

# The embedded model every command and ``LLM()`` runs when given none (resolved by models/sources.py).
DEFAULT_MODEL = "smollm2-135m"

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", *MOE_ARCHITECTURES,
                           *sorted(set(arch_configs.MODEL_TYPES.values())))

_MODEL_TYPES = (*SUPPORTED_ARCHITECTURES, *arch_configs.MODEL_TYPES)

_HF_ARCH_NAMES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    **arch_configs.HF_ARCH_NAMES,
}


@dataclass
class ModelConfig:
    """Shapes and hyper-parameters of a Llama-family decoder."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 puts a bias on q, k and v
    qk_norm: bool = False  # Qwen3 RMS-normalises q and k per head
    sliding_window: int | None = None  # Mistral v0.1 attends to the last N positions only (Gemma 3: some layers)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict, repr=False)
    # Mixture of experts (iterserve.config.moe); 0 experts is a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # an expert's MLP width; 0: intermediate_size (Mixtral)
    norm_topk_prob: bool = True  # the top-k routing weights renormalised to sum to 1 (Mixtral always)
    decoder_sparse_step: int = 1  # every n-th layer is sparse (Qwen3-MoE)
    mlp_only_layers: list[int] = field(default_factory=list)  # layers that keep a dense MLP (Qwen3-MoE)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; iterserve runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        check_moe(self)

    # -- sizes used by the engine and the planner ------------------------------------------------

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V for one token across all layers: layers x 2 x kv_heads x head_dim x bytes."""
        return self.num_layers * 2 * self.kv_size * dtype_bytes

    def num_parameters(self) -> int:
        """Exact parameter count of the decoder (embeddings counted once when tied)."""
        return self._parameters(active=False)

    def active_parameters(self) -> int:
        """Parameters one token runs through: of a MoE layer's experts only ``num_experts_per_tok``."""
        return self._parameters(active=True)

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    def is_moe_layer(self, layer: int) -> bool:
        return is_moe_layer(self, layer)

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window (None: it attends to the whole context); Gemma 3 names each layer's kind."""
        types = self.extra.get("layer_types")
        if types is None:
            return [self.sliding_window] * self.num_layers
        return [self.sliding_window if t == "sliding_attention" else None for t in types]

    def _parameters(self, active: bool) -> int:
        h = self.hidden_size
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        per_layer = attn + (4 if self.architecture == "gemma3" else 2) * h  # RMSNorm weights
        embed = self.vocab_size * h
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * per_layer + mlp_parameters(self, active) + embed + lm_head + h  # final norm

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def tensor_parallel_shard(self, tp: int) -> ModelConfig:
        """The shapes one of ``tp`` tensor-parallel ranks holds (the Megatron split): a ``tp``-th of the
        heads, the MLP width and the vocabulary (rounded up; the last rank's rows are padding), and
        ``max(1, kv_heads / tp)`` KV heads, replicated when there are fewer KV heads than ranks.

        The engine sizes a rank's layers and KV cache from it, the planner a device's memory and work.
        Raises ValueError when the model does not split ``tp`` ways.
        """
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        if tp == 1:
            return self
        label = self.name or self.architecture
        if self.num_experts:
            raise ValueError(f"{label} is a mixture-of-experts model, which iterserve runs on one device only "
                             f"(tensor_parallel_size=1), not {tp}")
        if self.num_heads % tp:
            raise ValueError(f"{label} has {self.num_heads} attention heads, which do not split over "
                             f"tensor_parallel_size={tp}")
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            raise ValueError(f"{label} has {self.num_kv_heads} KV heads: tensor_parallel_size={tp} must divide "
                             "them or be a multiple of them")
        if self.intermediate_size % tp:
            raise ValueError(f"{label}'s MLP width {self.intermediate_size} does not split over "
                             f"tensor_parallel_size={tp}")
        return self.replace(num_heads=self.num_heads // tp, num_kv_heads=max(1, self.num_kv_heads // tp),
                            intermediate_size=self.intermediate_size // tp, vocab_size=-(-self.vocab_size // tp))

    # -- constructors ---------------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "") -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dictionary."""
        cfg = arch_configs.text_config(cfg)
        archs = cfg.get("architectures") or []
        arch = next((_HF_ARCH_NAMES[a] for a in archs if a in _HF_ARCH_NAMES), None)
        if arch is None:
            model_type = cfg.get("model_type")
            arch = arch_configs.MODEL_TYPES.get(model_type, model_type) if model_type in _MODEL_TYPES else None
        if arch is None:
            found = ", ".join(archs) or cfg.get("model_type") or "none"
            raise ValueError(
                f"unsupported architecture {found!r}; iterserve runs "
                f"{', '.join(sorted(_HF_ARCH_NAMES))}"
            )
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        rope_params = cfg.get("rope_parameters")  # newer transformers nest theta and scaling here
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) in (
            None,
            "default",
        ):
            rope_scaling = None
        config = cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            name=name or cfg.get("_name_or_path", ""),
            **moe_fields_from_hf(cfg, arch),
        )
        return config.replace(**arch_configs.arch_fields(arch, cfg))

    def to_hf_config(self) -> dict[str, Any]:
        """The equivalent Hugging Face config dictionary (used to build reference models)."""
        arch_class = {v: k for k, v in _HF_ARCH_NAMES.items()}[self.architecture]
        cfg: dict[str, Any] = {
            "architectures": [arch_class],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            **moe_hf_fields(self),
        }
        if self.architecture in ("mistral", "qwen2", "qwen3", *MOE_ARCHITECTURES):
            cfg["sliding_window"] = self.sliding_window
            cfg["use_sliding_window"] = self.sliding_window is not None
        return cfg


def _load_presets() -> dict[str, ModelConfig]:
    data = json.loads(resources.files("iterserve").joinpath("data/model_presets.json").read_text("utf-8"))
    return {key: ModelConfig(**{k: v for k, v in entry.items() if k != "source"})
            for key, entry in data["presets"].items()}


# Real shapes of well-known checkpoints, package data with each entry's source (its config.json).
PRESETS: dict[str, ModelConfig] = _load_presets()


_NAME_SUFFIXES = ("-hf", "-instruct", "-chat", "-base", "-it", "-v0.1")


def _norm_model_name(name: str) -> str:
    key = name.strip().lower().rsplit("/", 1)[-1].replace("_", "-").replace(" ", "-")
    changed = True
    while changed:
        changed = False
        for suffix in _NAME_SUFFIXES:
            if key.endswith(suffix):
                key, changed = key[: -len(suffix)], True
    key = key.removeprefix("meta-")
    return re.sub(r"[^a-z0-9.]", "", key)


def find_preset(name: str) -> str | None:
    """The preset key for a preset name or a common spelling of it, or None.

    ``"Llama-2-7B"``, ``"meta-llama/Llama-2-7b-hf"``, ``"llama2-7b"`` and
    ``"Meta-Llama-3-8B-Instruct"`` all resolve; matching ignores case, an ``org/`` prefix, a
    ``meta-`` prefix, ``-hf``/``-instruct``/``-chat`` suffixes and punctuation.
    """
    if name.lower() in PRESETS:
        return name.lower()
    target = _norm_model_name(name)
    for key, cfg in PRESETS.items():
        if target in (_norm_model_name(key), _norm_model_name(cfg.name)):
            return key
    return None


def get_preset(name: str) -> ModelConfig:
    """A copy of the preset ``name`` (any spelling :func:`find_preset` takes)."""
    key = find_preset(name)
    if key is None:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}")
    return PRESETS[key].replace()

"""Which model class runs an architecture, and which parameter each Hugging Face checkpoint tensor fills.

Llama, Mistral and Qwen2/3 share :class:`~iterserve.models.llama.LlamaModel`; Phi-3 and Gemma 3 have their own
modules. All of them name their parameters as transformers does, except that q/k/v and gate/up are fused: a
separate ``q_proj`` fills part 0 of ``qkv_proj``, and a checkpoint's already fused ``qkv_proj`` (Phi-3) fills it
whole (the fused layer splits it into its parts before a rank takes its rows).
"""

from __future__ import annotations

from iterserve.config import ModelConfig
from iterserve.models.gemma3 import Gemma3Model
from iterserve.models.llama import LlamaModel
from iterserve.models.phi3 import Phi3Model

_MODEL_CLASSES: dict[str, type[LlamaModel]] = {"phi3": Phi3Model, "gemma3": Gemma3Model}

_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

# Gemma3ForConditionalGeneration: the language model under one of these (older and newer transformers) ...
_LANGUAGE_MODEL = ("language_model.model.", "model.language_model.", "language_model.")
# ... beside the vision tower and its projector, which are not loaded.
_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def model_class(config: ModelConfig) -> type[LlamaModel]:
    return _MODEL_CLASSES.get(config.architecture, LlamaModel)


def parts_of(param: str) -> int:
    """How many checkpoint tensors fill ``param`` when they come one per part."""
    return 3 if "qkv_proj" in param else 2 if "gate_up_proj" in param else 1


def hf_param_name(config: ModelConfig, hf_name: str) -> tuple[str, int | None] | None:
    """The parameter a checkpoint tensor fills and the part of it (None: the whole), or None for a tensor that is
    not loaded (a tied LM head, rotary buffers, a vision tower)."""
    if hf_name.startswith(_VISION):
        return None
    for prefix in _LANGUAGE_MODEL:
        if hf_name.startswith(prefix):
            hf_name = hf_name[len(prefix):]
            break
    name = hf_name.removeprefix("model.")
    if (name == "lm_head.weight" and config.tie_word_embeddings) or "rotary_emb" in name:
        return None
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _FUSED:
        module, part = _FUSED[parts[-2]]
        return ".".join(parts[:-2] + [module, parts[-1]]), part
    return name, None

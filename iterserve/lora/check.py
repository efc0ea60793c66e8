"""An adapter checked against the served model's config, without the model: what the server does before it
lists an adapter (``--lora-modules``, ``/v1/load_lora_adapter``), so that a bad folder is refused with its
problem named instead of failing the requests that name it."""

from __future__ import annotations

from iterserve.config import ModelConfig
from iterserve.config.moe import is_moe_layer
from iterserve.lora.adapter import MODULE_OF, AdapterError, group_parts, read_adapter
from iterserve.lora.request import LoRARequest
from iterserve.models.archs import model_class


def module_shapes(config: ModelConfig) -> dict[tuple[str, int | None], tuple[int, int]]:
    """``{(fused layer, part): (out features, in features)}`` of a dense layer, as the PEFT module has them."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    h, i = config.hidden_size, config.intermediate_size
    return {
        ("self_attn.qkv_proj", 0): (q, h), ("self_attn.qkv_proj", 1): (kv, h), ("self_attn.qkv_proj", 2): (kv, h),
        ("self_attn.o_proj", None): (h, q),
        ("mlp.gate_up_proj", 0): (i, h), ("mlp.gate_up_proj", 1): (i, h), ("mlp.down_proj", None): (h, i),
    }


def check_adapter(lora: LoRARequest, config: ModelConfig, max_rank: int) -> None:
    """Raise :class:`AdapterError` naming the first thing that keeps the adapter from running on this model."""
    if not model_class(config).supports_lora:
        raise AdapterError(lora, f"LoRA adapters are not supported on {model_class(config).__name__} models")
    _, _, tensors = read_adapter(lora, max_rank, config)
    shapes = module_shapes(config)
    for (index, layer), parts in group_parts(lora, tensors, config.num_layers).items():
        if layer.startswith("mlp.") and is_moe_layer(config, index):
            raise AdapterError(lora, f"layers.{index}.{layer} is not a linear layer of this model")
        for part, pair in parts.items():
            where = f"layers.{index}.{layer.split('.')[0]}.{MODULE_OF[layer, part]}"
            if set(pair) != {"A", "B"}:
                raise AdapterError(lora, f"{where} has lora_A or lora_B alone")
            out_features, in_features = shapes[layer, part]
            r = pair["A"].shape[0]
            if r > max_rank:
                raise AdapterError(lora, f"{where} has rank {r}, above max_lora_rank={max_rank}")
            for label, t, want in (("lora_A", pair["A"], (r, in_features)), ("lora_B", pair["B"], (out_features, r))):
                if tuple(t.shape) != want:
                    raise AdapterError(lora, f"{where}.{label} has shape {tuple(t.shape)}, expected {want} for "
                                             "this model: an adapter of another base model?")

"""A GGUF file as a model: its config from the metadata, and its tensors under Hugging Face names (llama.cpp
stores q and k with their rotary halves interleaved, undone here; quantized blocks are kept where asked)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from iterserve.config import ModelConfig
from iterserve.formats.gguf_file import gguf_field
from iterserve.models.moe import GGUF_EXPERT_NAMES, ExpertBlocks, gguf_moe_config
from iterserve.quantization.gguf_weight import from_stored
from iterserve.quantization.model import gguf_block_tensors
from iterserve.quantization.packed import from_gguf

_GGUF_ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3"}


def gguf_config(reader, name: str = "") -> ModelConfig:
    """A ModelConfig from GGUF metadata (llama, qwen2, qwen3 architectures)."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ValueError(
            f"unsupported architecture {arch!r} in GGUF file; iterserve runs {', '.join(sorted(_GGUF_ARCHS))}"
        )
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError("GGUF files with per-frequency RoPE factors (rope_freqs.weight) are not supported yet")

    def g(key: str, default: Any = None) -> Any:
        return gguf_field(reader, f"{arch}.{key}", default)

    hidden, heads = g("embedding_length"), g("attention.head_count")
    vocab = g("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    rope_scaling = None
    if g("rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": g("rope.scaling.factor")}
    elif g("rope.scaling.type") not in (None, "none"):
        raise ValueError(f"unsupported RoPE scaling {g('rope.scaling.type')!r} in GGUF file")
    return gguf_moe_config(ModelConfig(
        architecture=_GGUF_ARCHS[arch],
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(g("feed_forward_length")),
        num_layers=int(g("block_count")),
        num_heads=int(heads),
        num_kv_heads=int(g("attention.head_count_kv", heads)),
        head_dim=int(g("attention.key_length", hidden // heads)),
        max_position_embeddings=int(g("context_length", 2048)),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings=not has_output,
        attention_bias=_GGUF_ARCHS[arch] == "qwen2",
        qk_norm=_GGUF_ARCHS[arch] == "qwen3",
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=gguf_field(reader, "tokenizer.ggml.eos_token_id"),
        name=name or gguf_field(reader, "general.name", ""),
    ), g)


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of Q/K rows so RoPE uses the rotate-half layout."""
    shape = w.shape
    return w.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


_GGUF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GGUF_NAMES.update(GGUF_EXPERT_NAMES)  # a MoE layer's router and 3-D experts (iterserve.models.moe)


def gguf_to_hf_name(name: str, config: ModelConfig, permute: bool) -> tuple[str, int | None]:
    """The Hugging Face name of a GGUF tensor, and the heads whose Q/K rows llama.cpp interleaved (or None)."""
    if name == "token_embd.weight":
        return "embed_tokens.weight", None
    if name == "output_norm.weight":
        return "norm.weight", None
    if name == "output.weight":
        return "lm_head.weight", None
    _, layer, kind, suffix = name.split(".", 3)
    if kind not in _GGUF_NAMES:
        raise ValueError(f"unexpected GGUF tensor {name!r}")
    heads = None
    if permute and kind in ("attn_q", "attn_k"):
        heads = config.num_heads if kind == "attn_q" else config.num_kv_heads
    return f"layers.{layer}.{_GGUF_NAMES[kind]}.{suffix}", heads


def gguf_tensors(reader, config: ModelConfig, keep_blocks: bool = False):
    """``(Hugging Face name, tensor)`` for every GGUF tensor: float, or with ``keep_blocks`` a
    :class:`BlockWeight` or :class:`GGUFWeight` for the matrices :func:`gguf_block_tensors` keeps in blocks (an
    :class:`ExpertBlocks` for a MoE layer's experts)."""
    import gguf

    permute = reader.fields["general.architecture"].contents() in ("llama", "mistral")
    kept = gguf_block_tensors((t.name, t.tensor_type.name, len(t.shape)) for t in reader.tensors) if keep_blocks \
        else {}
    for t in reader.tensors:
        hf, heads = gguf_to_hf_name(t.name, config, permute)
        if t.name in kept and len(t.shape) == 3:  # a MoE layer's experts: [experts, n, k], expert-major
            experts, n, k = int(t.shape[2]), int(t.shape[1]), int(t.shape[0])
            data = np.asarray(t.data).reshape(experts, -1)
            yield hf, ExpertBlocks([from_stored(data[e], t.tensor_type.name, n, k) for e in range(experts)])
            continue
        if t.name in kept:
            n = int(t.shape[1])
            blocks = from_gguf(t.data, t.tensor_type.name, n, int(t.shape[0]), as_stored=kept[t.name])
            yield hf, blocks if heads is None else blocks.rows(torch.from_numpy(unpermute_rope(np.arange(n), heads)))
            continue
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise ValueError(f"cannot dequantize GGUF tensor {t.name!r} ({t.tensor_type.name}): {e}") from None
        if heads is not None:
            w = unpermute_rope(w, heads)
        yield hf, torch.from_numpy(np.array(w))  # copy: GGUF data is a read-only memmap



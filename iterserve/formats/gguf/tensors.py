"""A GGUF file's tensors under Hugging Face names (llama.cpp stores q and k with their rotary halves
interleaved, undone here), as float tensors or, where asked, kept in their quantized blocks: which tensors stay
in blocks (:func:`gguf_block_tensors`) and how a tensor's bytes become a block weight (:func:`from_gguf`)."""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import torch

from iterserve.config import ModelConfig
from iterserve.formats.gguf.reader import interleaves_rope
from iterserve.formats.gguf.types import (
    FLOAT_TYPES,
    KEPT_TYPES,
    REPACKED_BLOCK_BYTES,
    REPACKED_TYPES,
)
from iterserve.quantization.gguf_weight import GGUFWeight, from_stored
from iterserve.quantization.packed import BLOCK, BlockWeight

logger = logging.getLogger(__name__)

_GGUF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    # a MoE layer's router and 3-D experts, as the names iterserve.models.moe's ExpertLoader reads
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj",
}
# Gemma 3's four norms a layer: its ffn_norm comes before the MLP, and the two sublayers' outputs have their own
_GEMMA3_NAMES = {**_GGUF_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                 "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# Phi-3's checkpoints fuse q/k/v and gate/up, and llama.cpp keeps them fused
_PHI3_NAMES = {**_GGUF_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_NAMES = {"gemma3": _GEMMA3_NAMES, "phi3": _PHI3_NAMES}
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3's longrope: config, not weights


@dataclass
class ExpertBlocks:
    """A GGUF 3-D experts tensor kept in its blocks: one ``[out, in]`` weight per expert."""

    weights: list[GGUFWeight]


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of Q/K rows so RoPE uses the rotate-half layout."""
    shape = w.shape
    return w.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def gguf_to_hf_name(name: str, config: ModelConfig, permute: bool) -> tuple[str, int | None]:
    """The Hugging Face name of a GGUF tensor, and the heads whose Q/K rows llama.cpp interleaved (or None)."""
    if name == "token_embd.weight":
        return "embed_tokens.weight", None
    if name == "output_norm.weight":
        return "norm.weight", None
    if name == "output.weight":
        return "lm_head.weight", None
    _, layer, kind, suffix = name.split(".", 3)
    names = _NAMES.get(config.architecture, _GGUF_NAMES)
    if kind not in names:
        raise ValueError(f"unexpected GGUF tensor {name!r}")
    heads = None
    if permute and kind in ("attn_q", "attn_k"):
        heads = config.num_heads if kind == "attn_q" else config.num_kv_heads
    return f"layers.{layer}.{names[kind]}.{suffix}", heads


def dequantized(t: Any) -> np.ndarray:
    """A reader tensor's values as floats (gguf-py's dequantization); a ValueError names the tensor."""
    try:
        return gguf.quants.dequantize(t.data, t.tensor_type)
    except Exception as e:
        raise ValueError(f"cannot dequantize GGUF tensor {t.name!r} ({t.tensor_type.name}): {e}") from None


def gguf_tensors(reader: gguf.GGUFReader, config: ModelConfig, keep_blocks: bool = False) -> Iterator[tuple[str, Any]]:
    """``(Hugging Face name, tensor)`` for every GGUF tensor: float, or with ``keep_blocks`` a
    :class:`BlockWeight` or :class:`GGUFWeight` for the matrices :func:`gguf_block_tensors` keeps in blocks (an
    :class:`ExpertBlocks` for a MoE layer's experts)."""
    permute = interleaves_rope(reader)
    kept = gguf_block_tensors((t.name, t.tensor_type.name, len(t.shape)) for t in reader.tensors) if keep_blocks \
        else {}
    for t in reader.tensors:
        if t.name in ROPE_FACTORS:
            continue
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
        w = dequantized(t)
        if heads is not None:
            w = unpermute_rope(w, heads)
        if config.architecture == "gemma3" and t.name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma's norm weights as 1 + w, the factor they multiply by
        yield hf, torch.from_numpy(np.array(w))  # copy: GGUF data is a read-only memmap


# -- which tensors stay in blocks ---------------------------------------------------------------------

# Tensors fused into one layer: they stay in blocks together or not at all (a MoE layer's gate and up experts too).
_FUSED = re.compile(r"^(blk\.\d+)\.(?:attn_[qkv]|ffn_gate|ffn_up)(_exps)?\.weight$")


def _group(name: str) -> str:
    m = _FUSED.match(name)
    if not m:
        return name
    return m.group(1) + (".attn_qkv" if ".attn_" in name else ".ffn_gate_up") + (m.group(2) or "")


def _is_matrix(name: str, dims: int) -> bool:
    """A weight matrix: 2-D, or a MoE layer's 3-D experts (one matrix per expert)."""
    return dims == 2 or (dims == 3 and name.endswith("_exps.weight"))


def gguf_block_tensors(tensors: Iterable[tuple[str, str, int]]) -> dict[str, bool]:
    """The matrices (``(name, type name, dims)``) that ``quantization="gguf"`` keeps in blocks, those whose
    fused partners are quantized too, each with whether it stays as stored (its group holds a type beyond
    Q4_0/Q4_1/Q8_0: a fused layer's parts share one weight class; experts always stay as stored). The rest are
    logged, once, as loaded in float; a type neither quantized nor float is refused."""
    matrices = [(name, kind) for name, kind, dims in tensors if _is_matrix(name, dims)]
    for name, kind in matrices:
        if kind not in KEPT_TYPES + FLOAT_TYPES:
            raise ValueError(f"GGUF tensor {name} has type {kind}, which quantization=gguf does not load; supported "
                             f"types: {', '.join(FLOAT_TYPES + KEPT_TYPES)}")
    groups: dict[str, list[tuple[str, str]]] = {}
    for name, kind in matrices:
        groups.setdefault(_group(name), []).append((name, kind))
    kept = {name: name.endswith("_exps.weight") or any(kind not in REPACKED_TYPES for _, kind in members)
            for members in groups.values()
            if all(kind in KEPT_TYPES for _, kind in members) for name, _ in members}
    floats = Counter(kind for name, kind in matrices if name not in kept)
    if floats:
        logger.warning("quantization=gguf keeps %s in blocks; %d matrices load as float (%s)",
                       "/".join(KEPT_TYPES), sum(floats.values()),
                       ", ".join(f"{kind} x{n}" for kind, n in sorted(floats.items())))
    return kept


def from_gguf(raw: np.ndarray, type_name: str, n: int, k: int, as_stored: bool = False) -> BlockWeight | GGUFWeight:
    """A GGUF tensor's blocks (``raw``: its uint8 data, ``n`` rows of ``k`` weights), without loss: Q4_0, Q4_1
    and Q8_0 as a :class:`BlockWeight` to repack, other types (and any with ``as_stored``) as stored."""
    if type_name not in KEPT_TYPES:
        raise ValueError(f"GGUF type {type_name} is not kept in blocks; kept types: {', '.join(KEPT_TYPES)}")
    if as_stored or type_name not in REPACKED_BLOCK_BYTES:
        return from_stored(raw, type_name, n, k)
    if k % BLOCK:
        raise ValueError(f"a {type_name} row of {k} weights is not a whole number of blocks of {BLOCK}")
    blocks, nbytes = k // BLOCK, REPACKED_BLOCK_BYTES[type_name]
    data = np.asarray(raw).reshape(-1).view(np.uint8)
    if data.size != n * blocks * nbytes:
        raise ValueError(f"a [{n}, {k}] {type_name} tensor takes {n * blocks * nbytes} bytes, "
                         f"the file holds {data.size}")
    b = torch.from_numpy(data.reshape(n, blocks, nbytes).copy())
    d = b[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
    if type_name == "Q8_0":
        q = (b[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        return BlockWeight(q.reshape(n, k), d, d * -128, 8, type_name)
    if type_name == "Q4_1":
        c, qs = b[..., 2:4].contiguous().view(torch.float16).squeeze(-1), b[..., 4:]
    else:
        c, qs = d * -8, b[..., 2:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # element i < 16 in the low nibble of byte i, i >= 16 high
    return BlockWeight(q.reshape(n, k), d, c, 4, type_name)

"""Phi-3 (``Phi3ForCausalLM``): the Llama layer order, with its own rotary embedding.

Checkpoints store q/k/v and gate/up already fused (``qkv_proj``, ``gate_up_proj``); the fused layers load such a
whole tensor by splitting it into its parts before each rank takes its rows (:mod:`iterserve.distributed.layers`).
RoPE is either the default or "longrope": per-frequency ``short_factor`` divisors up to
``original_max_position_embeddings`` and ``long_factor`` ones beyond, cos/sin scaled by an attention factor.
transformers picks the set once per forward pass from the longest position in it; here each position takes the
set its own index falls in, which gives the same numbers whenever a prompt fits in the original context (a
longer prompt's first positions are rotated by the short set here, by the long one in transformers).
``partial_rotary_factor`` < 1 rotates only the first dimensions of each head (Phi-4-mini).
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import torch
from torch import nn

from iterserve.attention import AttentionBackend, AttentionMetadata, KVCache
from iterserve.config import ModelConfig
from iterserve.distributed.parallel_state import ParallelState
from iterserve.models.llama import Attention, DecoderLayer, LlamaModel


def rotary_dim(config: ModelConfig) -> int:
    """How many of a head's dimensions RoPE rotates (``partial_rotary_factor`` of them)."""
    return int(config.head_dim * float(config.extra.get("partial_rotary_factor", 1.0)))


def _inv_freq(theta: float, dim: int, factors: list[float] | None = None) -> torch.Tensor:
    # transformers' arithmetic, step for step: the tables then match it bit for bit in float32
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if factors is None:
        return 1.0 / (theta**shape)
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**shape)


def longrope_attention_factor(config: ModelConfig) -> float:
    """How much longrope scales cos and sin: ``sqrt(1 + ln(factor) / ln(original context))`` unless given."""
    scaling = config.rope_scaling or {}
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / original
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class Phi3RotaryEmbedding(nn.Module):
    """cos/sin tables ``[max_position_embeddings, rotary_dim]`` indexed by absolute position (rotate-half)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dim = rotary_dim(config)
        t = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        scaling = config.rope_scaling
        if scaling is None:
            freqs = torch.outer(t, _inv_freq(config.rope_theta, dim))
            attention_factor = 1.0
        else:
            short = _inv_freq(config.rope_theta, dim, scaling["short_factor"])
            long = _inv_freq(config.rope_theta, dim, scaling["long_factor"])
            beyond = (t >= scaling["original_max_position_embeddings"])[:, None]
            freqs = t[:, None] * torch.where(beyond, long[None, :], short[None, :])
            attention_factor = longrope_attention_factor(config)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_factor, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


class PartialRotaryAttention(Attention):
    """Attention whose RoPE turns the first ``rotary_dim`` dimensions of each head and passes the rest."""

    def __init__(self, config: ModelConfig, ps: ParallelState) -> None:
        super().__init__(config, ps)
        self.rotary_dim = rotary_dim(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        n, r = x.shape[0], self.rotary_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        q_rot, k_rot = backend.rotary(q[..., :r].contiguous(), k[..., :r].contiguous(), cos, sin)
        q, k = torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)
        out = backend.forward(q, k, v, cache, meta, self.scale)
        return self.o_proj(out.reshape(n, self.q_size))


class Phi3Model(LlamaModel):
    """:class:`LlamaModel` with Phi-3's rotary embedding; the native decode loop runs it unless RoPE is partial."""

    def __init__(self, config: ModelConfig, parallel: ParallelState | None = None) -> None:
        super().__init__(config, parallel)
        self.partial_rotary = rotary_dim(config) < config.head_dim
        if self.partial_rotary:
            for layer in self.layers:
                assert isinstance(layer, DecoderLayer)
                layer.self_attn = PartialRotaryAttention(config, self.parallel)

    def make_rotary(self) -> nn.Module:
        return Phi3RotaryEmbedding(self.config)

    def native_decoder(self, ops: ModuleType) -> Any:
        # csrc/decoder.cpp rotates whole heads
        return None if self.partial_rotary else super().native_decoder(ops)

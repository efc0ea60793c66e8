"""Phi-3 (``Phi3ForCausalLM``): the Llama layer order, with its own rotary embedding.

Checkpoints store q/k/v and gate/up already fused (``qkv_proj``, ``gate_up_proj``); the fused layers load such a
whole tensor by splitting it into its parts before each rank takes its rows (:mod:`iterserve.distributed.layers`).
RoPE is either the default or "longrope": per-frequency divisors, ``short_factor`` for a sequence that fits in
``original_max_position_embeddings`` and ``long_factor`` for a longer one, cos/sin scaled by an attention factor.
As in transformers, a sequence's length picks the set for all of its tokens in a step: a prompt longer than the
original context is rotated by the long set throughout. Two cases differ from transformers' ``generate``, which
recomputes the whole cache with the long set when a sequence grows past the original context: here the K/V
already cached keep their short rotation, and a long prompt's first chunks under chunked prefill (while the
sequence still fits) take the short set.
``partial_rotary_factor`` < 1 rotates only the first dimensions of each head (Phi-4-mini).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from iterserve.attention import AttentionBackend, AttentionMetadata, KVCache
from iterserve.config import ModelConfig
from iterserve.distributed.parallel_state import ParallelState
from iterserve.models.linear import LinearDelta
from iterserve.models.llama import Attention, DecoderLayer, LlamaModel
from iterserve.models.native_decoder import NativeStack


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


def _tables(rows: int, inv_freq: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = torch.arange(rows, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scale, emb.sin() * scale


class Phi3RotaryEmbedding(nn.Module):
    """cos/sin tables ``[positions, rotary_dim]`` (rotate-half): one for default RoPE; for longrope the short
    factors' up to the original context and the long factors' up to ``max_position_embeddings``."""

    cos: torch.Tensor
    sin: torch.Tensor
    long_cos: torch.Tensor
    long_sin: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dim, theta, scaling = rotary_dim(config), config.rope_theta, config.rope_scaling
        self.original: int | None = None
        if scaling is None:
            cos, sin = _tables(config.max_position_embeddings, _inv_freq(theta, dim), 1.0)
            long_cos, long_sin = cos[:0], sin[:0]
        else:
            self.original = int(scaling["original_max_position_embeddings"])
            scale = longrope_attention_factor(config)
            cos, sin = _tables(self.original, _inv_freq(theta, dim, scaling["short_factor"]), scale)
            long_cos, long_sin = _tables(config.max_position_embeddings,
                                         _inv_freq(theta, dim, scaling["long_factor"]), scale)
        for name, table in (("cos", cos), ("sin", sin), ("long_cos", long_cos), ("long_sin", long_sin)):
            self.register_buffer(name, table, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype,
                seq_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[tokens, 1, rotary_dim]``; longrope takes the long factors for the tokens of a sequence longer
        than the original context (``seq_lens``: each token's sequence length; without it, by position)."""
        if self.original is None:
            cos, sin = self.cos[positions], self.sin[positions]
        else:
            long = (positions >= self.original if seq_lens is None else seq_lens > self.original)[:, None]
            short = positions.clamp(max=self.original - 1)
            cos = torch.where(long, self.long_cos[positions], self.cos[short])
            sin = torch.where(long, self.long_sin[positions], self.sin[short])
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


class PartialRotaryAttention(Attention):
    """Attention whose RoPE turns the first ``rotary_dim`` dimensions of each head and passes the rest."""

    def __init__(self, config: ModelConfig, ps: ParallelState) -> None:
        super().__init__(config, ps)
        self.rotary_dim = rotary_dim(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, meta: AttentionMetadata,
        backend: AttentionBackend, lora: LinearDelta | None = None,
    ) -> torch.Tensor:
        n, r = x.shape[0], self.rotary_dim
        q, k, v = self.qkv_proj(x, lora).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        q_rot, k_rot = backend.ops.rotary(q[..., :r].contiguous(), k[..., :r].contiguous(), cos, sin)
        q, k = torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)
        out = backend.forward(q, k, v, cache, meta, self.scale)
        return self.o_proj(out.reshape(n, self.q_size), lora)


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

    def rotary_at(self, positions: torch.Tensor, dtype: torch.dtype,
                  meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary(positions, dtype, meta.token_seq_lens if self.config.rope_scaling else None)
        return cos, sin

    def native_stack(self) -> NativeStack | None:
        # csrc/decoder.cpp rotates whole heads
        return None if self.partial_rotary else super().native_stack()

"""The Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) on a paged KV cache.

One ``forward`` takes the flattened tokens of many sequences (decodes and prompt chunks mixed),
writes their K/V into the paged cache and returns logits only where a token will be sampled.
Q/K/V and gate/up are fused into single matmuls: one GEMM per projection group is what keeps
small batches fast on a CPU. Under tensor parallelism (a :class:`ParallelState` of several ranks) each
rank holds its heads and its slice of the MLP and vocabulary (:mod:`iterserve.distributed.layers`).
"""

from __future__ import annotations

import math
import typing

import torch
from torch import nn

from iterserve.attention import AttentionBackend, AttentionMetadata, KVCache
from iterserve.config import ModelConfig
from iterserve.distributed.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    even_shard,
    head_shard,
)
from iterserve.distributed.parallel_state import ParallelState
from iterserve.models.linear import LinearDelta
from iterserve.models.moe import SparseMoeBlock
from iterserve.models.native_decoder import NativeDecoder, NativeLayer, NativeLinear, NativeLoRA, NativeStack


class RMSNorm(nn.Module):
    """RMSNorm; given a residual it first adds ``x`` into it and returns ``(normed, new_residual)``.

    Taking the residual add lets the CPU kernel do add + norm in one pass over the activations. The backend's
    op set (:mod:`iterserve.platforms.ops`) computes it.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, backend: AttentionBackend, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return backend.ops.rms_norm(x, self.weight, self.eps)
        return backend.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with Llama-3 / linear scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r}; iterserve supports 'linear' and 'llama3'")


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (rotate-half convention)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config)
        t = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, ps: ParallelState) -> None:
        super().__init__()
        local = config.tensor_parallel_shard(ps.world_size)  # this rank's heads
        self.num_heads, self.num_kv_heads, self.head_dim = local.num_heads, local.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = local.q_size, local.kv_size
        kv = head_shard(config.num_kv_heads, config.head_dim, ps)
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size, [head_shard(config.num_heads, config.head_dim, ps), kv, kv], bias=config.attention_bias)
        self.o_proj = RowParallelLinear(config.q_size, config.hidden_size, ps)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.scale = self.head_dim**-0.5

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, meta: AttentionMetadata,
        backend: AttentionBackend, lora: LinearDelta | None = None,
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x, lora).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q, backend), self.k_norm(k, backend)
        q, k = backend.ops.rotary(q, k, cos, sin)
        out = backend.forward(q, k, v, cache, meta, self.scale)
        return self.o_proj(out.reshape(n, self.q_size), lora)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, ps: ParallelState) -> None:
        super().__init__()
        width = even_shard(config.intermediate_size, ps)
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [width, width])
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, ps)

    def forward(self, x: torch.Tensor, backend: AttentionBackend, lora: LinearDelta | None = None) -> torch.Tensor:
        return self.down_proj(backend.ops.silu_and_mul(self.gate_up_proj(x, lora)), lora)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ps: ParallelState, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, ps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: MLP | SparseMoeBlock = SparseMoeBlock(config) if config.is_moe_layer(index) else MLP(config, ps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
        meta: AttentionMetadata, backend: AttentionBackend, lora: LinearDelta | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns this layer's output and the residual stream before it (the next norm adds them)."""
        if residual is None:
            x, residual = self.input_layernorm(x, backend), x
        else:
            x, residual = self.input_layernorm(x, backend, residual)
        x = self.self_attn(x, cos, sin, cache, meta, backend, lora)
        x, residual = self.post_attention_layernorm(x, backend, residual)
        return (self.mlp(x, backend, lora) if isinstance(self.mlp, MLP) else self.mlp(x, backend)), residual


def native_linears(attn: Attention, mlp: MLP) -> tuple[NativeLinear, NativeLinear, NativeLinear, NativeLinear] | None:
    """A layer's qkv, o, gate/up and down as the native decode loop multiplies them; None if one has no C++ kernel."""
    qkv, o, gate_up, down = (p.method.native(p) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                                           mlp.down_proj))
    if qkv is None or o is None or gate_up is None or down is None:
        return None
    return qkv, o, gate_up, down


class LlamaModel(nn.Module):
    """Decoder stack plus LM head; weights are filled in by :mod:`iterserve.models.loader`.

    ``config`` is the whole model's; ``parallel`` says which shard of it this process holds.
    """

    supports_lora = True  # its layers pass a step's LoRA rows to their linear layers

    def __init__(self, config: ModelConfig, parallel: ParallelState | None = None) -> None:
        super().__init__()
        ps = parallel or ParallelState()
        self.config = config
        self.parallel = ps
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, ps)
        self.layers = self.make_layers(ps)
        self.norm = self.make_norm()
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, ps)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = self.make_rotary()

    def make_layers(self, ps: ParallelState) -> nn.ModuleList:
        """The decoder layers (a family with other layers builds its own)."""
        return nn.ModuleList(DecoderLayer(self.config, ps, i) for i in range(self.config.num_layers))

    def make_norm(self) -> nn.Module:
        return RMSNorm(self.config.hidden_size, self.config.rms_norm_eps)

    def make_rotary(self) -> nn.Module:
        """The rotary tables (the loader computes them again on the device, after building on the meta device)."""
        return RotaryEmbedding(self.config)

    def rotary_at(self, positions: torch.Tensor, dtype: torch.dtype,
                  meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[tokens, 1, head_dim]`` of this step's tokens (Phi-3's also depend on each sequence's length)."""
        cos, sin = self.rotary(positions, dtype)
        return cos, sin

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def allocate_kv_cache(self, num_blocks: int, block_size: int, backend: AttentionBackend | None = None,
                          kv_cache_dtype: str = "auto", window_blocks: int = 0) -> list[KVCache]:
        """One K and V pool per layer, holding this rank's KV heads only, K laid out as ``backend`` reads it
        fastest (rows, which every backend reads, without one), stored in ``kv_cache_dtype``; a sliding-window
        layer's pool holds ``window_blocks`` blocks where that is given (hybrid SWA memory)."""
        c = self.config.tensor_parallel_shard(self.parallel.world_size)
        grouped = backend is not None and backend.ops.keys_in_groups(self.dtype, c.head_dim, block_size)
        return [
            KVCache.allocate(window_blocks if window_blocks and window is not None else num_blocks, block_size,
                             c.num_kv_heads, c.head_dim, self.dtype, self.device, grouped, kv_cache_dtype)
            for window in self.config.layer_windows()
        ]

    def native_stack(self) -> NativeStack | None:
        """The layers as :mod:`iterserve.models.native_decoder` runs them (a decode step in one C++ call), or None
        where it cannot: a sharded model (its all-reduces are Python's), a mixture-of-experts layer (its routing
        is Python's), or a linear layer whose method has no C++ kernel."""
        layers = typing.cast(list[DecoderLayer], self.layers)
        if self.parallel.world_size > 1 or any(not isinstance(layer.mlp, MLP) for layer in layers):
            return None
        described = []
        for layer in layers:
            attn = layer.self_attn
            linears = native_linears(attn, typing.cast(MLP, layer.mlp))
            if linears is None:
                return None
            q_norm, k_norm = (attn.q_norm.weight, attn.k_norm.weight) if attn.q_norm and attn.k_norm else (None, None)
            described.append(NativeLayer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, q_norm,
                                         k_norm, *linears))
        c = self.config
        return NativeStack(c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps, c.head_dim**-0.5, described)

    def native_lora(self, lora: LinearDelta) -> NativeLoRA | None:
        """The step's LoRA tensors for the native decode loop's linear layers (qkv, o, gate/up, down of each
        layer); None where it has no such layers (a mixture-of-experts MLP) or no kernel adds them: the layers
        then run in Python."""
        layers = typing.cast(list[DecoderLayer], self.layers)
        if any(not isinstance(layer.mlp, MLP) for layer in layers):
            return None
        return lora.native([p for layer in layers for p in (
            layer.self_attn.qkv_proj, layer.self_attn.o_proj, typing.cast(MLP, layer.mlp).gate_up_proj,
            typing.cast(MLP, layer.mlp).down_proj)])

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        backend: AttentionBackend,  # attention, and the op set of the fused operations (chosen once, per device)
        logits_indices: torch.Tensor | None = None,  # rows whose next token is sampled
        lora: LinearDelta | None = None,  # the step's LoRA adapters and the rows each serves
        decoder: NativeDecoder | None = None,  # runs a step of decodes in one C++ call, where it can
    ) -> torch.Tensor:
        """Returns float32 logits ``[len(logits_indices), vocab]`` (all rows when None); under tensor
        parallelism on rank 0 only (the other ranks get an empty tensor)."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_at(positions, x.dtype, meta)
        native = None
        if decoder is not None:
            native_lora = None if lora is None else self.native_lora(lora)
            if lora is None or native_lora is not None:
                native = decoder(self, x, cos, sin, kv_caches, meta, native_lora)
        residual: torch.Tensor | None = None
        if native is not None:
            x, residual = native
        else:
            for layer, cache in zip(self.layers, kv_caches):
                x, residual = layer(x, residual, cos, sin, cache, meta, backend, lora)
        assert residual is not None  # every layer returns it
        if logits_indices is not None:
            x, residual = x[logits_indices], residual[logits_indices]
        x, _ = self.norm(x, backend, residual)
        return self.lm_head(x).float()

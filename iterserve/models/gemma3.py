"""Gemma 3's text decoder (``Gemma3ForCausalLM``, and the language model of ``Gemma3ForConditionalGeneration``).

Against the Llama layout: embeddings scaled by ``sqrt(hidden_size)``; RMSNorm as ``x * (1 + w)`` computed in
float32, four of them per layer (before and after attention, before and after the MLP, each sublayer's output
normed before the residual add); q/k norms; a GELU-tanh MLP; attention scaled by ``query_pre_attn_scalar**-0.5``;
and layers that alternate between local ones (a sliding window, RoPE base ``rope_local_base_freq``) and global
ones (the whole context, RoPE base ``rope_theta`` with its scaling). Each layer hands the attention backend its
own window (:meth:`AttentionMetadata.with_window`); with hybrid SWA memory the local layers keep their K/V in a
pool of their own that lets go of what falls out of the window (:mod:`iterserve.engine.window_blocks`).
A step of decodes runs the layers in one C++ call (``csrc/decoder.cpp``'s Gemma 3 order), other steps in Python.
"""

from __future__ import annotations

import typing

import torch
import torch.nn.functional as F
from torch import nn

from iterserve.attention import AttentionBackend, AttentionMetadata, KVCache
from iterserve.config import ModelConfig
from iterserve.distributed.parallel_state import ParallelState
from iterserve.models.linear import LinearDelta
from iterserve.models.llama import MLP, Attention, LlamaModel, RMSNorm, native_linears, rope_inv_freq
from iterserve.models.native_decoder import NativeDecoder, NativeLayer, NativeStack


class GemmaRMSNorm(RMSNorm):
    """``x * (1 + w)``, normalised and weighted in float32, then cast back (the checkpoint stores ``w``)."""

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)

    def forward(
        self, x: torch.Tensor, backend: AttentionBackend, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.normed(x)
        residual = x + residual
        return self.normed(residual), residual


class Gemma3Attention(Attention):
    """Llama's fused q/k/v and o projections, Gemma's q/k norms and scale, and this layer's sliding window."""

    def __init__(self, config: ModelConfig, ps: ParallelState, window: int | None) -> None:
        super().__init__(config, ps)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.scale = float(config.extra["query_pre_attn_scalar"]) ** -0.5
        self.window = window

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, meta: AttentionMetadata,
        backend: AttentionBackend, lora: LinearDelta | None = None,  # never given: no LoRA on Gemma 3
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q_norm, k_norm = typing.cast(GemmaRMSNorm, self.q_norm), typing.cast(GemmaRMSNorm, self.k_norm)
        q = q_norm.normed(q.reshape(n, self.num_heads, self.head_dim))
        k = k_norm.normed(k.reshape(n, self.num_kv_heads, self.head_dim))
        v = v.view(n, self.num_kv_heads, self.head_dim)
        q, k = backend.ops.rotary(q, k, cos, sin)
        out = backend.forward(q, k, v, cache, meta.with_window(self.window), self.scale)
        return self.o_proj(out.reshape(n, self.q_size))


class Gemma3MLP(MLP):
    def forward(self, x: torch.Tensor, backend: AttentionBackend, lora: LinearDelta | None = None) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ps: ParallelState, sliding: bool, window: int | None) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.sliding = sliding  # local RoPE and the window; global RoPE and the whole context otherwise
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = Gemma3Attention(config, ps, window)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = Gemma3MLP(config, ps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm.normed(x), cos, sin, cache, meta, backend)
        x = x + self.post_attention_layernorm.normed(h)
        h = self.mlp(self.pre_feedforward_layernorm.normed(x), backend)
        return x + self.post_feedforward_layernorm.normed(h)


class Gemma3Rotary(nn.Module):
    """cos/sin of the global layers (``rope_theta``, scaled) and of the local ones (``rope_local_base_freq``),
    computed for each step's positions: tables of 131,072 positions by 256 dimensions would hold 512 MiB."""

    full_inv_freq: torch.Tensor
    local_inv_freq: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        local = config.replace(rope_theta=config.extra["rope_local_base_freq"], rope_scaling=None)
        self.register_buffer("full_inv_freq", rope_inv_freq(config), persistent=False)
        self.register_buffer("local_inv_freq", rope_inv_freq(local), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        return self._cos_sin(positions, self.full_inv_freq, dtype), self._cos_sin(positions, self.local_inv_freq, dtype)

    @staticmethod
    def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * inv_freq[None, :]  # as transformers computes them, in float32
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


class Gemma3Model(LlamaModel):
    """Decoder stack plus the tied LM head, with :class:`LlamaModel`'s interface (forward, KV cache, loading)."""

    def make_layers(self, ps: ParallelState) -> nn.ModuleList:
        types = self.config.extra["layer_types"]
        return nn.ModuleList(Gemma3DecoderLayer(self.config, ps, t == "sliding_attention", w)
                             for t, w in zip(types, self.config.layer_windows()))

    def make_norm(self) -> nn.Module:
        return GemmaRMSNorm(self.config.hidden_size, self.config.rms_norm_eps)

    def make_rotary(self) -> nn.Module:
        return Gemma3Rotary(self.config)

    supports_lora = False  # its layers take no LoRA rows (adapters are refused when they load)

    def native_stack(self) -> NativeStack | None:
        """The layers as ``csrc/decoder.cpp`` runs them in Gemma 3's order; None where a linear layer has no C++
        kernel or the model is sharded (its all-reduces are Python's)."""
        if self.parallel.world_size > 1:
            return None
        described = []
        for layer in typing.cast(list[Gemma3DecoderLayer], self.layers):
            attn = layer.self_attn
            linears = native_linears(attn, layer.mlp)
            if linears is None:
                return None
            w1 = [1.0 + typing.cast(GemmaRMSNorm, n).weight.float() for n in (  # as GemmaRMSNorm.normed weighs
                layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm,
                layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm)]
            described.append(NativeLayer(w1[0], w1[1], w1[2], w1[3], *linears, w1[4], w1[5], attn.window or 0))
        c = self.config
        return NativeStack(c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps,
                           float(c.extra["query_pre_attn_scalar"]) ** -0.5, described, gemma=True)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        logits_indices: torch.Tensor | None = None,  # rows whose next token is sampled
        lora: LinearDelta | None = None,  # never given: supports_lora is False
        decoder: NativeDecoder | None = None,  # runs a step of decodes in one C++ call
    ) -> torch.Tensor:
        """Float32 logits ``[len(logits_indices), vocab]`` (all rows when None), as :meth:`LlamaModel.forward`."""
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)  # the scale rounded to the dtype first
        (cos_full, sin_full), (cos_local, sin_local) = self.rotary(positions, x.dtype)
        out = None
        if decoder is not None:  # a step of decodes in one C++ call
            local = (cos_local, sin_local, meta.with_window(self.config.sliding_window))
            out = decoder(self, x, cos_full, sin_full, kv_caches, meta.with_window(None), local=local)
        if out is not None:
            x = out[0]
        else:
            for layer, cache in zip(typing.cast(list[Gemma3DecoderLayer], self.layers), kv_caches):
                cos, sin = (cos_local, sin_local) if layer.sliding else (cos_full, sin_full)
                x = layer(x, cos, sin, cache, meta, backend)
        if logits_indices is not None:
            x = x[logits_indices]
        logits = self.lm_head(typing.cast(GemmaRMSNorm, self.norm).normed(x))
        cap = self.config.extra.get("final_logit_softcapping")
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

"""The CPU backend: the C++ kernels of :mod:`iterserve.kernels` (``csrc/attention.cpp``, ``csrc/layer_ops.cpp``)
where they exist, the reference PyTorch path for the rest (prefill attention), and a decode step's whole layer
stack in one call (``csrc/decoder.cpp``)."""

from __future__ import annotations

import sys
import weakref
from types import ModuleType
from typing import Any

import torch

from iterserve.attention.backend import NativeDecoderModel, NativeLoRA
from iterserve.attention.metadata import AttentionMetadata, KVCache
from iterserve.attention.reference import ReferenceBackend


class CpuBackend(ReferenceBackend):
    """``ops`` is the loaded extension (``iterserve.kernels.ops``); ``native_layers=False`` keeps every step's
    layers in Python (the same kernels, called one by one: the native loop's A/B); ``batch_invariant`` attends
    prompts of any length as decodes, so that a row's attention never depends on the batch's make-up."""

    name = "cpu"
    # paged_decode on every prompt token, over its own prefix, on the kernels' threads, beats SDPA on torch's
    # one thread for short prompts; past this length it loses, since each row reads its whole prefix where SDPA
    # reuses a tile of K/V across rows (docs/benchmarks-history.md). A step of decodes then runs in one call.
    decode_prompts_up_to = 512

    def __init__(self, ops: ModuleType, native_layers: bool = True, batch_invariant: bool = False) -> None:
        self.ops = ops
        self.native_layers = native_layers
        if batch_invariant:  # every prompt token attended in the decode kernel's order (platforms/invariance.py)
            self.decode_prompts_up_to = sys.maxsize
        self._stacks: weakref.WeakKeyDictionary[NativeDecoderModel, Any] = weakref.WeakKeyDictionary()

    def keys_in_groups(self, dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
        return bool(self.ops.keys_in_groups(dtype, head_dim, block_size))

    def decode_layers(self, model: NativeDecoderModel, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      kv_caches: list[KVCache], meta: AttentionMetadata,
                      lora: NativeLoRA | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        # csrc/decoder.cpp calls this backend's kernels in this backend's order, built once per model.
        if not self.native_layers or not meta.num_decode_tokens or meta.num_decode_tokens != x.shape[0]:
            return None
        if model not in self._stacks:
            self._stacks[model] = model.native_decoder(self.ops)
        stack = self._stacks[model]
        if stack is None:
            return None
        tables, context_lens = meta.decode_tables()
        out: tuple[torch.Tensor, torch.Tensor] = stack.forward(
            x, cos[:, 0], sin[:, 0], [c.k for c in kv_caches], [c.v for c in kv_caches], meta.slot_blocks,
            meta.slot_offsets, tables, context_lens, meta.sliding_window or 0,
            [c.k_scale for c in kv_caches if c.k_scale is not None],
            [c.v_scale for c in kv_caches if c.v_scale is not None], *(lora or ([], [], [], None)))
        return out

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, cache: KVCache, meta: AttentionMetadata) -> None:
        if cache.quantized:
            self.ops.write_kv_quant(k, v, cache.k, cache.v, cache.k_scale, cache.v_scale, meta.slot_blocks,
                                    meta.slot_offsets)
            return
        self.ops.write_kv(k, v, cache.k, cache.v, meta.slot_blocks, meta.slot_offsets)

    def decode(self, out: torch.Tensor, q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float) -> None:
        # Reads each sequence's blocks in place: no gathered copy of K/V. Decode attention alone (bf16,
        # context 512, one layer) measured the gather + two matmuls 5.6x / 4.7x / 6.1x slower at batch
        # 1 / 16 / 64; torch.compile of that route took 0.7-1.2x the gather's time, still 7-20x the
        # kernel's (scripts/bench_decode_attention.py, under heavy shared load, routes alternating).
        if cache.quantized:  # csrc/kv_quant.cpp: the one-byte blocks widened in place, tile by tile
            self.ops.paged_decode_quant(out, q, cache.k, cache.v, cache.k_scale, cache.v_scale,
                                        meta.decode_block_tables, meta.decode_context_lens, scale,
                                        meta.sliding_window or 0, 0)
            return
        self.ops.paged_decode(out, q, cache.k, cache.v, meta.decode_block_tables, meta.decode_context_lens, scale,
                              meta.sliding_window or 0)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out: torch.Tensor = self.ops.rms_norm(x, weight, eps)
        return out

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        self.ops.fused_add_rms_norm(x, residual, weight, eps)  # in place on both: one pass over the activations
        return x, residual

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.ops.rope_(q, k, cos[:, 0], sin[:, 0])  # in place, one pass per row
        return q, k

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.ops.silu_and_mul(gate_up)
        return out

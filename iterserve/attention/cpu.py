"""The CPU backend: the C++ attention kernels of :mod:`iterserve.kernels` (``csrc/attention.cpp``,
``csrc/kv_quant.cpp``) for writing K/V and decode attention, the reference PyTorch path for the rest (prefill
attention)."""

from __future__ import annotations

import sys

import torch

from iterserve.attention.metadata import AttentionMetadata, KVCache
from iterserve.attention.reference import ReferenceBackend
from iterserve.platforms.ops import CpuOps


class CpuBackend(ReferenceBackend):
    """``ops`` is the kernels' op set (:func:`iterserve.platforms.ops.cpu_kernels`); ``batch_invariant`` attends
    prompts of any length as decodes, so that a row's attention never depends on the batch's make-up."""

    name = "cpu"
    ops: CpuOps
    # paged_decode on every prompt token, over its own prefix, on the kernels' threads, beats SDPA on torch's
    # one thread for short prompts; past this length it loses, since each row reads its whole prefix where SDPA
    # reuses a tile of K/V across rows (docs/benchmarks-history.md). A step of decodes then runs in one call.
    decode_prompts_up_to = 512

    def __init__(self, ops: CpuOps, batch_invariant: bool = False) -> None:
        self.ops = ops
        if batch_invariant:  # every prompt token attended in the decode kernel's order (platforms/invariance.py)
            self.decode_prompts_up_to = sys.maxsize

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, cache: KVCache, meta: AttentionMetadata) -> None:
        ext = self.ops.extension
        if cache.quantized:
            ext.write_kv_quant(k, v, cache.k, cache.v, cache.k_scale, cache.v_scale, meta.slot_blocks,
                               meta.slot_offsets)
            return
        ext.write_kv(k, v, cache.k, cache.v, meta.slot_blocks, meta.slot_offsets)

    def decode(self, out: torch.Tensor, q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float) -> None:
        # Reads each sequence's blocks in place: a gathered copy of K/V and two matmuls, compiled or not, took
        # several times as long (docs/benchmarks-history.md).
        ext = self.ops.extension
        if cache.quantized:  # csrc/kv_quant_decode.cpp: the one-byte blocks widened in place, tile by tile
            ext.paged_decode_quant(out, q, cache.k, cache.v, cache.k_scale, cache.v_scale, meta.decode_block_tables,
                                   meta.decode_context_lens, scale, meta.sliding_window or 0, 0)
            return
        ext.paged_decode(out, q, cache.k, cache.v, meta.decode_block_tables, meta.decode_context_lens, scale,
                         meta.sliding_window or 0)

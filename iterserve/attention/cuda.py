"""The CUDA backend: decode attention through PyTorch's scaled_dot_product_attention, which dispatches to
a fused CUDA kernel, over each sequence's gathered blocks; the rest on the reference path. A paged CUDA
kernel (reading the blocks in place, as the CPU kernel does) replaces :meth:`CudaBackend.decode`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from iterserve.attention.metadata import AttentionMetadata, KVCache
from iterserve.attention.reference import ReferenceBackend, cache_rows


class CudaBackend(ReferenceBackend):
    name = "cuda"

    def decode(self, out: torch.Tensor, q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float) -> None:
        _, kv_heads, _, head_dim = cache.v.shape
        seqs = meta.decode_tables()[0].shape[0]
        rows = meta.decode_rows(kv_heads)
        keys = cache_rows(cache, rows, q.dtype, keys=True).view(seqs, kv_heads, -1, head_dim)
        values = cache_rows(cache, rows, q.dtype, keys=False).view(seqs, kv_heads, -1, head_dim)
        allowed = meta.decode_bias == 0  # [S, 1, 1, T]: the positions each sequence attends to
        o = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=allowed, scale=scale,
                                           enable_gqa=True)  # [S, H, 1, D]
        out[:] = o.squeeze(2)

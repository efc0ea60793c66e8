"""The PyTorch reference backend: every operation in plain PyTorch, the ground truth the kernels are tested
against, and what runs where no kernel does (``ITERSERVE_CPU_KERNELS=0``, no build, other devices)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from iterserve.attention import kv_quant
from iterserve.attention.backend import AttentionBackend
from iterserve.attention.metadata import AttentionMetadata, KVCache, PrefillSpan
from iterserve.platforms.ops import REFERENCE, ReferenceOps


class ReferenceBackend(AttentionBackend):
    """Decode attention gathers each sequence's blocks and runs two matmuls; prefill runs SDPA. The other
    backends inherit what they do not replace."""

    name = "reference"
    ops: ReferenceOps = REFERENCE

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        self.write_kv(k, v, cache, meta)
        out = torch.empty_like(q)
        n_dec = meta.num_decode_tokens
        if n_dec:
            self.decode(out[:n_dec], q[:n_dec], cache, meta, scale)
        for span in meta.prefills:
            out[span.start:span.end] = self.prefill(q, k, v, cache, span, scale)
        return out

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, cache: KVCache, meta: AttentionMetadata) -> None:
        """This step's K/V into their slots (quantized on the way in, for a quantized cache)."""
        if cache.quantized:
            for x, pool, scales in ((k, cache.k, cache.k_scale), (v, cache.v, cache.v_scale)):
                q, scale = kv_quant.quantize(x, cache.kv_dtype)
                pool[meta.slot_blocks, :, meta.slot_offsets] = q
                if scales is not None and scale is not None:
                    scales[meta.slot_blocks, :, meta.slot_offsets] = scale
            return
        cache.k[meta.slot_blocks, :, meta.slot_offsets] = k
        cache.v[meta.slot_blocks, :, meta.slot_offsets] = v

    def decode(self, out: torch.Tensor, q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float) -> None:
        """Attention of the decode tokens (the first ``meta.num_decode_tokens``), written into ``out``."""
        out[:] = decode_attention_reference(q, cache, meta, scale)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, span: PrefillSpan,
                scale: float) -> torch.Tensor:
        """Attention of one sequence's prompt chunk: ``[chunk, num_heads, head_dim]``."""
        qs = q[span.start:span.end].transpose(0, 1).unsqueeze(0)  # [1, H, chunk, D]
        if span.num_cached == 0 and span.mask is None and not cache.quantized:
            # The whole prompt is in this chunk: attend to the fresh K/V directly, causally. A quantized cache's
            # prompt attends to its K/V as stored, as its decodes and later chunks will: the same numbers
            # whether the prompt came in one chunk or several.
            ks = k[span.start:span.end].transpose(0, 1).unsqueeze(0)
            vs = v[span.start:span.end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        else:
            _, kv_heads, _, head_dim = cache.v.shape
            rows = span.rows(kv_heads)
            ks = cache_rows(cache, rows, q.dtype, keys=True).view(1, kv_heads, -1, head_dim)[:, :, : span.context_len]
            vs = cache_rows(cache, rows, q.dtype, keys=False).view(1, kv_heads, -1, head_dim)[:, :, : span.context_len]
            causal = span.mask is None  # only a quantized cache's whole prompt comes here without a mask
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=span.mask, is_causal=causal, scale=scale,
                                               enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)


def decode_attention_reference(q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Decode attention in PyTorch: gather every decode sequence's blocks head by head into
    [S, kv_heads, T, D], then two batched matmuls; GQA groups share their K/V head without repeating it."""
    _, kv_heads, _, head_dim = cache.v.shape
    seqs = meta.decode_tables()[0].shape[0]
    rows = meta.decode_rows(kv_heads)
    keys = cache_rows(cache, rows, q.dtype, keys=True).view(seqs, kv_heads, -1, head_dim)
    values = cache_rows(cache, rows, q.dtype, keys=False).view(seqs, kv_heads, -1, head_dim)
    qd = q.reshape(seqs, kv_heads, -1, head_dim)
    scores = torch.matmul(qd, keys.transpose(-1, -2)).float() * scale + meta.decode_bias
    probs = scores.softmax(dim=-1).to(q.dtype)
    return torch.matmul(probs, values).view(seqs, -1, head_dim)


def cache_rows(cache: KVCache, rows: torch.Tensor, dtype: torch.dtype, keys: bool) -> torch.Tensor:
    """K (or V) rows of ``rows`` (:func:`gather_rows`) in ``dtype``, dequantized from a quantized cache."""
    pool, scales = (cache.k, cache.k_scale) if keys else (cache.v, cache.v_scale)
    picked = gather_rows(pool, rows)
    if not cache.quantized:
        return picked
    return kv_quant.dequantize(picked, None if scales is None else kv_quant.gather_scales(scales, rows), dtype)


def gather_rows(pool: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``[len(rows) * block_size, D]``: ``index_select`` copies whole contiguous (block, head) rows,
    far cheaper than fancy indexing. A K pool in key groups (:meth:`KVCache.allocate`) comes back as rows."""
    num_blocks, kv_heads = pool.shape[:2]
    picked = pool.view(num_blocks * kv_heads, -1).index_select(0, rows)
    if pool.dim() == 6:
        _, _, groups, pairs, keys, _ = pool.shape
        return picked.view(-1, groups, pairs, keys, 2).transpose(2, 3).reshape(-1, pairs * 2)
    return picked.view(-1, pool.shape[3])

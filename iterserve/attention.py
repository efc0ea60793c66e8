"""PagedAttention over a block-structured KV cache.

Every layer owns one cache tensor per K and V shaped ``[num_blocks, kv_heads, block_size, head_dim]``.
A sequence's tokens live in the blocks listed in its block table; token ``i`` of a sequence sits in
block ``table[i // block_size]`` at offset ``i % block_size``, i.e. at the flat *slot*
``table[i // block_size] * block_size + i % block_size``. Heads come before offsets inside a block
so that gathering one head's rows of a sequence's blocks, in order, yields that head's K (or V) as
one contiguous ``[context, head_dim]`` matrix, ready for a matmul without any re-layout.

One forward pass carries a flattened batch: first the decode tokens of many sequences (one token
each), then the prompt chunks of prefilling sequences. New K/V are written to their slots, then
attention reads each sequence's blocks only, so its cost follows the context of the sequences in
the batch, never the size of the pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class KVCache:
    """K and V block pools of one layer."""

    k: torch.Tensor  # [num_blocks, kv_heads, block_size, head_dim]
    v: torch.Tensor

    @classmethod
    def allocate(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device | str,
    ) -> "KVCache":
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))


@dataclass
class PrefillSpan:
    """One sequence's prompt chunk inside the flattened batch."""

    start: int  # index of the chunk's first token in the flattened batch
    end: int
    context_len: int  # tokens in the cache after this step (cached prefix + this chunk)
    block_table: torch.Tensor  # [num_blocks_of_seq] block ids covering context_len
    mask: torch.Tensor | None = None  # [chunk, context_len] bool, None when the chunk starts at 0
    _rows: torch.Tensor | None = field(default=None, repr=False)

    def rows(self, kv_heads: int) -> torch.Tensor:
        """Cache rows to gather for this sequence (computed once per step, shared by all layers)."""
        if self._rows is None:
            self._rows = _head_rows(self.block_table[None], kv_heads)
        return self._rows

    @property
    def num_cached(self) -> int:
        return self.context_len - (self.end - self.start)


@dataclass
class AttentionMetadata:
    """Where each token of the flattened batch goes and what each sequence may attend to.

    Built once per step by the model runner and shared by all layers.
    """

    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of every new token
    slot_blocks: torch.Tensor  # [num_tokens] its block (slot // block_size)
    slot_offsets: torch.Tensor  # [num_tokens] its offset in the block (slot % block_size)
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks]
    decode_bias: torch.Tensor | None = None  # [num_decodes, 1, 1, max_blocks * block_size]: 0 or -inf
    prefills: list[PrefillSpan] = field(default_factory=list)
    _decode_rows: torch.Tensor | None = field(default=None, repr=False)

    def decode_rows(self, kv_heads: int) -> torch.Tensor:
        """Cache rows to gather for the decode sequences (computed once per step, for all layers)."""
        if self._decode_rows is None:
            self._decode_rows = _head_rows(self.decode_block_tables, kv_heads)
        return self._decode_rows

    @classmethod
    def build(
        cls,
        *,
        block_size: int,
        block_tables: list[list[int]],
        num_cached: list[int],
        query_lens: list[int],
        device: torch.device | str = "cpu",
        sliding_window: int | None = None,
    ) -> "AttentionMetadata":
        """Describe a batch of sequences; decode sequences (query length 1) must come first.

        ``num_cached[i]`` tokens of sequence ``i`` are already in its blocks; this step adds
        ``query_lens[i]`` more.
        """
        blocks: list[int] = []
        offsets: list[int] = []
        for table, cached, qlen in zip(block_tables, num_cached, query_lens):
            for pos in range(cached, cached + qlen):
                blocks.append(table[pos // block_size])
                offsets.append(pos % block_size)
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1 and num_cached[num_decodes] > 0:
            num_decodes += 1
        blocks_t = torch.tensor(blocks, dtype=torch.long)
        offsets_t = torch.tensor(offsets, dtype=torch.long)
        meta = cls(
            slot_mapping=(blocks_t * block_size + offsets_t).to(device), slot_blocks=blocks_t.to(device),
            slot_offsets=offsets_t.to(device), num_decode_tokens=num_decodes,
        )
        if num_decodes:
            ctx = [num_cached[i] + 1 for i in range(num_decodes)]
            max_blocks = max((c + block_size - 1) // block_size for c in ctx)
            tables = torch.zeros((num_decodes, max_blocks), dtype=torch.long)
            for i in range(num_decodes):
                n = (ctx[i] + block_size - 1) // block_size
                tables[i, :n] = torch.tensor(block_tables[i][:n])
            key_pos = torch.arange(max_blocks * block_size)
            ctx_t = torch.tensor(ctx)
            mask = key_pos[None, :] < ctx_t[:, None]
            if sliding_window is not None:
                mask &= key_pos[None, :] > (ctx_t[:, None] - 1 - sliding_window)
            meta.decode_block_tables = tables.to(device)
            bias = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
            meta.decode_bias = bias[:, None, None, :].to(device)
        start = num_decodes
        for i in range(num_decodes, len(query_lens)):
            cached, qlen = num_cached[i], query_lens[i]
            ctx = cached + qlen
            n = (ctx + block_size - 1) // block_size
            mask = None
            if cached > 0 or (sliding_window is not None and ctx > sliding_window):
                q_pos = torch.arange(cached, ctx)[:, None]
                k_pos = torch.arange(ctx)[None, :]
                mask = k_pos <= q_pos
                if sliding_window is not None:
                    mask &= k_pos > q_pos - sliding_window
                mask = mask.to(device)
            meta.prefills.append(
                PrefillSpan(
                    start=start, end=start + qlen, context_len=ctx,
                    block_table=torch.tensor(block_tables[i][:n], dtype=torch.long, device=device),
                    mask=mask,
                )
            )
            start += qlen
        return meta


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,
    cache: KVCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend; returns [num_tokens, num_heads, head_dim]."""
    _, kv_heads, _, head_dim = cache.k.shape
    cache.k[meta.slot_blocks, :, meta.slot_offsets] = k
    cache.v[meta.slot_blocks, :, meta.slot_offsets] = v
    out = torch.empty_like(q)
    n_dec = meta.num_decode_tokens
    if n_dec:
        # Gather every decode sequence's blocks head by head into [S, kv_heads, T, D], then attend
        # with two batched matmuls; GQA groups share their K/V head without repeating it.
        seqs = meta.decode_block_tables.shape[0]
        rows = meta.decode_rows(kv_heads)
        keys = _gather_rows(cache.k, rows).view(seqs, kv_heads, -1, head_dim)
        values = _gather_rows(cache.v, rows).view(seqs, kv_heads, -1, head_dim)
        qd = q[:n_dec].view(seqs, kv_heads, -1, head_dim)
        scores = torch.matmul(qd, keys.transpose(-1, -2)).float() * scale + meta.decode_bias
        probs = scores.softmax(dim=-1).to(q.dtype)
        out[:n_dec] = torch.matmul(probs, values).view(n_dec, -1, head_dim)
    for span in meta.prefills:
        qs = q[span.start:span.end].transpose(0, 1).unsqueeze(0)  # [1, H, chunk, D]
        if span.num_cached == 0 and span.mask is None:
            # The whole prompt is in this chunk: attend to the fresh K/V directly, causally.
            ks = k[span.start:span.end].transpose(0, 1).unsqueeze(0)
            vs = v[span.start:span.end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        else:
            rows = span.rows(kv_heads)
            ks = _gather_rows(cache.k, rows).view(1, kv_heads, -1, head_dim)[:, :, : span.context_len]
            vs = _gather_rows(cache.v, rows).view(1, kv_heads, -1, head_dim)[:, :, : span.context_len]
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=span.mask, scale=scale, enable_gqa=True)
        out[span.start:span.end] = o.squeeze(0).transpose(0, 1)
    return out


def _head_rows(tables: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Pool rows (one per block and head) for block tables ``[S, n]``, ordered (sequence, head, block)
    so that each head's rows of a sequence form its K or V as one ``[n * block_size, D]`` matrix."""
    heads = torch.arange(kv_heads, device=tables.device)
    return (tables[:, None, :] * kv_heads + heads[None, :, None]).reshape(-1)


def _gather_rows(pool: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``[len(rows) * block_size, D]``: ``index_select`` copies whole contiguous (block, head) rows,
    far cheaper than fancy indexing."""
    num_blocks, kv_heads, block_size, head_dim = pool.shape
    return pool.view(num_blocks * kv_heads, -1).index_select(0, rows).view(-1, head_dim)

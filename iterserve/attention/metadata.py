"""The paged KV cache and each step's attention metadata: where every new token's K/V goes and what each
sequence may attend to.

Every layer owns one cache tensor per K and V shaped ``[num_blocks, kv_heads, block_size, head_dim]``.
A sequence's tokens live in the blocks listed in its block table; token ``i`` of a sequence sits in
block ``table[i // block_size]`` at offset ``i % block_size``, i.e. at the flat *slot*
``table[i // block_size] * block_size + i % block_size``. Heads come before offsets inside a block
so that gathering one head's rows of a sequence's blocks, in order, yields that head's K (or V) as
one contiguous ``[context, head_dim]`` matrix, ready for a matmul without any re-layout.

One forward pass carries a flattened batch: first the decode tokens of many sequences (one token
each), then the prompt chunks of prefilling sequences. New K/V are written to their slots, then
attention reads each sequence's blocks only, so its cost follows the context of the sequences in
the batch, never the size of the pool. How attention is computed over this layout is a backend's job
(:mod:`iterserve.attention.backend`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from iterserve.attention import kv_quant
from iterserve.config.kv_cache import canonical_kv_cache_dtype
from iterserve.platforms import huge_pages


@dataclass
class KVCache:
    """K and V block pools of one layer; under a quantized ``kv_dtype`` (:mod:`iterserve.config.kv_cache`) the
    pools hold float8 or int8 values, and int8 one float16 scale per (block, head, offset) for each."""

    k: torch.Tensor  # [num_blocks, kv_heads, block_size, head_dim], or in key groups (see allocate)
    v: torch.Tensor  # [num_blocks, kv_heads, block_size, head_dim]
    kv_dtype: str = "auto"  # canonical kv_cache_dtype: auto, fp8_e4m3, fp8_e5m2 or int8
    k_scale: torch.Tensor | None = None  # int8: [num_blocks, kv_heads, block_size] float16
    v_scale: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.kv_dtype != "auto"

    @classmethod
    def allocate(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device | str, keys_in_groups: bool = False, kv_dtype: str = "auto",
    ) -> KVCache:
        """``keys_in_groups`` lays K out as ``[num_blocks, kv_heads, block_size / 16, head_dim / 2, 16, 2]``: each 16
        keys of a block's head hold their dimension pairs side by side, as the CPU kernels' bf16 dot products
        read them (``ops.keys_in_groups`` says where); a quantized cache keeps K in rows. ``dtype`` is the
        model's; a quantized ``kv_dtype`` stores its own."""
        kv_dtype = canonical_kv_cache_dtype(kv_dtype)
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        grouped = keys_in_groups and kv_dtype == "auto"
        k_shape = (num_blocks, num_kv_heads, block_size // 16, head_dim // 2, 16, 2) if grouped else shape
        store = dtype if kv_dtype == "auto" else kv_quant.storage_dtype(kv_dtype)
        on_cpu = torch.device(device).type == "cpu"

        def pool(pool_shape: tuple[int, ...], pool_dtype: torch.dtype) -> torch.Tensor:
            if on_cpu:  # each decode streams its blocks: on 2 MiB pages
                return huge_pages.empty(pool_shape, pool_dtype)
            return torch.zeros(pool_shape, dtype=pool_dtype, device=device)

        if kv_dtype != "int8":
            return cls(pool(k_shape, store), pool(shape, store), kv_dtype)
        return cls(pool(k_shape, store), pool(shape, store), kv_dtype, pool(shape[:3], torch.float16),
                   pool(shape[:3], torch.float16))

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Blocks ``src`` into blocks ``dst``, scales included."""
        self.k[dst] = self.k[src]
        self.v[dst] = self.v[src]
        if self.k_scale is not None and self.v_scale is not None:
            self.k_scale[dst] = self.k_scale[src]
            self.v_scale[dst] = self.v_scale[src]


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
    block_size: int = 16
    sliding_window: int | None = None
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks]
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] int64, tokens to attend to (incl. the new one)
    prefills: list[PrefillSpan] = field(default_factory=list)
    _seq_lens: np.ndarray | None = field(default=None, repr=False)  # per token: see token_seq_lens
    _decode_rows: torch.Tensor | None = field(default=None, repr=False)
    _by_window: dict[int | None, AttentionMetadata] = field(default_factory=dict, repr=False)
    # hybrid SWA memory: this step's metadata over the windowed layers' own pool and tables, given a window
    _window_pool: Callable[..., AttentionMetadata] | None = field(default=None, repr=False)

    def decode_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode sequences' block tables and context lengths (built whenever a step has decodes)."""
        assert self.decode_block_tables is not None and self.decode_context_lens is not None, "no decodes"
        return self.decode_block_tables, self.decode_context_lens

    def decode_rows(self, kv_heads: int) -> torch.Tensor:
        """Cache rows to gather for the decode sequences (computed once per step, for all layers)."""
        if self._decode_rows is None:
            self._decode_rows = _head_rows(self.decode_tables()[0], kv_heads)
        return self._decode_rows

    @functools.cached_property
    def token_seq_lens(self) -> torch.Tensor:
        """``[num_tokens]`` int64: the sequence length by which each token is rotated (Phi-3's longrope picks its
        factors by it): a prompt token's, its whole prompt, however the prompt is chunked; a later token's, its
        position + 1, as when decoded alone (drafts verified together included)."""
        assert self._seq_lens is not None, "metadata built without sequence lengths"
        return torch.from_numpy(self._seq_lens).to(self.slot_mapping.device)

    def with_window(self, window: int | None) -> AttentionMetadata:
        """This step's metadata for a layer attending to the last ``window`` positions (all of them when None):
        models whose layers differ in window (Gemma 3's local and global layers) pass each layer its own.

        Built once per window and step, then shared by the layers with that window; slots, tables and rows
        are the same objects, only the masks differ, except where the windowed layers keep their K/V in a pool
        of their own (``window_tables`` given to :meth:`build`): their slots and tables are that pool's.
        """
        if window is not None and self._window_pool is not None:
            if window not in self._by_window:
                self._by_window[window] = self._window_pool(sliding_window=window)
            return self._by_window[window]
        if window == self.sliding_window:
            return self
        if window not in self._by_window:
            spans = [dataclasses.replace(s, mask=_chunk_mask(s.num_cached, s.context_len, window, s.block_table.device))
                     for s in self.prefills]
            self._by_window[window] = dataclasses.replace(self, sliding_window=window, prefills=spans, _by_window={})
        return self._by_window[window]

    @functools.cached_property
    def decode_bias(self) -> torch.Tensor:
        """``[num_decodes, 1, 1, max_blocks * block_size]``: 0 where a decode may attend, -inf elsewhere
        (the reference path's mask; the fused kernel reads the context lengths instead)."""
        tables, ctx = self.decode_tables()
        key_pos = torch.arange(tables.shape[1] * self.block_size, device=ctx.device)
        mask = key_pos[None, :] < ctx[:, None]
        if self.sliding_window is not None:
            mask &= key_pos[None, :] > (ctx[:, None] - 1 - self.sliding_window)
        bias = torch.zeros(mask.shape, device=ctx.device).masked_fill_(~mask, float("-inf"))
        return bias[:, None, None, :]

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
        max_decode_query: int = 1,
        decode_prompts_up_to: int = 0,
        window_tables: list[list[int]] | None = None,
        prompt_lens: list[int] | None = None,
    ) -> AttentionMetadata:
        """Describe a batch of sequences; decode sequences (query length 1) must come first.

        ``num_cached[i]`` tokens of sequence ``i`` are already in its blocks; this step adds
        ``query_lens[i]`` more. Slots and tables come from whole-array numpy ops, not a Python loop
        per token: the per-token loop cost 1-2 ms on a 2k-token prefill step.

        Sequences with cached context and at most ``max_decode_query`` new tokens (speculative
        decoding's verifications, placed right after the decodes) are attended as one decode per
        token, each over its own prefix: all of the step's K/V is written before attention reads it,
        so the batched decode path serves them, where a masked attention call per sequence would cost a
        call per sequence per layer. Prompt chunks of sequences
        that hold at most ``decode_prompts_up_to`` tokens after the step are attended the same way (a
        backend whose decode kernel beats its prefill path on short contexts asks for it), as long as
        only such sequences come before them. ``window_tables`` are the sequences' tables in the windowed
        layers' pool (hybrid SWA memory), which :meth:`with_window` serves those layers. ``prompt_lens`` (each
        sequence's whole prompt; by default what it holds after the step) set :attr:`token_seq_lens`.
        """
        cached = np.asarray(num_cached, dtype=np.int64)
        qlens = np.asarray(query_lens, dtype=np.int64)
        width = max(len(t) for t in block_tables)
        tables = np.array([t + [0] * (width - len(t)) for t in block_tables], dtype=np.int64).reshape(-1, width)
        seq_of_token = np.repeat(np.arange(len(qlens)), qlens)
        token_starts = np.cumsum(qlens) - qlens
        pos = cached[seq_of_token] + np.arange(len(seq_of_token)) - token_starts[seq_of_token]
        blocks = tables[seq_of_token, pos // block_size]
        offsets = pos % block_size
        is_decode = ((qlens <= max_decode_query) & (cached > 0)) | (cached + qlens <= decode_prompts_up_to)
        num_decode_seqs = int(np.cumprod(is_decode).sum())
        num_decodes = int(qlens[:num_decode_seqs].sum())  # decode rows: one per token of those sequences
        rotated = cached + qlens if prompt_lens is None else np.asarray(prompt_lens, dtype=np.int64)
        meta = cls(
            slot_mapping=torch.from_numpy(blocks * block_size + offsets).to(device),
            slot_blocks=torch.from_numpy(blocks).to(device), slot_offsets=torch.from_numpy(offsets).to(device),
            block_size=block_size, sliding_window=sliding_window, num_decode_tokens=num_decodes,
            _seq_lens=np.maximum(rotated[seq_of_token], pos + 1),
        )
        if window_tables is not None:
            meta._window_pool = functools.partial(
                cls.build, block_size=block_size, block_tables=window_tables, num_cached=num_cached,
                query_lens=query_lens, device=device, max_decode_query=max_decode_query,
                decode_prompts_up_to=decode_prompts_up_to, prompt_lens=prompt_lens)
        if num_decodes:
            ctx = pos[:num_decodes] + 1
            max_blocks = int((ctx.max() + block_size - 1) // block_size)
            decode_tables = np.ascontiguousarray(tables[seq_of_token[:num_decodes], :max_blocks])
            meta.decode_block_tables = torch.from_numpy(decode_tables).to(device)
            meta.decode_context_lens = torch.from_numpy(ctx).to(device)
        start = num_decodes
        for i in range(num_decode_seqs, len(query_lens)):
            cached_i, qlen = num_cached[i], query_lens[i]
            ctx_i = cached_i + qlen
            n = (ctx_i + block_size - 1) // block_size
            meta.prefills.append(
                PrefillSpan(
                    start=start, end=start + qlen, context_len=ctx_i,
                    block_table=torch.from_numpy(tables[i, :n].copy()).to(device),
                    mask=_chunk_mask(cached_i, ctx_i, sliding_window, device),
                )
            )
            start += qlen
        return meta


def _chunk_mask(num_cached: int, context_len: int, window: int | None,
                device: torch.device | str) -> torch.Tensor | None:
    """``[chunk, context_len]``: which keys each query of a prompt chunk attends to (causal, within ``window``);
    None when the chunk is a whole prompt that plain causal attention serves."""
    if num_cached == 0 and (window is None or context_len <= window):
        return None
    q_pos = torch.arange(num_cached, context_len)[:, None]
    k_pos = torch.arange(context_len)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask.to(device)


def _head_rows(tables: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Pool rows (one per block and head) for block tables ``[S, n]``, ordered (sequence, head, block)
    so that each head's rows of a sequence form its K or V as one ``[n * block_size, D]`` matrix."""
    heads = torch.arange(kv_heads, device=tables.device)
    return (tables[:, None, :] * kv_heads + heads[None, :, None]).reshape(-1)

"""A draft model: a small model with the target's vocabulary that proposes the next k tokens.

Its KV cache is paged like the target's and indexed by the same block tables, so the one block
manager serves both: a sequence's block holds the target's and the draft's K/V of the same tokens,
prefix-cache hits, copy-on-write and preemption apply to both at once, and the KV pool's size
counts both per token. The draft runs over every token the target computes, in the same slots
(:meth:`DraftModel.mirror`, after each forward pass), so it is never behind; then, for each decoding
sequence, k single-token passes from the sequence's newest token draft k tokens by argmax
(:meth:`DraftModel.propose`). Those passes write the draft's K/V past the sequence's computed
tokens, into blocks allocated ahead for the verification step that follows; a verification then
rewrites every one of those slots in both caches.
"""

from __future__ import annotations

import logging

import torch

from iterserve.attention import AttentionBackend, AttentionMetadata, KVCache
from iterserve.engine.sampler import argmax_rows
from iterserve.engine.sequence import Sequence
from iterserve.models.llama import LlamaModel
from iterserve.models.loader import LoadedModel, load_model
from iterserve.models.native_decoder import NativeDecoder

logger = logging.getLogger(__name__)


def load_draft(name: str, target: LoadedModel, seed: int, quantization: str | None = None) -> LoadedModel:
    """Load the draft ``name`` beside ``target`` (same device and dtype; its weights kept in ``quantization``'s
    blocks if given); it must share the vocabulary."""
    draft = load_model(name, target.model.dtype, target.model.device, seed, quantization=quantization)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"draft model {name!r} has a vocabulary of {draft.config.vocab_size} tokens and the target "
                         f"{target.config.vocab_size}: a draft model must use the target's tokenizer")
    logger.info("speculative decoding: draft model %s (%.0fM parameters%s)", name,
                draft.config.num_parameters() / 1e6, f", {quantization} weights" if quantization else "")
    return draft


def copy_kv_blocks(caches: list[KVCache], copies: list[tuple[int, int]], device: torch.device) -> None:
    """Copy whole KV blocks (source, destination) in every layer: a sequence's private copy of a shared block."""
    if not copies:
        return
    src = torch.tensor([c[0] for c in copies], dtype=torch.long, device=device)
    dst = torch.tensor([c[1] for c in copies], dtype=torch.long, device=device)
    for cache in caches:
        cache.copy_blocks(src, dst)


class DraftModel:
    """The draft's weights and its KV cache, as many blocks of the same size as the target's."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, backend: AttentionBackend,
                 kv_cache_dtype: str = "auto", decoder: NativeDecoder | None = None) -> None:
        self.model = model
        self.backend = backend  # the target's: both models run on one device
        self.decoder = decoder  # the target's native decode loop, if it has one
        self.block_size = block_size
        self.kv_caches = model.allocate_kv_cache(num_blocks, block_size, backend, kv_cache_dtype)

    def _meta(self, block_tables: list[list[int]], num_cached: list[int], query_lens: list[int],
              max_decode_query: int = 1) -> AttentionMetadata:
        return AttentionMetadata.build(block_size=self.block_size, block_tables=block_tables, num_cached=num_cached,
                                       query_lens=query_lens, device=self.model.device,
                                       sliding_window=self.model.config.sliding_window,
                                       max_decode_query=max_decode_query,
                                       decode_prompts_up_to=self.backend.decode_prompts_up_to)

    @torch.inference_mode()
    def mirror(self, input_ids: torch.Tensor, positions: torch.Tensor, block_tables: list[list[int]],
               num_cached: list[int], query_lens: list[int], max_decode_query: int) -> None:
        """Write the draft's K/V for the step's tokens (the target's inputs) into the slots the target just wrote."""
        self.model(input_ids, positions, self.kv_caches,
                   self._meta(block_tables, num_cached, query_lens, max_decode_query),
                   self.backend, torch.empty(0, dtype=torch.long, device=self.model.device), decoder=self.decoder)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """Up to ``limits[i]`` tokens for each sequence, one batched pass per draft position. Each
        sequence's block table must cover its tokens plus ``limits[i] - 1`` more."""
        dev = self.model.device
        drafts: list[list[int]] = [[] for _ in seqs]
        last = [seq.token_ids[-1] for seq in seqs]
        for j in range(max(limits, default=0)):
            active = [i for i, limit in enumerate(limits) if limit > j]
            positions = [seqs[i].num_tokens - 1 + j for i in active]
            logits = self.model(torch.tensor([last[i] for i in active], dtype=torch.long, device=dev),
                                torch.tensor(positions, dtype=torch.long, device=dev), self.kv_caches,
                                self._meta([seqs[i].block_table for i in active], positions, [1] * len(active)),
                                self.backend, torch.arange(len(active), device=dev), decoder=self.decoder)
            for i, token in zip(active, argmax_rows(logits).tolist()):
                drafts[i].append(token)
                last[i] = token
        return drafts

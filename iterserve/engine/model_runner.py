"""Turns a scheduler decision into one forward pass and one sampling call.

It owns the model and the KV cache tensors; the block manager owns the bookkeeping of which
blocks belong to whom. Here the scheduled sequences are flattened into one token batch with
positions, slot mapping and block tables, and logits are taken only for sequences whose last
token was computed in this step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

import torch

from iterserve.attention import AttentionMetadata, KVCache
from iterserve.engine.scheduler import ScheduledSeq
from iterserve.models.llama import LlamaModel
from iterserve.sampler import Sampler, SampleResult, SamplingRow, bitmask_words


logger = logging.getLogger(__name__)


@functools.cache
def keep_freed_memory_in_process() -> bool:
    """Stop glibc from returning large freed buffers to the OS.

    A step allocates the same large activations and gathered K/V every time; by default glibc
    serves them with fresh mmaps and unmaps them on free, so every step pays page faults for tens of
    megabytes (measured: a 256-sequence decode step took twice as long). Keeping the heap makes the
    allocations reuse warm pages, the effect TCMalloc has for other CPU inference servers.
    """
    libc_name = ctypes.util.find_library("c")
    if not libc_name:
        return False
    try:
        libc = ctypes.CDLL(libc_name)
        m_trim_threshold, m_mmap_max = -1, -4
        return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))
    except (OSError, AttributeError):  # not glibc
        logger.debug("mallopt unavailable; CPU steps will pay page faults on large buffers")
        return False


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.model = model
        self.device = model.device
        if self.device.type == "cpu":
            keep_freed_memory_in_process()
        self.block_size = block_size
        self.kv_caches: list[KVCache] = model.allocate_kv_cache(num_blocks, block_size)
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(seed))

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], SampleResult]:
        """Run one step. Returns the sequences that produced a token (in order) and the samples."""
        input_ids: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []
        sampled: list[ScheduledSeq] = []
        for s in scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_tokens
            n_prompt = len(seq.prompt_token_ids)
            if start >= n_prompt:
                input_ids.extend(seq.output_token_ids[start - n_prompt:end - n_prompt])
            else:
                input_ids.extend((seq.prompt_token_ids + seq.output_token_ids)[start:end])
            positions.extend(range(start, end))
            if end == seq.num_tokens:
                logits_rows.append(len(input_ids) - 1)
                sampled.append(s)
        meta = AttentionMetadata.build(
            block_size=self.block_size,
            block_tables=[s.seq.block_table for s in scheduled],
            num_cached=[s.seq.num_computed_tokens for s in scheduled],
            query_lens=[s.num_tokens for s in scheduled],
            device=self.device,
            sliding_window=self.model.config.sliding_window,
        )
        dev = self.device
        bitmask = self._grammar_bitmask(sampled)
        logits = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv_caches,
            meta,
            torch.tensor(logits_rows, dtype=torch.long, device=dev),
        )
        rows = [
            SamplingRow(s.seq.params, s.seq.prompt_token_ids, s.seq.output_token_ids, s.seq.stop_ids, s.seq.generator,
                        None if s.seq.grammar is None or bitmask is None else bitmask[i])
            for i, s in enumerate(sampled)
        ]
        result = self.sampler(logits, rows) if rows else SampleResult([], [])
        return sampled, result

    def _grammar_bitmask(self, sampled: list[ScheduledSeq]) -> torch.Tensor | None:
        """The tokens each constrained sequence's grammar allows next, one packed row per sampled
        sequence (rows of unconstrained ones are left unused); None when no sequence has a grammar."""
        if all(s.seq.grammar is None for s in sampled):
            return None
        bitmask = torch.zeros(len(sampled), bitmask_words(self.model.config.vocab_size), dtype=torch.int32)
        for i, s in enumerate(sampled):
            if s.seq.grammar is not None:
                s.seq.grammar.fill_bitmask(bitmask, i, s.seq.stop_ids)
        return bitmask

"""Turns a scheduler decision into one forward pass and one sampling call.

It owns the model and the KV cache tensors; the block manager owns the bookkeeping of which
blocks belong to whom. Here the scheduled sequences are flattened into one token batch with
positions, slot mapping and block tables, and logits are taken only for sequences whose last
token was computed in this step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from iterserve.attention import AttentionMetadata, KVCache, select_backend
from iterserve.engine.sampler import Sampler, SampleResult, SamplingRow, bitmask_words, token_logprobs
from iterserve.engine.scheduler import ScheduledSeq, sampling_seqs
from iterserve.engine.sequence import Sequence
from iterserve.models.llama import LlamaModel


@dataclass
class StepInputs:
    """Everything one forward pass needs, as plain lists: what rank 0 broadcasts to the tensor-parallel
    workers, each of which rebuilds the attention metadata from it."""

    input_ids: list[int]
    positions: list[int]
    block_tables: list[list[int]]
    num_cached: list[int]
    query_lens: list[int]
    logits_rows: list[int]  # sampling rows first, then prompt-logprob rows
    block_copies: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class PreparedStep:
    """One step's inputs and what sampling needs once the logits are back."""

    inputs: StepInputs
    scheduled: list[ScheduledSeq]
    sampled: list[ScheduledSeq]  # the sequences that produce a token, in order
    seqs: list[Sequence]  # one per sampling row (a forking parent is followed by its children)
    num_sampling: int  # logits rows of sampled tokens; prompt-logprob rows follow
    prompt_spans: list[tuple[int, int, int, int]]  # (scheduled index, first row, first token, count)
    bitmask: torch.Tensor | None  # the grammars' allowed tokens, one row per sampling sequence


class ModelRunner:
    """Owns this rank's model and KV cache tensors; one step is :meth:`prepare` (rank 0), :meth:`forward`
    (every rank) and :meth:`sample` (rank 0), which :meth:`execute` runs in a row in one process."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.kv_caches: list[KVCache] = model.allocate_kv_cache(num_blocks, block_size)
        self.attn_backend = select_backend(self.device)  # chosen once; passed to the model with each step
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(seed))

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq],
                block_copies: list[tuple[int, int]] | None = None) -> tuple[list[ScheduledSeq], SampleResult]:
        """Run one step. Returns the sequences that produced a token (in order) and the samples."""
        prepared = self.prepare(scheduled, block_copies)
        return prepared.sampled, self.sample(prepared, self.forward(prepared.inputs))

    @torch.inference_mode()
    def prepare(self, scheduled: list[ScheduledSeq], block_copies: list[tuple[int, int]] | None = None) -> PreparedStep:
        """Flatten the scheduled sequences into one step's inputs.

        ``block_copies`` (copy-on-write of blocks shared by forked sequences) are done first. A
        sequence that forks now is followed in the samples by its children, each drawing from the
        same logits row. Prompt positions of requests that asked for prompt logprobs get logits too.
        """
        input_ids: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []  # sampling rows first, then prompt-logprob rows
        sampled: list[ScheduledSeq] = []
        prompt_spans: list[tuple[int, int, int, int]] = []  # (scheduled index, first row, first token, count)
        for k, s in enumerate(scheduled):
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_tokens
            n_prompt = len(seq.prompt_token_ids)
            first_row = len(input_ids)
            if start >= n_prompt:
                input_ids.extend(seq.output_token_ids[start - n_prompt:end - n_prompt])
            else:
                input_ids.extend((seq.prompt_token_ids + seq.output_token_ids)[start:end])
            positions.extend(range(start, end))
            if end == seq.num_tokens:
                logits_rows.extend([len(input_ids) - 1] * (1 + len(seq.forks)))
                sampled.append(s)
            if seq.params.prompt_logprobs is not None and seq.index == 0 and start < n_prompt - 1 \
                    and len(seq.prompt_logprobs) < n_prompt:  # not again when recomputed after preemption
                # position j predicts prompt token j + 1
                prompt_spans.append((k, first_row, start + 1, min(end, n_prompt - 1) - start))
        num_sampling = len(logits_rows)
        for _, first_row, _, count in prompt_spans:
            logits_rows.extend(range(first_row, first_row + count))
        inputs = StepInputs(
            input_ids, positions, [list(s.seq.block_table) for s in scheduled],
            [s.seq.num_computed_tokens for s in scheduled], [s.num_tokens for s in scheduled], logits_rows,
            list(block_copies or []),
        )
        seqs = sampling_seqs(scheduled)
        return PreparedStep(inputs, scheduled, sampled, seqs, num_sampling, prompt_spans, self._grammar_bitmask(seqs))

    @torch.inference_mode()
    def sample(self, prepared: PreparedStep, logits: torch.Tensor) -> SampleResult:
        """Sample each sampling row, then take the prompt logprobs asked for."""
        bitmask, num_sampling = prepared.bitmask, prepared.num_sampling
        rows = [
            SamplingRow(seq.params, seq.prompt_token_ids, seq.output_token_ids, seq.stop_ids, seq.generator,
                        None if seq.grammar is None or bitmask is None else bitmask[i])
            for i, seq in enumerate(prepared.seqs)
        ]
        result = self.sampler(logits[:num_sampling], rows) if rows else SampleResult([], [])
        offset = num_sampling
        for k, _, first_token, count in prepared.prompt_spans:
            seq = prepared.scheduled[k].seq
            logprobs = torch.log_softmax(logits[offset:offset + count].float(), dim=-1)
            tokens = seq.prompt_token_ids[first_token:first_token + count]
            result.prompt_logprobs[k] = (first_token, token_logprobs(logprobs, tokens, seq.params.prompt_logprobs or 0))
            offset += count
        return result

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Copy-on-write blocks, then one forward pass; the logits of ``inputs.logits_rows`` (empty on a
        tensor-parallel worker)."""
        self.copy_blocks(inputs.block_copies)
        meta = AttentionMetadata.build(
            block_size=self.block_size, block_tables=inputs.block_tables, num_cached=inputs.num_cached,
            query_lens=inputs.query_lens, device=self.device, sliding_window=self.model.config.sliding_window,
        )
        dev = self.device
        return self.model(
            torch.tensor(inputs.input_ids, dtype=torch.long, device=dev),
            torch.tensor(inputs.positions, dtype=torch.long, device=dev),
            self.kv_caches,
            meta,
            self.attn_backend,
            torch.tensor(inputs.logits_rows, dtype=torch.long, device=dev),
        )

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks, every layer: a forked sequence's private copy of a shared block."""
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([c[1] for c in copies], dtype=torch.long, device=self.device)
        for cache in self.kv_caches:
            cache.k[dst] = cache.k[src]
            cache.v[dst] = cache.v[src]

    def _grammar_bitmask(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """The tokens each constrained sequence's grammar allows next, one packed row per sampling
        sequence (rows of unconstrained ones are left unused); None when no sequence has a grammar."""
        if all(seq.grammar is None for seq in seqs):
            return None
        bitmask = torch.zeros(len(seqs), bitmask_words(self.model.config.vocab_size), dtype=torch.int32)
        for i, seq in enumerate(seqs):
            if seq.grammar is not None:
                seq.grammar.fill_bitmask(bitmask, i, seq.stop_ids)
        return bitmask

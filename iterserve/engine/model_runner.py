"""Turns a scheduler decision into one forward pass and one sampling call.

It owns the model and the KV cache tensors; the block manager owns the bookkeeping of which
blocks belong to whom. Here the scheduled sequences are flattened into one token batch with
positions, slot mapping and block tables, and logits are taken only for sequences whose last
token was computed in this step: at that token, and at each of its draft tokens when it verifies
some (a verification is a short prompt-like chunk over the sequence's cached context).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from iterserve.attention import AttentionMetadata, KVCache, select_backend
from iterserve.engine.sampler import Sampler, SampleResult, SamplingRow, bitmask_words, token_logprobs
from iterserve.engine.scheduler import ScheduledSeq, sampling_seqs
from iterserve.engine.sequence import Sequence
from iterserve.engine.spec_decode.draft import DraftModel, copy_kv_blocks
from iterserve.lora.manager import LoRAManager
from iterserve.lora.request import LoRARequest
from iterserve.models.llama import LlamaModel
from iterserve.models.native_decoder import NativeDecoder


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
    max_decode_query: int = 1  # 1 + the most drafts a sequence verifies: those are attended like decodes
    loras: list[LoRARequest | None] = field(default_factory=list)  # per scheduled sequence, its adapter if any
    window_tables: list[list[int]] | None = None  # the windowed layers' tables, with hybrid SWA memory
    window_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write in that pool
    prompt_lens: list[int] | None = None  # per scheduled sequence (Phi-3's longrope rotates a prompt by its length)


@dataclass
class PreparedStep:
    """One step's inputs and what sampling needs once the logits are back."""

    inputs: StepInputs
    scheduled: list[ScheduledSeq]
    sampled: list[ScheduledSeq]  # the sequences that produce a token, in order
    seqs: list[Sequence]  # the sampling sequences (a forking parent is followed by its children)
    drafts: list[list[int]]  # per sampling sequence, the drafts it verifies (each adds a logits row)
    num_sampling: int  # logits rows of sampled tokens; prompt-logprob rows follow
    prompt_spans: list[tuple[int, int, int, int]]  # (scheduled index, first row, first token, count)
    bitmask: torch.Tensor | None  # the grammars' allowed tokens, one row per sampling sequence


class ModelRunner:
    """Owns this rank's model and KV cache tensors; one step is :meth:`prepare` (rank 0), :meth:`forward`
    (every rank) and :meth:`sample` (rank 0), which :meth:`execute` runs in a row in one process."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, seed: int = 0,
                 draft: LlamaModel | None = None, kv_cache_dtype: str = "auto",
                 lora: LoRAManager | None = None, window_blocks: int = 0) -> None:
        """``window_blocks``: the sliding-window layers' own pool (hybrid SWA memory; 0: they share the pool)."""
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.attn_backend = select_backend(self.device, model.dtype)  # chosen once; passed to the model each step
        self.decoder = NativeDecoder.for_device(self.device)  # a step of decodes in one C++ call, where it can
        self.kv_caches: list[KVCache] = model.allocate_kv_cache(num_blocks, block_size, self.attn_backend,
                                                                kv_cache_dtype, window_blocks)
        windowed = [bool(window_blocks) and w is not None for w in model.config.layer_windows()]
        self.window_caches = [c for c, w in zip(self.kv_caches, windowed) if w]  # in the windowed layers' pool
        self.full_caches = [c for c, w in zip(self.kv_caches, windowed) if not w]  # in the full pool
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(seed))
        self.draft = (DraftModel(draft, num_blocks, block_size, self.attn_backend, kv_cache_dtype, self.decoder)
                      if draft is not None else None)
        self.lora = lora  # the loaded LoRA adapters (None: LoRA is off)
        self._forward_start = 0.0  # when the last forward pass began: a grammar's step budget is relative to it

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], block_copies: list[tuple[int, int]] | None = None,
                window_copies: list[tuple[int, int]] | None = None) -> tuple[list[ScheduledSeq], SampleResult]:
        """Run one step. Returns the sequences that produced a token (in order) and the samples."""
        prepared = self.prepare(scheduled, block_copies, window_copies)
        return prepared.sampled, self.sample(prepared, self.forward(prepared.inputs))

    @torch.inference_mode()
    def prepare(self, scheduled: list[ScheduledSeq], block_copies: list[tuple[int, int]] | None = None,
                window_copies: list[tuple[int, int]] | None = None) -> PreparedStep:
        """Flatten the scheduled sequences into one step's inputs.

        ``block_copies`` and ``window_copies`` (copy-on-write of blocks shared by forked sequences, in the
        full and the windowed layers' pools) are done first. A
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
            end = start + s.num_tokens - len(s.spec_token_ids)  # the sequence's own tokens; drafts follow
            n_prompt = len(seq.prompt_token_ids)
            first_row = len(input_ids)
            if start >= n_prompt:
                input_ids.extend(seq.output_token_ids[start - n_prompt:end - n_prompt])
            else:
                input_ids.extend((seq.prompt_token_ids + seq.output_token_ids)[start:end])
            input_ids.extend(s.spec_token_ids)
            positions.extend(range(start, start + s.num_tokens))
            if end == seq.num_tokens:
                if s.spec_token_ids:  # its last token's row, then one per draft
                    logits_rows.extend(range(len(input_ids) - 1 - len(s.spec_token_ids), len(input_ids)))
                else:
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
            list(block_copies or []), 1 + max((len(s.spec_token_ids) for s in scheduled), default=0),
            [s.seq.lora for s in scheduled] if self.lora is not None else [],
            [list(s.seq.window_table) for s in scheduled] if self.window_caches else None, list(window_copies or []),
            [len(s.seq.prompt_token_ids) for s in scheduled],
        )
        seqs = sampling_seqs(scheduled)
        drafts = [s.spec_token_ids for s in sampled for _ in range(1 + len(s.seq.forks))]
        return PreparedStep(inputs, scheduled, sampled, seqs, drafts, num_sampling, prompt_spans,
                            self._grammar_bitmask(seqs))

    @torch.inference_mode()
    def sample(self, prepared: PreparedStep, logits: torch.Tensor) -> SampleResult:
        """Sample each sampling row, then take the prompt logprobs asked for."""
        bitmask, num_sampling = prepared.bitmask, prepared.num_sampling
        rows = [  # a sequence verifying drafts has one row per draft position, its output extended by them
            SamplingRow(seq.params, seq.prompt_token_ids,
                        seq.output_token_ids + drafts[:j] if j else seq.output_token_ids,  # no copy for a plain row
                        seq.stop_ids, seq.generator, None if seq.grammar is None or bitmask is None else bitmask[i])
            for i, (seq, drafts) in enumerate(zip(prepared.seqs, prepared.drafts))
            for j in range(len(drafts) + 1)
        ]
        verifying = any(prepared.drafts)
        result = (self.sampler(logits[:num_sampling], rows, prepared.drafts if verifying else None) if rows
                  else SampleResult([], []))
        if bitmask is not None:  # the tokens are on the host now, so the model's work is done, on any device
            model_s = time.perf_counter() - self._forward_start
            for budget in {id(s.grammar.budget): s.grammar.budget for s in prepared.seqs if s.grammar}.values():
                budget.end_step(model_s)
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
        self._forward_start = time.perf_counter()
        self.copy_blocks(inputs.block_copies)
        copy_kv_blocks(self.window_caches, inputs.window_copies, self.device)
        tables, window_tables = inputs.block_tables, inputs.window_tables
        if window_tables is not None and not self.full_caches:  # every layer reads the window pool alone
            tables, window_tables = window_tables, None
        meta = AttentionMetadata.build(
            block_size=self.block_size, block_tables=tables, num_cached=inputs.num_cached,
            query_lens=inputs.query_lens, device=self.device,
            sliding_window=None if window_tables is not None else self.model.config.sliding_window,
            max_decode_query=inputs.max_decode_query, decode_prompts_up_to=self.attn_backend.decode_prompts_up_to,
            window_tables=window_tables, prompt_lens=inputs.prompt_lens,
        )
        dev = self.device
        lora = (self.lora.batch(inputs.loras, inputs.query_lens, dev)
                if self.lora is not None and any(inputs.loras) else None)
        input_ids = torch.tensor(inputs.input_ids, dtype=torch.long, device=dev)
        positions = torch.tensor(inputs.positions, dtype=torch.long, device=dev)
        logits = self.model(
            input_ids,
            positions,
            self.kv_caches,
            meta,
            self.attn_backend,
            torch.tensor(inputs.logits_rows, dtype=torch.long, device=dev),
            lora,
            self.decoder,
        )
        if self.draft is not None:
            self.draft.mirror(input_ids, positions, inputs.block_tables, inputs.num_cached, inputs.query_lens,
                              inputs.max_decode_query)
        return logits

    def add_lora(self, lora: LoRARequest) -> None:
        """Load and check the adapter a new request names (ValueError naming the problem if it cannot run)."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled (enable_lora=True / --enable-lora)")
        self.lora.add(lora)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks, every layer of the full pool (the draft model's too): a forked sequence's private
        copy of a shared block."""
        copy_kv_blocks(self.full_caches, copies, self.device)
        if self.draft is not None:
            copy_kv_blocks(self.draft.kv_caches, copies, self.device)

    def propose_drafts(self, seqs: list[Sequence], limits: list[int],
                       block_copies: list[tuple[int, int]]) -> list[list[int]]:
        """The draft model's proposals (after the copy-on-write its blocks for them needed)."""
        if self.draft is None:
            raise ValueError("this engine has no draft model")
        self.copy_blocks(block_copies)
        return self.draft.propose(seqs, limits)

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

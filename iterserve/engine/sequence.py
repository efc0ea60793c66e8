"""A request as the engine sees it: its tokens, its progress, its blocks and its timings."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from iterserve.lora.request import LoRARequest
from iterserve.outputs import RequestMetrics, TokenLogprobs
from iterserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from iterserve.engine.structured_output import GrammarMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: the sequences of one request share most of their fields
class Sequence:
    """One request's mutable state. ``num_computed_tokens`` of ``token_ids`` have K/V in the cache.

    Progress (computed tokens, output tokens, status, finish) is written only by the scheduler.
    With speculative decoding a decoding sequence also carries draft tokens for its next step; they
    are no part of its tokens until the target model accepts them.
    A request with n or best_of above 1 is a group: the parent (``index`` 0) prefills the prompt,
    and when it samples its first token the ``forks`` waiting on it join the batch sharing its
    blocks, each sampling its own first token from the same logits.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved against max_model_len
    metrics: RequestMetrics
    stop_ids: frozenset[int] = frozenset()
    generator: torch.Generator | None = None
    grammar: GrammarMatcher | None = None  # advanced with each accepted token (structured output)
    lora: LoRARequest | None = None  # the LoRA adapter its rows run under (None: the base model)
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0  # of the sampled tokens, when params.needs_logprobs
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # filled during prefill
    index: int = 0  # which of the request's n (or best_of) sequences this is
    forks: list[Sequence] = field(default_factory=list)  # children not yet forked off this parent
    group: list[Sequence] = field(default_factory=list)  # on the parent: every sequence of the request
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache on first admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0
    window_table: list[int] = field(default_factory=list)  # its windowed layers' blocks (hybrid SWA memory)
    window_start: int = 0  # window_table's entries before this one fell out of the window (the null block)
    spec_token_ids: list[int] = field(default_factory=list)  # drafts proposed for the next step to verify
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None  # why a sequence that finished with "error" by its own doing did

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_prefill(self) -> bool:
        """The one definition of prefill: nothing computed yet, or more than one token left to compute
        (a prompt, or a recompute after preemption). Otherwise the next step is a decode of one token."""
        return self.num_computed_tokens == 0 or self.num_tokens - self.num_computed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

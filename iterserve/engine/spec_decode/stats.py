"""Speculative decoding's counters, as vLLM counts them.

A *draft* is one sequence's proposal verified in one step; its tokens are draft tokens; accepted
tokens are those the target model agreed with, counted per position in the proposal. The
acceptance rate is accepted / draft tokens, and the mean accepted length 1 + accepted / drafts:
the tokens one sequence gets from one verification pass, the sampled one included.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def acceptance_rate(num_accepted_tokens: int, num_draft_tokens: int) -> float | None:
    return num_accepted_tokens / num_draft_tokens if num_draft_tokens else None


def mean_accepted_length(num_accepted_tokens: int, num_drafts: int) -> float | None:
    return 1 + num_accepted_tokens / num_drafts if num_drafts else None


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # position i: drafts whose token i was accepted

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One sequence verified ``num_draft_tokens`` drafts and accepted the first ``num_accepted``."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        self._grow(num_accepted)
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def add(self, other: SpecDecodeStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self._grow(len(other.accepted_per_pos))
        for i, n in enumerate(other.accepted_per_pos):
            self.accepted_per_pos[i] += n

    def _grow(self, n: int) -> None:
        if len(self.accepted_per_pos) < n:
            self.accepted_per_pos.extend([0] * (n - len(self.accepted_per_pos)))

    @property
    def acceptance_rate(self) -> float | None:
        return acceptance_rate(self.num_accepted_tokens, self.num_draft_tokens)

    @property
    def mean_accepted_length(self) -> float | None:
        return mean_accepted_length(self.num_accepted_tokens, self.num_drafts)

"""Speculative decoding in the simulator: drafts proposed and accepted by chance, at a given rate.

No model runs here, so a draft's fate is drawn: each of a sequence's drafts is accepted with
probability ``acceptance`` given that the ones before it were (the usual independent-position model,
whose mean accepted length with k drafts is (1 - a^(k+1)) / (1 - a)). The engine's own
:class:`~iterserve.engine.spec_decode.proposer.Speculator` decides which sequences get drafts and how
many (the batch-size cut-off, max_tokens), and the real scheduler verifies them in the step's token
budget, so a verification costs its 1 + k tokens in the step's shape.
"""

from __future__ import annotations

import numpy as np

from iterserve.config import SpeculativeConfig
from iterserve.engine.sampler import Verdict
from iterserve.engine.scheduler import ScheduledSeq
from iterserve.engine.sequence import Sequence
from iterserve.engine.spec_decode.proposer import Speculator

DRAFT = 0  # the filler every simulated draft token is


class _FillerProposer:
    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        return [[DRAFT] * limit for limit in limits]


class SimSpeculation:
    def __init__(self, num_speculative_tokens: int, acceptance: float, disable_by_batch_size: int | None,
                 max_model_len: int, rng: np.random.Generator) -> None:
        if not 0 <= acceptance <= 1:
            raise ValueError(f"the draft acceptance probability must be in [0, 1], got {acceptance}")
        config = SpeculativeConfig(num_speculative_tokens, disable_by_batch_size=disable_by_batch_size)
        self.speculator = Speculator(config, _FillerProposer(), max_model_len)
        self.acceptance = acceptance
        self.rng = rng

    def propose(self, running: list[Sequence]) -> None:
        self.speculator.propose(running)

    def verdicts(self, scheduled: list[ScheduledSeq]) -> dict[int, Verdict]:
        """Each verifying sequence's accepted drafts, keyed by its place among the sampling sequences."""
        verdicts: dict[int, Verdict] = {}
        sampling = [s for s in scheduled if s.samples]
        for i, s in enumerate(sampling):
            if s.spec_token_ids:
                fails = np.flatnonzero(self.rng.random(len(s.spec_token_ids)) >= self.acceptance)
                accepted = int(fails[0]) if len(fails) else len(s.spec_token_ids)
                verdicts[i] = Verdict(s.spec_token_ids[:accepted], [None] * accepted)
        return verdicts

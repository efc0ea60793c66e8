"""After each step: which decoding sequences get drafts for the next one, and how many.

Speculation pays while a forward pass is bound by reading the weights, so that verifying k + 1
tokens of a sequence costs about what one token does; in a large batch the pass is bound by
compute and rejected drafts cost as much as useful tokens. So no drafts are proposed for a step
whose running batch exceeds ``disable_by_batch_size`` (vLLM's name), and the sequences of such a
step decode one token each. A sequence is never given more drafts than it has tokens left to make
(``max_tokens``, ``max_model_len``), nor any while a grammar constrains it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from iterserve.config import SpeculativeConfig
from iterserve.engine.block_manager import BlockManager
from iterserve.engine.sequence import Sequence
from iterserve.engine.spec_decode.ngram import NgramProposer

if TYPE_CHECKING:
    from iterserve.engine.executor import Executor


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """At most ``limits[i]`` draft tokens for ``seqs[i]``, each a decoding sequence."""
        ...


def draft_limit(seq: Sequence, k: int, max_model_len: int | None) -> int:
    """Drafts worth proposing: verifying d drafts yields up to d + 1 tokens, which must stay within
    the request's max_tokens and the context."""
    limit = min(k, seq.max_tokens - len(seq.output_token_ids) - 1)
    if max_model_len is not None:
        limit = min(limit, max_model_len - seq.num_tokens - 1)
    return max(0, limit)


class Speculator:
    """Gives the running batch's decoding sequences their drafts for the next step."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int | None) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len

    @classmethod
    def build(cls, config: SpeculativeConfig, block_manager: BlockManager, executor: Executor,
              max_model_len: int | None, proposer: Proposer | None = None) -> Speculator:
        """The proposer ``config`` names, unless ``proposer`` stands in for it (a simulator's drafts)."""
        if proposer is not None:
            return cls(config, proposer, max_model_len)
        if config.uses_draft_model:
            return cls(config, DraftModelProposer(block_manager, executor), max_model_len)
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None  # set when checked
        return cls(config, NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max), max_model_len)

    def enabled_for(self, batch_size: int) -> bool:
        limit = self.config.disable_by_batch_size
        return limit is None or batch_size <= limit

    def propose(self, running: list[Sequence]) -> None:
        """Set ``spec_token_ids`` of the sequences that the next step may verify drafts for."""
        if not running or not self.enabled_for(len(running)):
            return
        seqs, limits = [], []
        for seq in running:
            if seq.is_prefill or seq.grammar is not None:
                continue
            limit = draft_limit(seq, self.config.num_speculative_tokens, self.max_model_len)
            if limit:
                seqs.append(seq)
                limits.append(limit)
        if seqs:
            for seq, drafts in zip(seqs, self.proposer.propose(seqs, limits)):
                seq.spec_token_ids = drafts


class DraftModelProposer:
    """The engine core's side: blocks for the draft's writes, then the executor's draft model."""

    def __init__(self, block_manager: BlockManager, executor: Executor) -> None:
        self.block_manager = block_manager
        self.executor = executor

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """Drafts for the sequences whose blocks can be extended now; a full pool drafts nothing, so
        that speculation never preempts a sequence."""
        ready, ready_limits = [], []
        for seq, limit in zip(seqs, limits):
            if self.block_manager.allocate(seq, limit):  # slots for the newest token and limit - 1 drafts
                ready.append(seq)
                ready_limits.append(limit)
        drafts = dict(zip(map(id, ready), self.executor.propose_drafts(ready, ready_limits,
                                                                      self.block_manager.take_copies())))
        return [drafts.get(id(seq), []) for seq in seqs]

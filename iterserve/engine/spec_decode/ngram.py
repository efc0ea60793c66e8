"""N-gram (prompt lookup) proposals: the tokens that followed the sequence's last few tokens before.

When a model copies or edits text it was given (summaries quoting their source, code edits, a
chat repeating earlier turns), the next tokens often continue an earlier occurrence of the last
few. The proposer looks for the longest suffix of ``prompt_lookup_max`` down to
``prompt_lookup_min`` tokens that occurred earlier in the prompt or output, takes its first
occurrence, as vLLM does, and proposes up to k tokens that followed it. The first occurrence has
the most tokens after it: in a run of repeated tokens the latest one sits right behind the suffix
and would leave one token to propose. No model runs.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from iterserve.engine.sequence import Sequence


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the first occurrence of the longest suffix of ``tokens``
    (``min_n`` to ``max_n`` long) that occurred before; [] when none did."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # windows starting at 0 .. length-1-n: every earlier n-gram that has a token after it
        windows = sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if len(hits):
            start = int(hits[0]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """At most ``limits[i]`` drafts for each sequence, from its own prompt and output."""
        return [ngram_lookup(np.asarray(seq.token_ids, dtype=np.int64), self.min_n, self.max_n, limit)
                for seq, limit in zip(seqs, limits)]

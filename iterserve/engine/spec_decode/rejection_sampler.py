"""Verification of drafted tokens by the rejection-sampling rule, so outputs keep the target's distribution.

Speculative sampling (Leviathan et al., Chen et al.) accepts a draft token d with probability
min(1, p(d) / q(d)), p the target's and q the proposer's distribution, and on rejection samples from
the residual max(0, p - q), renormalised; if every draft is accepted one bonus token is drawn from p
at the position after them. Every proposer here drafts deterministically (n-gram lookup, or the
draft model's argmax, as vLLM v1 drafts), so q is a point mass on d: acceptance has probability
p(d) and the residual is p without d. Drawing t from p and accepting exactly when t == d realises
both at once: P(t == d) = p(d), and a t != d is distributed as p without d. That draw is also the
one plain decoding makes, with one random number per emitted token, so a seeded request gives the
same tokens with or without speculation, and greedy requests (t = argmax p) accept the longest
prefix of drafts that matches what greedy decoding would produce.
"""

from __future__ import annotations

from collections.abc import Callable


def accept_drafts(draw: Callable[[int], int], drafts: list[int]) -> tuple[list[int], int]:
    """Verify ``drafts`` in order; ``draw(j)`` samples the target's token at draft position ``j`` (its
    distribution given the prompt, the output so far and drafts ``0..j-1``).

    Returns the accepted drafts and the token that follows them: the correction at the first
    rejected position, or the bonus token after the last draft when all are accepted. Positions
    after a rejection are never drawn: their context is not the sequence's.
    """
    for j, draft in enumerate(drafts):
        token = draw(j)
        if token != draft:
            return drafts[:j], token
    return drafts, draw(len(drafts))

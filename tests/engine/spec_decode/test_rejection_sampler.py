"""Verification: greedy accepts the longest matching prefix; sampled tokens keep the target distribution;
a seeded row draws one random number per emitted token, exactly as plain sampling does."""

from __future__ import annotations

import pytest
import torch

from iterserve.engine.sampler import Sampler, SamplingRow
from iterserve.engine.spec_decode.rejection_sampler import accept_drafts
from iterserve.sampling_params import SamplingParams


def test_accepts_the_matching_prefix_then_corrects():
    targets = [4, 5, 9, 1]
    assert accept_drafts(lambda j: targets[j], [4, 5, 6]) == ([4, 5], 9)
    assert accept_drafts(lambda j: targets[j], [4, 5, 9]) == ([4, 5, 9], 1)  # all accepted: the bonus token
    assert accept_drafts(lambda j: targets[j], [7]) == ([], 4)
    assert accept_drafts(lambda j: targets[j], []) == ([], 4)


def test_positions_after_a_rejection_are_not_drawn():
    drawn: list[int] = []

    def draw(j: int) -> int:
        drawn.append(j)
        return 0

    accept_drafts(draw, [0, 3, 0, 0])
    assert drawn == [0, 1]


def rows(n, **kw):
    return [SamplingRow(SamplingParams(**kw), [], [], frozenset()) for _ in range(n)]


def test_greedy_verification_in_the_sampler():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0],  # sequence 0: drafts [1, 2]
                           [1.0, 2.0, 3.0]])  # sequence 1: no drafts
    res = Sampler(torch.Generator().manual_seed(0))(logits, rows(4, temperature=0), [[1, 2], []])
    assert res.token_ids == [0, 2]  # row 1's argmax 0 rejects draft 2: 0 is the correction
    assert res.verdicts[0].accepted == [1] and 1 not in res.verdicts


def chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Survival function of Pearson's statistic (chi-square with cells - 1 degrees of freedom)."""
    stat = ((observed - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((len(expected) - 1) / 2), stat / 2))


def test_verified_tokens_keep_the_target_distribution():
    """Row 0 has draft 1 (likely), row 1 draft 0: the first token emitted follows p0 and, after an
    accepted first draft, the second follows p1, whichever drafts were proposed."""
    p0 = torch.tensor([0.2, 0.5, 0.3])
    p1 = torch.tensor([0.1, 0.6, 0.3])
    p2 = torch.tensor([0.3, 0.3, 0.4])
    logits = torch.stack([p0, p1, p2]).log()
    sampler = Sampler(torch.Generator().manual_seed(1))
    first = torch.zeros(3)
    second = torch.zeros(3)
    n = 6000
    for _ in range(n):
        res = sampler(logits.clone(), rows(3, temperature=1.0), [[1, 0]])
        emitted = [*res.verdicts[0].accepted, res.token_ids[0]] if 0 in res.verdicts else res.token_ids
        first[emitted[0]] += 1
        if emitted[0] == 1:
            second[emitted[1]] += 1
    assert chi_square_p(first, n * p0) > 1e-3
    assert chi_square_p(second, second.sum() * p1) > 1e-3


@pytest.mark.parametrize("drafts", [[5, 2, 7], [0, 0, 0], [9, 9, 9]])
def test_a_seeded_row_draws_what_plain_sampling_draws(drafts):
    """One uniform per emitted token: verification emits the tokens plain sampling would, whatever was drafted."""
    torch.manual_seed(0)
    logits = torch.randn(4, 10) * 2
    params = SamplingParams(temperature=0.8, top_p=0.9)
    gen = torch.Generator().manual_seed(7)
    verify_rows = [SamplingRow(params, [], [], frozenset(), gen) for _ in range(4)]
    res = Sampler(torch.Generator())(logits.clone(), verify_rows, [drafts])
    emitted = [*res.verdicts[0].accepted, res.token_ids[0]]
    gen_plain = torch.Generator().manual_seed(7)
    plain = [Sampler(torch.Generator())(logits[j:j + 1].clone(),
                                        [SamplingRow(params, [], [], frozenset(), gen_plain)]).token_ids[0]
             for j in range(len(emitted))]
    assert emitted == plain

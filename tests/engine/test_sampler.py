"""Sampler semantics on hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch

from iterserve.engine.sampler import Sampler, SamplingRow, apply_penalties, argmax_rows
from iterserve.sampling_params import SamplingParams
from tests.op_sets import use_kernels


def row(prompt=(), output=(), stop=(), gen=None, **kw) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), list(prompt), list(output), frozenset(stop), gen)


def sample(logits, rows, seed=0):
    return Sampler(torch.Generator().manual_seed(seed))(torch.tensor(logits, dtype=torch.float32), rows)


def draws(logits, n=300, **kw) -> set[int]:
    s = Sampler(torch.Generator().manual_seed(0))
    t = torch.tensor([logits], dtype=torch.float32)
    return {s(t.clone(), [row(**kw)]).token_ids[0] for _ in range(n)}


def test_greedy_takes_the_argmax():
    assert sample([[0.1, 3.0, 2.0], [5.0, 1.0, 0.0]], [row(temperature=0), row(temperature=0)]).token_ids == [1, 0]


@pytest.mark.parametrize("built", [True, False])
def test_argmax_rows_is_torch_argmax_on_either_path(monkeypatch, built):
    """The greedy pick is torch's argmax whether the C++ kernel (where built) or torch computes it: the first of
    tied maxima, and the first NaN; other dtypes and strided rows go to torch."""
    if not built:
        use_kernels(monkeypatch, None)
    torch.manual_seed(0)
    x = torch.randn(6, 300)
    x[0, 5] = x[0, 200] = 50.0
    x[1, 9] = float("nan")
    x[2] = float("-inf")
    for t in (x, x.to(torch.bfloat16), x[:, ::3], torch.randn(64, 4096)):
        assert torch.equal(argmax_rows(t), t.argmax(dim=-1))


def test_top_k_top_p_min_p_restrict_the_support():
    logits = [math.log(p) for p in (0.5, 0.3, 0.15, 0.05)]
    assert draws(logits, temperature=1.0) == {0, 1, 2, 3}
    assert draws(logits, temperature=1.0, top_k=2) == {0, 1}
    assert draws(logits, temperature=1.0, top_p=0.75) == {0, 1}  # 0.5 < 0.75 <= 0.8
    assert draws(logits, temperature=1.0, top_p=0.45) == {0}
    assert draws(logits, temperature=1.0, min_p=0.5) == {0, 1}  # keeps p >= 0.25
    assert draws(logits, temperature=1.0, top_k=1) == {0}


def test_low_temperature_concentrates_mass():
    logits = [1.0, 0.9, 0.0]
    assert draws(logits, temperature=0.01) == {0}


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0]])
    apply_penalties(logits, [row(prompt=[0], output=[1, 2, 2], repetition_penalty=2.0)])
    assert logits.tolist() == [[1.0, -4.0, 0.5, 1.0]]  # positive divided, negative multiplied
    logits = torch.tensor([[0.0, 0.0, 0.0]])
    apply_penalties(logits, [row(prompt=[0], output=[1, 2, 2], presence_penalty=0.5, frequency_penalty=0.25)])
    assert logits.tolist() == [[0.0, -0.75, -1.0]]  # the prompt does not count for these two


def test_min_tokens_masks_stop_ids_until_reached():
    logits = [[0.0, 5.0, 1.0]]
    assert sample(logits, [row(output=[], stop=[1], temperature=0, min_tokens=2)]).token_ids == [2]
    assert sample(logits, [row(output=[7, 7], stop=[1], temperature=0, min_tokens=2)]).token_ids == [1]


def test_seeded_rows_use_their_own_generator():
    logits = [[0.0] * 50]
    picks = {sample(logits, [row(temperature=1.0, gen=torch.Generator().manual_seed(5))], seed=s).token_ids[0]
             for s in range(10)}
    assert len(picks) == 1  # the engine-wide generator's seed does not matter


def test_logprobs_are_raw_log_softmax():
    logits = [[1.0, 2.0, 3.0]]
    res = sample(logits, [row(temperature=0, logprobs=2, repetition_penalty=1.5, output=[2])])
    ref = torch.log_softmax(torch.tensor(logits[0]), -1)
    lp = res.logprobs[0]
    assert set(lp) >= {1, 2} and lp[2][0] == pytest.approx(ref[2].item())
    assert {t: rank for t, (_, rank) in lp.items()} == {2: 1, 1: 2}  # (logprob, rank in the vocabulary)


def test_draws_follow_the_distribution_and_never_pick_zero_mass():
    probs = [0.1, 0.0, 0.6, 0.3]
    logits = [math.log(p) if p else float("-inf") for p in probs]
    s = Sampler(torch.Generator().manual_seed(3))
    t = torch.tensor([logits])
    picks = [s(t.clone(), [row(temperature=1.0)]).token_ids[0] for _ in range(4000)]
    freq = [picks.count(i) / len(picks) for i in range(4)]
    assert freq[1] == 0
    assert all(abs(f - p) < 0.03 for f, p in zip(freq, probs))


def test_logit_bias_acts_on_raw_logits_per_row():
    logits = [[1.0, 2.0, 3.0]] * 2
    res = sample(logits, [row(temperature=0, logit_bias={2: -100}, logprobs=0), row(temperature=0)])
    assert res.token_ids == [1, 2]  # only the biased row loses its top token
    assert res.logprobs[0][1] == (pytest.approx(torch.log_softmax(torch.tensor(logits[0]), -1)[1].item()), 2)
    assert draws([0.0, 0.0, 0.0], temperature=1.0, logit_bias={0: 100}) == {0}

"""SamplingParams rejects invalid values with messages that name the field."""

from __future__ import annotations

import pytest

from iterserve.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 3}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"n": 2}, "n"),
    ],
)
def test_invalid_values_raise(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_normalisation():
    p = SamplingParams(stop="###", top_k=-1, temperature=0)
    assert p.stop == ["###"] and p.top_k == 0 and p.greedy and not p.has_penalties


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 1e39}, "temperature"),
        ({"top_p": 1e-45}, "top_p"),
        ({"repetition_penalty": 1e-39}, "repetition_penalty"),
        ({"presence_penalty": float("inf")}, "presence_penalty"),
        ({"seed": 2**70}, "seed"),
    ],
)
def test_values_that_would_break_a_batch_are_refused(kwargs, field):
    """Extreme values overflow float32 in the sampler and would fail every request in the step."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_vanishing_temperature_is_greedy():
    assert SamplingParams(temperature=1e-40).greedy

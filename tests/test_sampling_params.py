"""SamplingParams rejects invalid values with messages that name the field."""

from __future__ import annotations

import numpy as np
import pytest

from iterserve.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS, SamplingParams, SamplingParamsError


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
        ({"n": 0}, "n"),
        ({"n": 1000}, "n"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {"five": 1}}, "logit_bias"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"logit_bias": {i: 1 for i in range(301)}}, "logit_bias"),
    ],
)
def test_invalid_values_raise(kwargs, field):
    with pytest.raises(SamplingParamsError, match=field) as info:
        SamplingParams(**kwargs)
    assert info.value.param == field and isinstance(info.value, ValueError)


def test_normalisation():
    p = SamplingParams(stop="###", top_k=-1, temperature=0)
    assert p.stop == ["###"] and p.top_k == 0 and p.greedy and not p.has_penalties


def test_logit_bias_keys_become_token_ids_and_best_of_needs_logprobs():
    p = SamplingParams(logit_bias={"42": -100, 7: 2.5}, n=2, best_of=3)
    assert p.logit_bias == {42: -100.0, 7: 2.5}
    assert p.num_seqs == 3 and p.needs_logprobs
    assert not SamplingParams(n=3).needs_logprobs and SamplingParams(n=3).num_seqs == 3


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


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": 3.0}, "top_k"),
        ({"logprobs": 1.5}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 8.0}, "max_tokens"),
        ({"min_tokens": 0.5}, "min_tokens"),
        ({"n": 1.0}, "n"),
        ({"seed": 1.5}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"stop_token_ids": [2.5]}, "stop_token_ids"),
        ({"stop_token_ids": [False]}, "stop_token_ids"),
        ({"stop": [7]}, "stop"),
    ],
)
def test_integer_fields_refuse_floats_and_bools(kwargs, field):
    """A float top_k used to pass and then fail inside the engine step, breaking every later generate()."""
    with pytest.raises(SamplingParamsError, match=f"{field} must be an integer|{field} must be a list") as info:
        SamplingParams(**kwargs)
    assert info.value.param == field


def test_integer_like_values_become_plain_ints():
    p = SamplingParams(top_k=np.int64(5), max_tokens=np.int32(8), seed=np.uint64(3), stop_token_ids=[np.int16(2)])
    assert (p.top_k, p.max_tokens, p.seed, p.stop_token_ids) == (5, 8, 3, [2])
    assert all(type(v) is int for v in (p.top_k, p.max_tokens, p.seed, *p.stop_token_ids))


def test_stop_string_limits():
    SamplingParams(stop=["x"] * MAX_STOP_STRINGS)
    SamplingParams(stop=["a" * (MAX_STOP_CHARS - 1), "b"])
    with pytest.raises(SamplingParamsError, match=f"at most {MAX_STOP_STRINGS}") as info:
        SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1))
    assert info.value.param == "stop"
    with pytest.raises(SamplingParamsError, match=f"at most {MAX_STOP_CHARS} are allowed") as info:
        SamplingParams(stop=["a" * MAX_STOP_CHARS, "b"])
    assert info.value.param == "stop"
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(stop_token_ids=list(range(100_000)))
    assert info.value.param == "stop_token_ids"



@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"bad_words": "word"}, "bad_words"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"bad_words": [f"w{i}" for i in range(129)]}, "bad_words"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"stop": ["x"], "detokenize": False}, "stop"),
        ({"extra_args": ["x"]}, "extra_args"),
        ({"output_kind": "delta"}, "output_kind"),
        ({"thinking_token_budget": 10}, "thinking_token_budget"),
        ({"stream_interval": 4}, "stream_interval"),
    ],
)
def test_vllm_options_are_checked_or_refused_with_a_reason(kwargs, field):
    with pytest.raises(SamplingParamsError, match=field) as info:
        SamplingParams(**kwargs)
    assert info.value.param == field


def test_vllm_constructor_conventions():
    """seed=-1 means none, from_optional takes None as the default."""
    p = SamplingParams(seed=-1, bad_words=["a", "a"], extra_args={"plugin": 1})
    assert p.seed is None and p.bad_words == ["a"] and p.extra_args == {"plugin": 1}
    q = SamplingParams.from_optional(temperature=None, top_p=None, presence_penalty=None, n=None, max_tokens=7)
    assert (q.temperature, q.top_p, q.presence_penalty, q.n, q.max_tokens) == (1.0, 1.0, 0.0, 1, 7)


def test_bad_words_are_tokenized_alone_and_after_a_space():
    class Words:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [ord(c) for c in text]

    p = SamplingParams(bad_words=["ab"])
    p.update_from_tokenizer(Words())
    assert p.bad_words_token_ids == [[97, 98], [32, 97, 98]]

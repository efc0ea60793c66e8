"""EngineCore on a small random model: deltas carry only what is new, a failed step fails only its
requests and frees their blocks, bad requests are refused without side effects."""

from __future__ import annotations

import pytest

from iterserve.engine.core import FAULT_TOKEN_ENV, EngineConfig, EngineCore, check_prompt
from iterserve.engine.messages import EngineCoreRequest
from iterserve.errors import RequestError
from iterserve.models.loader import load_model
from iterserve.sampling_params import SamplingParams, SamplingParamsError

FAULT_TOKEN = 4242


@pytest.fixture(scope="module")
def tiny_loaded():
    return load_model("random:smollm2-135m?num_layers=2", dtype="float32", device="cpu", seed=0)


def core(loaded, **kw) -> EngineCore:
    return EngineCore(EngineConfig(**{"num_kv_blocks": 32, "max_model_len": 128, **kw}), loaded)


def request(rid: str, prompt: list[int], **params) -> EngineCoreRequest:
    return EngineCoreRequest(rid, prompt, SamplingParams(**{"ignore_eos": True, **params}), 0.0)


def test_deltas_carry_only_new_tokens_and_the_finish(tiny_loaded):
    c = core(tiny_loaded, max_num_batched_tokens=8)
    c.add_request(request("a", list(range(1, 20)), max_tokens=5, logprobs=2))
    seen = []
    while c.has_unfinished_requests():
        step = c.step()
        for o in step.outputs:
            assert len(o.new_token_ids) == 1 and len(o.new_logprobs) == 1 and len(o.new_logprobs[0]) >= 2
            seen.append(o)
    assert seen[0].first_scheduled_time is not None and all(o.first_scheduled_time is None for o in seen[1:])
    assert [o.finish_reason for o in seen] == [None] * 4 + ["length"]
    assert step.stats.num_running == 0 and step.stats.num_generation_tokens == 5 and step.stats.num_steps == 7
    assert c.step_history.maxlen == 0 and not c.requests  # nothing kept unless asked for
    c.block_manager.check_no_leaks()


def test_a_failed_step_fails_its_requests_and_the_core_carries_on(tiny_loaded, monkeypatch, caplog):
    monkeypatch.setenv(FAULT_TOKEN_ENV, str(FAULT_TOKEN))
    c = core(tiny_loaded)
    c.add_request(request("running", [1, 2, 3], max_tokens=20))
    assert [o.request_id for o in c.step().outputs] == ["running"]
    c.add_request(request("poisoned", [5, FAULT_TOKEN, 6], max_tokens=4))
    failed = c.step().outputs  # one step holds both: both fail
    assert {(o.request_id, o.finish_reason) for o in failed} == {("running", "error"), ("poisoned", "error")}
    assert "injected fault" in caplog.text and not c.has_unfinished_requests()
    c.block_manager.check_no_leaks()
    c.add_request(request("next", [1, 2, 3], max_tokens=3))
    outputs = [o for _ in range(3) for o in c.step().outputs]
    assert [o.finish_reason for o in outputs] == [None, None, "length"]
    c.block_manager.check_no_leaks()


def test_bad_requests_are_refused_and_queue_nothing(tiny_loaded):
    c = core(tiny_loaded)
    cases = [([], {}, "empty"), ([1, 10**9], {}, "token ids"), (list(range(1, 200)), {}, "max_model_len"),
             ([1, 2], {"max_tokens": 500}, "exceeds max_model_len")]
    for prompt, params, match in cases:
        with pytest.raises(ValueError, match=match):
            c.add_request(request("bad", prompt, **params))
    c.add_request(request("ok", [1, 2], max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        c.add_request(request("ok", [3, 4], max_tokens=1))
    assert list(c.requests) == ["ok"] and c.num_waiting == 1
    assert c.step().outputs[0].finish_reason == "length"
    c.block_manager.check_no_leaks()


def test_refusals_carry_the_field_and_the_openai_code():
    """What the server turns into its 400 body, with no message parsing."""
    cases = [
        ([], {}, "prompt", None),
        (list(range(1, 200)), {}, "prompt", "context_length_exceeded"),
        ([1, 10**9], {}, "prompt", None),
        ([1, 2], {"max_tokens": 500}, "max_tokens", "context_length_exceeded"),
    ]
    for prompt, params, param, code in cases:
        with pytest.raises(RequestError) as info:
            check_prompt(prompt, SamplingParams(**params), vocab_size=1000, max_model_len=128)
        assert (info.value.param, info.value.code) == (param, code)
    with pytest.raises(RequestError) as info:
        SamplingParams(top_p=0)
    assert isinstance(info.value, SamplingParamsError) and info.value.param == "top_p"
    assert check_prompt([1, 2], SamplingParams(max_tokens=None), vocab_size=1000, max_model_len=128) == 126


def test_step_stats_count_the_kv_context_prefix_hits_included(tiny_loaded):
    """``total_context`` is what a step's attention read; a step-time calibration fits against it."""
    c = core(tiny_loaded, max_num_batched_tokens=8, step_history=32)
    prompt = list(range(1, 20))
    c.add_request(request("a", prompt, max_tokens=5))
    while c.has_unfinished_requests():
        c.step()
    # prefill chunks of 8 up to 19 tokens, then one decode token per step
    assert [s.total_context for s in c.step_history] == [8, 16, 19, 20, 21, 22, 23]
    c.add_request(request("b", prompt, max_tokens=1))
    c.step()
    last = c.step_history[-1]
    assert last.prefix_hit_tokens == 16 and last.num_prefill_tokens == 3 and last.total_context == 19

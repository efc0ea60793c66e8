"""EngineCore on a small random model: deltas carry only what is new, a failed step fails only its
requests and frees their blocks, bad requests are refused without side effects."""

from __future__ import annotations

import json
import time

import msgspec
import pytest

from iterserve.config import EngineConfig
from iterserve.engine import core as core_module
from iterserve.engine.core import FAULT_TOKEN_ENV, EngineCore
from iterserve.engine.messages import KV_FIRST_ROW, BatchRow, EngineCoreRequest
from iterserve.engine.validation import check_prompt
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


def test_step_records_go_out_with_the_step_and_match_the_trace(tiny_loaded, tmp_path):
    trace = tmp_path / "trace.jsonl"
    c = core(tiny_loaded, max_num_batched_tokens=8, step_trace=str(trace))
    assert c.step().step is None  # nothing scheduled, nothing recorded
    c.add_request(request("a", list(range(1, 12)), max_tokens=3))
    assert c.step().step is None  # the offline engine does not ask for them
    c.emit_steps = True
    records = []
    while c.has_unfinished_requests():
        records.append(c.step().step)
    c.close()
    # a prefill chunk of 3 (8 came first), then two decodes; rows hold tokens computed and generated so far
    assert [r.seqs for r in records] == [[BatchRow("a", "prefill", 3, 11, 1)], [BatchRow("a", "decode", 1, 12, 2)],
                                         [BatchRow("a", "decode", 1, 13, 3)]]
    lines = [json.loads(line) for line in trace.read_text().splitlines() if '"type":"step"' in line]
    assert lines[1:] == [msgspec.to_builtins(r) for r in records]  # one schema: the trace line is the record
    assert lines[-1]["seqs"] == [["a", "decode", 1, 13, 3]]


def test_the_clock_stamps_every_time_the_core_records(tiny_loaded, tmp_path):
    """A core given a clock (a simulator's virtual one) takes every timestamp from it: the step trace,
    first scheduled and token times, finishes, aborts."""
    ticks = iter(range(10**6, 2 * 10**6, 10))  # each call: the next tick, far from any perf_counter reading
    trace = tmp_path / "trace.jsonl"
    c = EngineCore(EngineConfig(num_kv_blocks=32, max_model_len=128, step_trace=str(trace)), tiny_loaded,
                   clock=lambda: float(next(ticks)))
    c.add_request(EngineCoreRequest("a", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), 999_995.0))
    c.add_request(EngineCoreRequest("b", [4, 5], SamplingParams(max_tokens=50, ignore_eos=True), 999_995.0))
    outputs = [o for _ in range(2) for o in c.step().outputs]  # steps: 10**6 to +10, +20 to +30
    assert c.abort_request("b")  # at +40
    c.close()
    assert [(o.request_id, o.timestamp - 10**6, o.finish_reason) for o in outputs] == [
        ("a", 10, None), ("b", 10, None), ("a", 30, "length"), ("b", 30, None)]
    assert [o.first_scheduled_time for o in outputs] == [10**6, 10**6, None, None]
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    steps = [(r["start"] - 10**6, r["duration"]) for r in records if r["type"] == "step"]
    assert steps == [(0, 10), (20, 10)]
    requests = {r["request_id"]: r for r in records if r["type"] == "request"}
    assert requests["a"]["first_token_time"] - 10**6 == 10 and requests["a"]["ttft"] == 15
    assert requests["a"]["finished_time"] - 10**6 == 30 and requests["a"]["queue_time"] == 5
    assert requests["b"]["finished_time"] - 10**6 == 40 and requests["b"]["finish_reason"] == "abort"


def test_kv_snapshots_only_while_watched_and_at_a_bounded_rate(tiny_loaded, monkeypatch):
    monkeypatch.setattr(core_module, "KV_SNAPSHOT_MIN_INTERVAL_S", 30.0)  # however slow this machine steps
    c = core(tiny_loaded)
    c.add_request(request("a", list(range(1, 40)), max_tokens=20))
    c.step()
    assert c.kv_snapshot() is None and c.kv_snapshot(force=True) is None  # nobody watches: no cost
    c.watch_kv = True
    first = c.kv_snapshot()
    assert first is not None and first.step == 1 and len(first.blocks) == 32
    assert list(first.blocks).count(KV_FIRST_ROW) == 3  # 39 prompt tokens in 16-token blocks, all row 0's
    c.step()
    assert c.kv_snapshot() is None  # within KV_SNAPSHOT_MIN_INTERVAL_S of the last one
    assert c.kv_snapshot(force=True) is not None
    monkeypatch.setattr(core_module, "KV_SNAPSHOT_BUDGET", 1e-9)  # as if a snapshot took ages to build
    c.kv_snapshot(force=True)
    assert c._next_kv_snapshot - time.perf_counter() > 300  # the next is pushed back to keep within budget
    c.watch_kv = False
    assert c.kv_snapshot(force=True) is None

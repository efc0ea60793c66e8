"""Speculative decoding in the simulator: the cost-model executor drafts through the engine's own
speculator and scheduler and accepts each draft position at random; the core's counters, KV
rollback and step trace see a run as they would a real one."""

from __future__ import annotations

import io
import json
import math

import pytest

from iterserve.bench.serve import LoadPoint
from iterserve.bench.workloads import Request
from iterserve.planner.speculative import mean_accepted_length
from iterserve.simulate.cost import LinearCost
from iterserve.simulate.runner import SimConfig, simulate_point

ALL_AT_ONCE = LoadPoint(math.inf)
# 1 ms a step, + 0.1 ms per prefill token or verified draft, + 0.5 ms per decoding sequence
COST = LinearCost(intercept_s=0.001, per_prefill_token_s=0.0001, per_decode_seq_s=0.0005, per_context_token_s=0.0)


def decodes(n: int, output_len: int) -> list[Request]:
    return [Request([100 + 8 * i + j for j in range(8)], 8, output_len) for i in range(n)]


def sim(reqs: list[Request], point: LoadPoint = ALL_AT_ONCE, seed: int = 0, **spec):
    return simulate_point(reqs, point, COST, SimConfig(num_kv_blocks=512, block_size=16, **spec), seed=seed)


def test_acceptance_zero_takes_the_same_steps_as_plain_decoding_plus_the_drafts_cost():
    reqs = decodes(4, 40)
    plain_results, _, plain = sim(reqs)
    results, _, spec = sim(reqs, num_speculative_tokens=3, spec_acceptance=0.0)
    assert spec.num_steps == plain.num_steps and spec.num_accepted_tokens == 0
    # every decode step after the first verifies 3 drafts per sequence, fewer as a request nears its end
    assert spec.num_drafts == 4 * 38 and spec.num_draft_tokens == 4 * (36 * 3 + 2 + 1)
    assert spec.busy_s == pytest.approx(plain.busy_s + COST.per_prefill_token_s * spec.num_draft_tokens)
    assert [r.output_len for r in results] == [r.output_len for r in plain_results] == [40] * 4
    assert spec.mean_accepted_length == 1.0


def test_acceptance_one_finishes_a_long_decode_in_a_fifth_of_the_passes():
    _, _, plain = sim(decodes(1, 401))
    results, _, spec = sim(decodes(1, 401), num_speculative_tokens=4, spec_acceptance=1.0)
    assert results[0].success and results[0].output_len == 401
    # the prefill samples the first token, then each pass yields its 4 drafts and one more
    assert plain.num_steps == 401 and spec.num_steps == 1 + 400 // 5
    assert spec.num_accepted_tokens == spec.num_draft_tokens == 4 * 80 and spec.mean_accepted_length == 5.0


def test_the_spec_decode_counters_and_the_step_trace_are_what_the_executor_drew():
    from iterserve.config import get_preset
    from iterserve.engine.core import EngineCore
    from iterserve.engine.messages import EngineCoreRequest
    from iterserve.sampling_params import SamplingParams
    from iterserve.simulate.executor import CostModelExecutor, VirtualClock

    cfg = SimConfig(num_kv_blocks=64, block_size=4, num_speculative_tokens=4, spec_acceptance=0.5)
    config = cfg.engine_config("smollm2-135m", "bfloat16")
    clock = VirtualClock()
    executor = CostModelExecutor(config, get_preset("smollm2-135m"), COST, clock, acceptance=0.5, seed=7)
    core = EngineCore(config, executor=executor, clock=clock, proposer=executor)
    for i in range(3):
        core.add_request(EngineCoreRequest(str(i), [11 + i, 12, 13], SamplingParams(max_tokens=30, ignore_eos=True), 0))
    tokens = dict.fromkeys(map(str, range(3)), 0)
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens[out.request_id] += len(out.new_token_ids)
    core.block_manager.check_no_leaks()  # the blocks of rejected drafts went back
    stats, drawn = core.stats(), executor.drawn
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == \
        (drawn.num_drafts, drawn.num_draft_tokens, drawn.num_accepted_tokens)
    assert stats.spec_accepted_per_pos == drawn.accepted_per_pos and drawn.num_accepted_tokens > 0
    assert tokens == dict.fromkeys(map(str, range(3)), 30)
    assert stats.num_generation_tokens == 90


def test_the_step_trace_carries_each_steps_drafts():
    trace = io.StringIO()
    _, _, stats = simulate_point(decodes(2, 50), ALL_AT_ONCE, COST,
                                 SimConfig(num_kv_blocks=64, block_size=16, num_speculative_tokens=2,
                                           spec_acceptance=0.7), seed=3, trace=trace)
    steps = [r for r in map(json.loads, trace.getvalue().splitlines()) if r["type"] == "step"]
    assert len(steps) == stats.num_steps
    assert sum(s["num_drafts"] for s in steps) == stats.num_drafts > 0
    assert sum(s["num_accepted_tokens"] for s in steps) == stats.num_accepted_tokens > 0


def test_the_same_seed_draws_the_same_acceptances_and_another_does_not():
    runs = [sim(decodes(2, 120), seed=s, num_speculative_tokens=4, spec_acceptance=0.6)[2] for s in (1, 1, 2)]
    assert runs[0] == runs[1]
    assert runs[0].num_accepted_tokens != runs[2].num_accepted_tokens


def test_the_planners_tokens_per_pass_is_the_simulated_mean_accepted_length():
    k, a = 4, 0.6
    _, _, stats = sim(decodes(8, 1000), num_speculative_tokens=k, spec_acceptance=a)
    assert stats.num_drafts > 3000
    assert stats.mean_accepted_length == pytest.approx(mean_accepted_length(k, a), rel=0.03)


def test_no_drafts_in_a_batch_above_disable_by_batch_size():
    _, _, over = sim(decodes(5, 20), num_speculative_tokens=2, spec_acceptance=1.0, spec_disable_by_batch_size=4)
    assert over.num_drafts == 0 and over.num_steps == 20
    _, _, within = sim(decodes(5, 20), num_speculative_tokens=2, spec_acceptance=1.0, spec_disable_by_batch_size=5)
    assert within.num_drafts > 0 and within.num_steps < 20


@pytest.mark.parametrize("spec, message", [
    ({"num_speculative_tokens": 2}, "needs the draft acceptance probability"),
    ({"spec_acceptance": 0.5}, "needs drafts"),
    ({"num_speculative_tokens": 2, "spec_acceptance": 1.5}, r"must be in \[0, 1\]"),
    ({"num_speculative_tokens": -1}, "integer >= 0"),
    ({"num_speculative_tokens": 2, "spec_acceptance": 0.5, "spec_disable_by_batch_size": 0},
     "disable_by_batch_size must be an integer >= 1"),
])
def test_bad_speculation_settings_are_clear_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        SimConfig(num_kv_blocks=16, **spec)

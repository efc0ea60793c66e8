"""The cost-model executor under the real EngineCore: steps take the cost model's time on the virtual
clock, and the core's own records (outputs, step history, finishes) carry that time."""

from __future__ import annotations

import dataclasses

import pytest

from iterserve.config import get_preset
from iterserve.engine.core import EngineCore
from iterserve.engine.messages import EngineCoreRequest
from iterserve.sampling_params import SamplingParams
from iterserve.simulate.cost import LinearCost
from iterserve.simulate.executor import FILLER, CostModelExecutor, VirtualClock
from iterserve.simulate.runner import SimConfig

MODEL = get_preset("smollm2-135m")


def test_the_core_steps_on_the_virtual_clock_by_the_cost_models_time():
    # 10 ms a step, + 1 ms per prefill token, + 2 ms per decode sequence; a budget of 5 tokens a step.
    cost = LinearCost(intercept_s=0.010, per_prefill_token_s=0.001, per_decode_seq_s=0.002, per_context_token_s=0.0)
    config = dataclasses.replace(SimConfig(num_kv_blocks=16, block_size=4, max_num_batched_tokens=5)
                                 .engine_config("smollm2-135m", "bfloat16"), step_history=10)
    clock = VirtualClock()
    executor = CostModelExecutor(config, MODEL, cost, clock)
    core = EngineCore(config, executor=executor, clock=clock)
    clock.advance_to(1.0)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    core.add_request(EngineCoreRequest("a", [101, 102, 103, 104, 105, 106, 107], params, 1.0))
    outputs = []
    while core.has_unfinished_requests():
        outputs += core.step().outputs
    # step 1: 5 prompt tokens (15 ms); step 2: the last 2, sampling (12 ms); step 3: one decode (12 ms)
    assert [s.start for s in core.step_history] == pytest.approx([1.0, 1.015, 1.027])
    assert [s.duration for s in core.step_history] == pytest.approx([0.015, 0.012, 0.012])
    assert [(o.timestamp, o.new_token_ids, o.finish_reason) for o in outputs] == [
        (pytest.approx(1.027), [FILLER], None), (pytest.approx(1.039), [FILLER], "length")]
    assert clock.now == pytest.approx(1.039) and executor.busy_s == pytest.approx(0.039) and executor.rows == 3
    core.block_manager.check_no_leaks()
    assert executor.capacity.num_blocks == 16 and core.max_model_len == 64


def test_a_simulated_engine_needs_its_pool_and_dtype_given():
    config = SimConfig(num_kv_blocks=16).engine_config("smollm2-135m", "bfloat16")
    for missing in ({"num_kv_blocks": None}, {"max_model_len": None}, {"dtype": "auto"}):
        with pytest.raises(ValueError, match="needs num_kv_blocks, max_model_len and a dtype"):
            CostModelExecutor(dataclasses.replace(config, **missing), MODEL, LinearCost(0.01, 0, 0, 0), VirtualClock())

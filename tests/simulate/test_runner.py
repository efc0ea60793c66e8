"""The simulator on the real engine core: hand-computed timings under a constant step time,
the concurrency cap, and the scheduler's policies changing the result the way they should."""

from __future__ import annotations

import dataclasses
import io
import json
import math

import msgspec
import pytest

from iterserve.bench.metrics import compute_metrics
from iterserve.bench.serve import LoadPoint, arrival_offsets
from iterserve.bench.workloads import Request, WorkloadSpec, make_workload
from iterserve.engine.core import EngineCore
from iterserve.engine.messages import EngineCoreRequest, StepStats
from iterserve.models.loader import load_model
from iterserve.sampling_params import SamplingParams
from iterserve.simulate.cost import ConstantCost, LinearCost
from iterserve.simulate.runner import SimConfig, run_simulation, simulate_point

ALL_AT_ONCE = LoadPoint(math.inf)


def req(prompt: list[int], output_len: int) -> Request:
    return Request(prompt, len(prompt), output_len)


def test_constant_step_time_reproduces_hand_computed_chunked_prefill():
    # Budget 5 tokens a step, 0.1 s a step, both requests sent at t=0.
    # step 1: A prefills 4 tokens and samples (TTFT 0.1); B prefills 1 of its 6.
    # step 2: A decodes (token 2 at 0.2); B prefills 4 more.
    # step 3: A decodes (token 3 at 0.3, done: output 3); B prefills its last token and samples (TTFT 0.3).
    # step 4: B decodes (token 2 at 0.4, done: output 2).
    a, b = req([101, 102, 103, 104], 3), req([201, 202, 203, 204, 205, 206], 2)
    cfg = SimConfig(num_kv_blocks=16, block_size=4, max_num_batched_tokens=5)
    results, duration, stats = simulate_point([a, b], ALL_AT_ONCE, ConstantCost(0.1), cfg)
    assert [r.success for r in results] == [True, True]
    assert [r.output_len for r in results] == [3, 2]
    assert [r.ttft for r in results] == pytest.approx([0.1, 0.3])
    assert results[0].itl == pytest.approx([0.1, 0.1])
    assert results[1].itl == pytest.approx([0.1])
    assert [r.tpot for r in results] == pytest.approx([0.1, 0.1])
    assert [r.latency for r in results] == pytest.approx([0.3, 0.4])
    assert duration == pytest.approx(0.4)
    assert stats.num_steps == 4
    m = compute_metrics(results, duration)
    assert m["output_throughput"] == pytest.approx(5 / 0.4)
    assert m["median_ttft_ms"] == pytest.approx(200.0)


def test_concurrency_cap_sends_the_next_request_when_a_slot_frees():
    # One slot: B waits for A (2 steps), is sent at 0.2 and measures its TTFT from then.
    reqs = [req([101, 102, 103, 104], 2), req([201, 202, 203, 204], 2)]
    cfg = SimConfig(num_kv_blocks=16, block_size=4)
    results, duration, _ = simulate_point(reqs, LoadPoint(math.inf, 1), ConstantCost(0.1), cfg)
    assert [r.start_time for r in results] == pytest.approx([0.0, 0.2])
    assert [r.ttft for r in results] == pytest.approx([0.1, 0.1])
    assert [r.latency for r in results] == pytest.approx([0.2, 0.2])
    assert duration == pytest.approx(0.4)


def test_the_round_trip_delays_arrival_and_delivery_so_a_freed_slot_misses_the_next_step():
    # 0.1 s steps, 0.02 s round trip: a request reaches the scheduler 0.01 s after it is sent and the
    # client sees a token 0.01 s after its step ends. Two slots; A wants 3 tokens, B and C one each.
    # step 1 (0.01-0.11): A and B prefill; B is done, the client sees it at 0.12 and sends C;
    # step 2 (0.11-0.21): A decodes; C reaches the scheduler at 0.13, during the step, and waits;
    # step 3 (0.21-0.31): A decodes its last token, C prefills its only one, both seen at 0.32.
    reqs = [req([101, 102, 103, 104], 3), req([201, 202], 1), req([301, 302, 303], 1)]
    cfg = SimConfig(num_kv_blocks=16, block_size=4, request_latency_s=0.02)
    results, duration, stats = simulate_point(reqs, LoadPoint(math.inf, 2), ConstantCost(0.1), cfg)
    assert [r.start_time for r in results] == pytest.approx([0.0, 0.0, 0.12])
    assert [r.ttft for r in results] == pytest.approx([0.12, 0.12, 0.20])
    assert [r.latency for r in results] == pytest.approx([0.32, 0.12, 0.20])
    assert results[0].itl == pytest.approx([0.1, 0.1])
    assert duration == pytest.approx(0.32)
    assert stats.num_steps == 3
    # with no round trip C is sent at 0.1 (end of step 1), joins step 2 and is done at 0.2
    results, _, _ = simulate_point(reqs, LoadPoint(math.inf, 2), ConstantCost(0.1),
                                   SimConfig(num_kv_blocks=16, block_size=4))
    assert [r.ttft for r in results] == pytest.approx([0.1, 0.1, 0.1])


def test_serial_admission_gives_the_first_of_a_burst_a_step_of_its_own():
    # Three requests sent together, admitted 0.05 s apart: A alone in step 1 (0-0.1), B and C in step 2.
    reqs = [req([101, 102], 1), req([201, 202], 1), req([301, 302], 1)]
    cfg = SimConfig(num_kv_blocks=16, block_size=4, admission_interval_s=0.05)
    results, duration, stats = simulate_point(reqs, ALL_AT_ONCE, ConstantCost(0.1), cfg)
    assert [r.ttft for r in results] == pytest.approx([0.1, 0.2, 0.2])
    assert stats.num_steps == 2 and duration == pytest.approx(0.2)
    with pytest.raises(ValueError, match="must be >= 0"):
        SimConfig(num_kv_blocks=16, admission_interval_s=-1.0)


def test_poisson_arrivals_are_bench_serves_and_an_idle_engine_waits_for_the_next():
    reqs = [req([100 + i, 200 + i], 1) for i in range(5)]
    cfg = SimConfig(num_kv_blocks=64, block_size=4)
    point = LoadPoint(0.5)  # gaps of about 2 s against 0.01 s steps: every request runs alone
    results, duration, stats = simulate_point(reqs, point, ConstantCost(0.01), cfg, seed=3)
    offsets = arrival_offsets(5, 0.5, 1.0, 3)
    assert [r.start_time for r in results] == pytest.approx(offsets)
    assert [r.ttft for r in results] == pytest.approx([0.01] * 5)  # the clock jumps to each arrival
    assert duration == pytest.approx(offsets[-1] + 0.01)
    assert stats.num_steps == 5


def test_a_request_longer_than_the_model_fails_alone_with_the_servers_error():
    reqs = [req([101, 102], 2), req(list(range(100, 120)), 30), req(list(range(100, 140)), 1), req([103, 104], 2)]
    cfg = SimConfig(num_kv_blocks=16, block_size=4, max_model_len=32)
    results, _, stats = simulate_point(reqs, ALL_AT_ONCE, ConstantCost(0.1), cfg)
    assert [r.success for r in results] == [True, False, False, True]
    assert "prompt (20 tokens) + max_tokens (30) = 50 exceeds max_model_len (32)" in results[1].error
    assert "prompt has 40 tokens but max_model_len is 32" in results[2].error
    assert stats.num_steps == 2  # the refused requests never reached the engine


def test_a_workload_none_of_which_fits_is_a_clear_error():
    with pytest.raises(ValueError, match="no request of the workload could run: prompt has 5 tokens but max_model_len"):
        simulate_point([req([101, 102, 103, 104, 105], 3)], ALL_AT_ONCE, ConstantCost(0.1),
                       SimConfig(num_kv_blocks=1, block_size=4))


def test_max_model_len_larger_than_the_pool_is_refused():
    with pytest.raises(ValueError, match="needs more KV cache than the pool holds"):
        SimConfig(num_kv_blocks=2, block_size=4, max_model_len=9)


def workload(n: int = 48, seed: int = 0) -> list[Request]:
    spec = WorkloadSpec(num_prompts=n, input_len="uniform:16:64", output_len="uniform:4:64", seed=seed)
    return make_workload(spec, tokenizer=None, vocab_size=1000)


def test_static_batching_finishes_later_and_waits_longer_than_continuous():
    reqs = workload()
    base = {"num_kv_blocks": 512, "block_size": 16, "max_num_seqs": 8}
    cont = simulate_point(reqs, ALL_AT_ONCE, ConstantCost(0.01), SimConfig(**base, batching="continuous"))
    stat = simulate_point(reqs, ALL_AT_ONCE, ConstantCost(0.01), SimConfig(**base, batching="static"))
    (c_res, c_dur, c_stats), (s_res, s_dur, s_stats) = cont, stat
    assert all(r.success for r in c_res + s_res)
    assert sum(r.output_len for r in c_res) == sum(r.output_len for r in s_res)
    assert s_stats.num_steps > c_stats.num_steps  # a static batch idles its finished slots
    assert s_dur > c_dur
    assert s_stats.mean_batch < c_stats.mean_batch
    assert compute_metrics(s_res, s_dur)["mean_ttft_ms"] > compute_metrics(c_res, c_dur)["mean_ttft_ms"]


def test_dynamic_batching_on_arrivals_fills_larger_batches_than_static_and_waits_no_longer_than_its_window():
    reqs = workload(32)
    base = {"num_kv_blocks": 512, "block_size": 16, "max_num_seqs": 8}
    point = LoadPoint(20.0)  # a request every 50 ms on average, a step of 10 ms: arrivals trickle in
    runs = {b: simulate_point(reqs, point, ConstantCost(0.01), SimConfig(**base, batching=b, max_batch_wait=0.3))
            for b in ("static", "dynamic", "continuous")}
    (_, _, stat), (d_res, _, dyn), (_, _, cont) = runs["static"], runs["dynamic"], runs["continuous"]
    assert all(r.success for r in d_res)
    assert dyn.mean_batch > stat.mean_batch  # waiting for the batch to fill packs more sequences per step
    assert cont.mean_batch > stat.mean_batch
    assert dyn.num_steps < stat.num_steps
    # a dynamic batch's first request never waits more than the window while the engine is idle, so no
    # request of the first batch starts later than 0.3 s after it arrived
    assert d_res[0].ttft < 0.3 + 2 * 0.01 + 1e-9


def test_reserved_kv_admits_fewer_sequences_than_paged_on_a_small_pool():
    reqs = workload()
    base = {"num_kv_blocks": 24, "block_size": 16, "max_num_seqs": 16, "max_model_len": 128}
    _, p_dur, p_stats = simulate_point(reqs, ALL_AT_ONCE, ConstantCost(0.01),
                                       SimConfig(**base, kv_allocation="paged"))
    _, r_dur, r_stats = simulate_point(reqs, ALL_AT_ONCE, ConstantCost(0.01),
                                       SimConfig(**base, kv_allocation="reserved"))
    assert r_stats.mean_batch < p_stats.mean_batch
    assert r_dur > p_dur
    assert r_stats.num_preemptions == 0  # reserving the whole output up front never runs out mid-sequence


def test_run_simulation_has_bench_serves_shape():
    reqs = workload(8)
    cfg = SimConfig(num_kv_blocks=128, block_size=16)
    result = run_simulation(reqs, [LoadPoint(4.0), LoadPoint(math.inf, 2)], ConstantCost(0.01), cfg,
                            workload=WorkloadSpec(num_prompts=8), model_id="m")
    assert result["benchmark"] == "serve" and result["simulated"] is True
    assert [r["request_rate"] for r in result["runs"]] == [4.0, "inf"]
    assert [r["max_concurrency"] for r in result["runs"]] == [None, 2]
    expected = set(compute_metrics([], 1.0)) | {"request_rate", "burstiness", "max_concurrency", "num_prompts"}
    assert expected <= set(result["runs"][0])
    assert result["runs"][0]["completed"] == 8
    assert result["simulation"]["cost_model"] == {"kind": "constant", "step_time_s": 0.01}


def _step_records(steps) -> list[tuple]:
    """What the scheduler decided each step, leaving out when and how long."""
    return [(s.step, s.seqs, s.num_preemptions, s.num_prefill_tokens, s.num_decode_tokens, s.prefix_hit_tokens,
             s.kv_blocks_used, s.num_running, s.num_waiting, s.total_context) for s in steps]


@pytest.fixture(scope="module")
def tiny_loaded():
    return load_model("random:smollm2-135m?num_layers=2", dtype="float32", device="cpu", seed=0)


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_the_simulator_schedules_step_by_step_as_the_engine_serving_a_model(tiny_loaded, batching):
    # Shared prefixes (prefix-cache hits), chunked prefill (16 tokens a step) and a pool too small for
    # every sequence at once (preemption): the simulated run and an EngineCore running a real model
    # on the same requests, all there at the first step, make the same batches and the same preemptions.
    prefix = list(range(1000, 1012))
    reqs = [req(prefix + [2000 + i, 2100 + i, 2200 + i], 6 + 3 * i) for i in range(4)]
    reqs += [req(list(range(3000 + 40 * i, 3013 + 40 * i)), 9) for i in range(3)]
    cfg = SimConfig(num_kv_blocks=14, block_size=4, max_num_seqs=6, max_num_batched_tokens=16, batching=batching)
    trace = io.StringIO()
    results, _, stats = simulate_point(reqs, ALL_AT_ONCE, ConstantCost(0.01), cfg, trace=trace)
    simulated = [msgspec.json.decode(line, type=StepStats) for line in trace.getvalue().splitlines()
                 if json.loads(line)["type"] == "step"]

    config = dataclasses.replace(cfg.engine_config(tiny_loaded.name, "float32"), step_history=1000)
    core = EngineCore(config, tiny_loaded)
    for i, r in enumerate(reqs):
        params = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
        core.add_request(EngineCoreRequest(str(i), list(r.prompt), params, 0.0))
    while core.has_unfinished_requests():
        core.step()
    core.block_manager.check_no_leaks()

    assert _step_records(simulated) == _step_records(core.step_history)
    assert stats.num_steps == core.num_steps and stats.num_preemptions == core.num_preemptions
    assert stats.num_preemptions > 0 and stats.prefix_hit_tokens == core.prefix_hit_tokens > 0
    assert [r.output_len for r in results] == [r.output_len for r in reqs]


def test_virtual_time_is_the_cost_models_and_a_prefix_cache_hit_shortens_the_prompt():
    # 10 ms a step + 1 ms per prompt token. A prefills 12 tokens alone (22 ms) and finishes; B, sent at
    # 1 s, shares A's first two blocks: only its last 4 tokens are computed (14 ms).
    cost = LinearCost(intercept_s=0.010, per_prefill_token_s=0.001, per_decode_seq_s=0.0, per_context_token_s=0.0)
    prefix = list(range(1000, 1008))
    reqs = [req(prefix + [1, 2, 3, 4], 1), req(prefix + [5, 6, 7, 8], 1)]
    trace = io.StringIO()
    results, duration, stats = simulate_point(reqs, LoadPoint(1.0), cost, SimConfig(num_kv_blocks=16, block_size=4),
                                              burstiness=1e9, trace=trace)
    steps = [json.loads(line) for line in trace.getvalue().splitlines() if json.loads(line)["type"] == "step"]
    assert [(s["num_prefill_tokens"], s["prefix_hit_tokens"]) for s in steps] == [(12, 0), (4, 8)]
    assert [s["duration"] for s in steps] == pytest.approx([0.022, 0.014])
    assert [r.ttft for r in results] == pytest.approx([0.022, 0.014])
    assert stats.prefix_hit_tokens == 8 and stats.busy_s == pytest.approx(0.036)
    assert duration == pytest.approx(results[1].start_time + 0.014)

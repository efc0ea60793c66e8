"""Cost models: the roofline agrees with the planner's own decode and prefill costs, and the
calibrated model recovers the coefficients that produced its steps, from a trace or a batch sweep."""

from __future__ import annotations

import io
import json
import math

import pytest

from iterserve import planner
from iterserve.bench.serve import LoadPoint
from iterserve.bench.workloads import WorkloadSpec, make_workload
from iterserve.simulate.cost import (
    ConstantCost,
    LinearCost,
    RooflineCost,
    StepShape,
    TimedStep,
    fit_linear,
    fit_request_timing,
    steps_from_batch,
    steps_from_trace,
)
from iterserve.simulate.planning import planner_terms
from iterserve.simulate.runner import SimConfig, run_simulation, simulate_point


@pytest.fixture(scope="module")
def a100_13b():
    return planner_terms("llama-2-13b", "bf16", gpu="A100-40GB")


def test_roofline_decode_step_matches_the_planner(a100_13b):
    cfg, hw = planner.load_model_config("llama-2-13b"), planner.get_accelerator("A100-40GB")
    cost = RooflineCost(a100_13b)
    for batch, context in ((1, 512), (64, 1024), (512, 128)):
        # a decode step: each sequence adds one token to `context - 1` cached ones and attends all `context`
        shape = StepShape(0, batch, batch * context, batch * context, 0, batch)
        expected = planner.roofline(planner.decode_cost(cfg, batch, context), hw)
        assert cost.step_time(shape) == pytest.approx(expected.time_s, rel=1e-9)


def test_roofline_reads_quantized_weights_as_the_planner_counts_them():
    """The simulator's weight bytes come from the planner's one count: a Q4_1 decode step costs what the
    planner's does, and the KV pool gets the memory the smaller weights leave."""
    cfg, hw = planner.load_model_config("llama-2-13b"), planner.get_accelerator("A100-40GB")
    dense = planner_terms("llama-2-13b", "bf16", gpu="A100-40GB")
    q4 = planner_terms("llama-2-13b", "bf16", gpu="A100-40GB", quantization="q4_1")
    assert q4.streamed_weight_bytes == planner.streamed_weight_bytes(cfg, "bf16", "q4_1")
    assert q4.kv_pool_bytes - dense.kv_pool_bytes == dense.weight_bytes - q4.weight_bytes > 0
    shape = StepShape(0, 1, 512, 512, 0, 1)
    expected = planner.roofline(planner.decode_cost(cfg, 1, 512, quantization="q4_1"), hw)
    assert RooflineCost(q4).step_time(shape) == pytest.approx(expected.time_s, rel=1e-9)
    assert RooflineCost(q4).step_time(shape) < 0.5 * RooflineCost(dense).step_time(shape)
    assert RooflineCost(q4).describe()["quantization"].startswith("Q4_1")


def test_roofline_prefill_matches_the_planner_and_overhead_adds(a100_13b):
    cfg, hw = planner.load_model_config("llama-2-13b"), planner.get_accelerator("A100-40GB")
    n = 2000
    shape = StepShape(n, 0, n, n * (n + 1) // 2, 1, 1)
    expected = planner.roofline(planner.prefill_cost(cfg, n), hw)
    assert expected.bound == "compute"
    assert RooflineCost(a100_13b).step_time(shape) == pytest.approx(expected.time_s, rel=1e-9)
    assert RooflineCost(a100_13b, 0.003).step_time(shape) == pytest.approx(expected.time_s + 0.003, rel=1e-9)


def test_roofline_needs_an_accelerator_and_reads_custom_numbers():
    with pytest.raises(ValueError, match="needs an accelerator"):
        RooflineCost(planner_terms("llama-2-13b"))
    with pytest.raises(ValueError, match="both --flops and --bandwidth"):
        planner_terms("llama-2-13b", flops="312")
    terms = planner_terms("llama-2-13b", flops="100", bandwidth="1000")
    assert (terms.peak_flops, terms.bandwidth) == (100e12, 1000e9)
    faster = planner_terms("llama-2-13b", gpu="A100-40GB", bandwidth="3000")
    assert faster.bandwidth == 3000e9
    assert faster.kv_pool_bytes == int(40 * 2**30 * 0.9) - faster.weight_bytes


def test_fit_linear_recovers_known_coefficients_and_clips_negative_ones():
    truth = LinearCost(0.004, 2e-5, 3e-4, 1e-7)
    shapes = [StepShape(p, d, c) for p in (0, 16, 300) for d in (1, 8, 40) for c in (100, 5000, 40000)]
    fit = fit_linear([TimedStep(s, truth.step_time(s)) for s in shapes])
    for name in ("intercept_s", "per_prefill_token_s", "per_decode_seq_s", "per_context_token_s"):
        assert getattr(fit, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    assert fit.mean_abs_rel_error == pytest.approx(0.0, abs=1e-9)
    # times that fall with context: the context term would come out negative, so it is fixed at zero
    falling = [TimedStep(s, 0.01 + 1e-4 * s.decode_seqs - 1e-8 * s.total_context) for s in shapes]
    assert fit_linear(falling).per_context_token_s == 0.0
    # steps whose time grows faster than linearly would want a negative intercept: a step never takes < 0 s
    steep = [TimedStep(s, 1e-4 * s.decode_seqs**2) for s in shapes]
    fit = fit_linear(steep)
    assert fit.intercept_s == 0.0 and fit.per_decode_seq_s > 0
    assert all(fit.step_time(StepShape(0, 1, c)) > 0 for c in (1, 100))
    with pytest.raises(ValueError, match="at least 4"):
        fit_linear(falling[:3])


def test_fit_per_batch_size_follows_a_step_time_that_is_not_linear_in_the_batch():
    # a CPU-like decode cost: batch 2 and 3 dearer than batch 4 and 8 (small-batch GEMMs); sizes 5-7 unseen
    decode = {1: 0.040, 2: 0.090, 3: 0.100, 4: 0.085, 8: 0.095}
    truth = lambda p, d, c: 0.010 + 2e-4 * p + decode.get(d, 0.0) + 1e-6 * c  # noqa: E731
    shapes = [StepShape(p, d, c) for p in (0, 64, 200) for d in (0, *decode) for c in (100, 900, 3000)
              if p or d]
    steps = [TimedStep(s, truth(s.prefill_tokens, s.decode_seqs, s.total_context)) for s in shapes]
    fit = fit_linear(steps, per_batch_size=True)
    assert fit.mean_abs_rel_error == pytest.approx(0.0, abs=1e-9)
    assert fit.intercept_s == pytest.approx(0.010, rel=1e-6)
    assert fit.per_prefill_token_s == pytest.approx(2e-4, rel=1e-6)
    assert [fit.decode_s(b) for b in (1, 2, 3, 4, 8)] == pytest.approx([decode[b] for b in (1, 2, 3, 4, 8)])
    assert fit.decode_s(6) == pytest.approx(0.090)  # halfway between the batches of 4 and 8
    assert fit.decode_s(10) == pytest.approx(0.095 + 2 * 0.0025)  # the slope from 4 to 8 carries on
    # the straight line cannot follow it
    assert fit_linear(steps).mean_abs_rel_error > 0.05


def test_profile_round_trip(tmp_path):
    profile = LinearCost(0.001, 1e-5, 2e-4, 3e-8, source="t.jsonl", num_steps=9, mean_abs_rel_error=0.05,
                         request_latency_s=0.01, admission_interval_s=0.002, decode_batch_s=(0.0, 0.04, 0.09))
    path = tmp_path / "p.json"
    profile.save(path)
    assert LinearCost.load(path) == profile
    (tmp_path / "bad.json").write_text(json.dumps({"intercept_s": 1}))
    with pytest.raises(ValueError, match="not a step profile"):
        LinearCost.load(tmp_path / "bad.json")


def test_a_busy_engines_step_lasts_until_the_next_one_starts(tmp_path):
    steps = [
        {"type": "step", "start": 10.0, "duration": 0.1, "num_running": 1, "seqs": [["a", "prefill", 4]]},
        {"type": "step", "start": 10.15, "duration": 0.1, "num_running": 0, "seqs": [["a", "decode", 1]]},
        {"type": "step", "start": 20.0, "duration": 0.2, "num_running": 1, "seqs": [["b", "prefill", 4]]},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in steps))
    # busy after step 1: the 0.05 s between forward passes counts; idle after step 2: its duration; last: duration
    assert [s.seconds for s in steps_from_trace(path)] == pytest.approx([0.15, 0.1, 0.2])


def test_trace_contexts_are_rebuilt_and_restart_after_a_preemption(tmp_path):
    steps = [
        {"type": "step", "duration": 0.1, "seqs": [["a", "prefill", 5], ["b", "prefill", 3]]},
        {"type": "request", "request_id": "x"},
        {"type": "step", "duration": 0.2, "seqs": [["a", "decode", 1], ["b", "prefill", 4]]},
        {"type": "step", "duration": 0.3, "seqs": [["a", "decode", 1], ["b", "decode", 1]]},
        {"type": "step", "duration": 0.4, "seqs": [["b", "decode", 1], ["a", "prefill", 8]]},  # a recomputed
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in steps))
    got = steps_from_trace(path)
    assert [(s.shape.prefill_tokens, s.shape.decode_seqs, s.shape.total_context) for s in got] == [
        (8, 0, 8), (4, 1, 6 + 7), (0, 2, 7 + 8), (8, 1, 9 + 8)]
    assert [s.seconds for s in got] == [0.1, 0.2, 0.3, 0.4]


def test_batch_sweep_steps(tmp_path):
    path = tmp_path / "batch.json"
    points = [{"batch_size": 2, "decode_s": 0.01, "prefill_s": 0.05},
              {"batch_size": 4, "decode_s": 0.012, "prefill_s": None}]
    path.write_text(json.dumps({"benchmark": "batch", "context": 100, "points": points}))
    got = [(s.shape.prefill_tokens, s.shape.decode_seqs, s.shape.total_context, s.seconds)
           for s in steps_from_batch(path)]
    assert got == [(0, 2, 202, 0.01), (200, 0, 200, 0.05), (0, 4, 404, 0.012)]


def test_calibrating_on_a_simulated_trace_recovers_the_model_that_timed_it(tmp_path):
    """The simulator's step trace is the engine's format: fitting it gives back the cost model used."""
    truth = LinearCost(0.002, 1e-5, 4e-4, 2e-7)
    reqs = make_workload(WorkloadSpec(num_prompts=40, input_len="uniform:16:200", output_len="uniform:2:40"),
                         tokenizer=None, vocab_size=1000)
    trace = io.StringIO()
    cfg = SimConfig(num_kv_blocks=64, block_size=16, max_num_seqs=12, max_num_batched_tokens=256)
    _, _, stats = simulate_point(reqs, LoadPoint(math.inf), truth, cfg, trace=trace)
    assert stats.num_preemptions > 0  # the small pool makes the trace exercise recomputation
    records = [json.loads(line) for line in trace.getvalue().splitlines()]
    assert sum(r["type"] == "request" for r in records) == 40
    path = tmp_path / "sim.jsonl"
    path.write_text(trace.getvalue())
    fit = fit_linear(steps_from_trace(path))
    assert fit.mean_abs_rel_error < 1e-6
    assert fit.per_decode_seq_s == pytest.approx(truth.per_decode_seq_s, rel=1e-4)
    assert fit.per_context_token_s == pytest.approx(truth.per_context_token_s, rel=1e-4)


def test_request_timing_is_recovered_from_a_simulated_runs_client_results_and_engine_trace(tmp_path):
    """The simulator writes the engine's side (trace) and the client's (bench serve JSON) of a run
    with a known round trip and admission interval; pairing the two gives both back."""
    spec = WorkloadSpec(num_prompts=24, input_len="uniform:16:200", output_len="uniform:2:40")
    reqs = make_workload(spec, tokenizer=None, vocab_size=1000)
    cfg = SimConfig(num_kv_blocks=256, block_size=16, max_num_seqs=8, request_latency_s=0.03,
                    admission_interval_s=0.002)
    trace = io.StringIO()
    trace.write(json.dumps({"type": "request", "num_prompt_tokens": 5, "num_output_tokens": 1, "ttft": 0.1,
                            "arrival_time": 0.0}) + "\n")  # a readiness probe: in the trace, not the client's
    points = [LoadPoint(math.inf, c) for c in (2, 8)]
    result = run_simulation(reqs, points, LinearCost(0.01, 1e-4, 1e-3, 0.0), cfg, workload=spec, trace=trace)
    (tmp_path / "trace.jsonl").write_text(trace.getvalue())
    (tmp_path / "serve.json").write_text(json.dumps(result))
    timing = fit_request_timing([(tmp_path / "trace.jsonl", tmp_path / "serve.json")])
    assert timing.num_requests == 48
    assert timing.request_latency_s == pytest.approx(0.03, rel=1e-6)
    assert timing.admission_interval_s == pytest.approx(0.002, rel=1e-6)
    assert timing.num_bursts >= 2  # each concurrency run starts with one
    with pytest.raises(ValueError, match="not a bench serve result"):
        fit_request_timing([(tmp_path / "trace.jsonl", tmp_path / "trace.jsonl")])


def test_constant_cost_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        ConstantCost(0.0)

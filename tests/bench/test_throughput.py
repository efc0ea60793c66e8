"""bench throughput: continuous batching packs more output tokens into each engine step than static
batching on the same workload (counted tokens and steps, never wall-clock), and what the CLI writes."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from iterserve.bench.machine import MachineMonitor
from iterserve.bench.report import throughput_report
from iterserve.bench.throughput import run_hf_static, run_throughput, token_prompts
from iterserve.bench.timeline import joins_chart, read_trace, sequence_spans, timeline_chart
from iterserve.bench.workloads import Request, WorkloadSpec, make_workload
from iterserve.cli.main import main
from iterserve.config import EngineConfig
from iterserve.models.loader import load_model

TINY = "random:smollm2-135m?num_layers=2"
MAX_SEQS = 4


@pytest.fixture(scope="module")
def loaded():
    return load_model(TINY, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def workload(loaded):
    spec = WorkloadSpec(num_prompts=12, input_len="uniform:8:32", output_len="uniform:2:40", seed=3)
    return make_workload(spec, tokenizer=loaded.tokenizer)


@pytest.fixture(scope="module")
def result(loaded, workload, tmp_path_factory):
    config = EngineConfig(model=TINY, dtype="float32", device="cpu", num_kv_blocks=128, max_num_seqs=MAX_SEQS)
    trace_dir = tmp_path_factory.mktemp("traces")
    return run_throughput(loaded, config, workload, ["continuous", "static"], trace_dir=str(trace_dir), use_tqdm=False)


def test_continuous_batching_yields_more_tokens_per_step_than_static(result, workload):
    runs = {r["mode"]: r for r in result["runs"]}
    c, s = runs["continuous"], runs["static"]
    wanted = sum(r.output_len for r in workload)
    assert c["total_output_tokens"] == s["total_output_tokens"] == wanted  # ignore_eos: every token asked for
    assert c["peak_running"] == s["peak_running"] == MAX_SEQS
    # Static batching: each batch of MAX_SEQS takes as many steps as its longest output (its prefill
    # step yields the first token), however short the others are.
    batches = [workload[i:i + MAX_SEQS] for i in range(0, len(workload), MAX_SEQS)]
    assert s["num_steps"] == sum(max(r.output_len for r in b) for b in batches)
    assert c["num_steps"] < s["num_steps"]
    assert c["output_tokens_per_step"] > s["output_tokens_per_step"]
    assert result["continuous_over_static_per_step"] == pytest.approx(s["num_steps"] / c["num_steps"])
    assert c["latency"]["median_ttft_ms"] > 0 and "p99_tpot_ms" in c["latency"]
    # a slot is busy on every step of a static batch only while its sequence runs, so static
    # batching holds its slots less full than continuous batching
    assert s["slot_occupancy"] < c["slot_occupancy"] <= 1
    assert c["mean_running"] == pytest.approx(c["slot_occupancy"] * MAX_SEQS)
    assert c["joined_running_batch"] > 0 and s["joined_running_batch"] == 0  # static admits only into empty slots


def test_step_traces_account_for_every_token(result, workload):
    for run in result["runs"]:
        steps, requests = read_trace(run["step_trace"])
        assert len(steps) == run["num_steps"] and len(requests) == len(workload)
        decoded = {}
        for step in steps:
            for rid, phase, n, *_ in step["seqs"]:
                if phase == "decode":
                    decoded[rid] = decoded.get(rid, 0) + n
        out = {r["request_id"]: r["num_output_tokens"] for r in requests}
        assert all(decoded.get(rid, 0) == n - 1 for rid, n in out.items())  # the prefill step made the first
        spans = sequence_spans(steps)
        assert set(spans) == set(out)
    # static: no request of the second batch is scheduled before the whole first batch has finished
    _, requests = read_trace(next(r["step_trace"] for r in result["runs"] if r["mode"] == "static"))
    order = sorted(requests, key=lambda r: r["arrival_time"])
    assert max(r["finished_time"] for r in order[:MAX_SEQS]) <= min(r["first_scheduled_time"] for r in order[MAX_SEQS:])


def test_cli_writes_json_table_and_timeline(loaded, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("iterserve.models.loader.load_model", lambda *a, **k: loaded)
    out, timeline = tmp_path / "tp.json", tmp_path / "timeline.png"
    rc = main(["--log-level", "WARNING", "bench", "throughput", "--model", TINY, "--dtype", "float32",
               "--num-kv-blocks", "64", "--max-num-seqs", "2", "--num-prompts", "5", "--input-len", "uniform:4:16",
               "--output-len", "lognormal:6:1:20", "--modes", "continuous,static,reserved", "--timeline", str(timeline),
               "--output-json", str(out), "--disable-tqdm"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "continuous / static:" in text and "out tok/step" in text
    data = json.loads(out.read_text())
    assert [r["mode"] for r in data["runs"]] == ["continuous", "static", "reserved"]
    assert data["workload"]["num_prompts"] == 5 and data["engine"]["max_num_seqs"] == 2
    assert all(r["step_trace"] is None for r in data["runs"])  # temporary traces are not referenced
    assert timeline.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_rejects_bad_modes_and_step_trace(capsys):
    assert main(["bench", "throughput", "--modes", "continuous,bogus", "--model", "no-such-model"]) == 2
    assert main(["bench", "throughput", "--step-trace", "x.jsonl"]) == 2
    assert "--trace-dir" in capsys.readouterr().err


def test_prompts_that_do_not_fit_are_skipped(loaded):
    config = EngineConfig(model=TINY, dtype="float32", device="cpu", num_kv_blocks=8, max_model_len=64)
    reqs = [Request([101] * 10, 10, 4), Request([102] * 60, 60, 10), Request([103] * 5, 5, 3)]
    result = run_throughput(loaded, config, reqs, ["continuous"], use_tqdm=False)
    assert result["num_requests"] == 2 and result["runs"][0]["total_output_tokens"] == 7


def test_hf_baseline_runs_padded_batches_to_their_longest_output(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=128)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    tiny = load_model(str(tmp_path), dtype="float32", device="cpu")
    reqs = [Request([101 + i] * (3 + i), 3 + i, n) for i, n in enumerate([3, 1, 4, 2, 5])]
    run = run_hf_static(tiny, reqs, token_prompts(reqs, None), batch_size=2, use_tqdm=False)
    assert run.num_steps == 3 + 4 + 5 and run.total_output_tokens == 15 and run.peak_running == 2
    assert run.output_tokens_per_step == pytest.approx(15 / 12)


def quiet_monitor() -> MachineMonitor:
    return MachineMonitor(probe=lambda: 0.010, loadavg=lambda: 0.5, cpu_count=4, others=lambda: 0.0)


def test_repeats_keep_every_runs_wall_clock_and_one_set_of_counts(loaded, workload):
    config = EngineConfig(model=TINY, dtype="float32", device="cpu", num_kv_blocks=128, max_num_seqs=MAX_SEQS)
    result = run_throughput(loaded, config, workload[:6], ["continuous", "static"], repeats=3, use_tqdm=False,
                            monitor=quiet_monitor())
    assert result["repeats"] == 3 and len(result["continuous_over_static_runs"]) == 3
    for run in result["runs"]:
        assert run["repeats"] == 3 and len(run["elapsed_s_runs"]) == len(run["latency_runs"]) == 3
        assert run["elapsed_s"] == pytest.approx(sorted(run["elapsed_s_runs"])[1])  # the median of three
        assert run["output_throughput_runs"] == pytest.approx([run["total_output_tokens"] / e
                                                               for e in run["elapsed_s_runs"]])
        ttfts = sorted(r["median_ttft_ms"] for r in run["latency_runs"])
        assert run["latency"]["median_ttft_ms"] == pytest.approx(ttfts[1])
    assert result["busy_warning"] is None and result["machine"]["busy"] is False
    report = throughput_report(result)
    assert "median of 3 runs" in report and "warning" not in report


def test_busy_machine_is_reported_from_injected_readings(loaded, workload):
    config = EngineConfig(model=TINY, dtype="float32", device="cpu", num_kv_blocks=128, max_num_seqs=MAX_SEQS)
    probes = iter([0.010, 0.031])  # the probe ran three times slower after the run than before it
    monitor = MachineMonitor(probe=lambda: next(probes), loadavg=lambda: 0.5, cpu_count=4, others=lambda: 0.0)
    result = run_throughput(loaded, config, workload[:3], ["continuous"], use_tqdm=False, monitor=monitor)
    assert result["machine"]["busy"] and result["machine"]["probe_s"] == [0.010, 0.031]
    assert "3.1x slower" in result["busy_warning"]
    assert result["busy_warning"] in throughput_report(result)
    loaded_box = MachineMonitor(probe=lambda: 0.010, loadavg=lambda: 9.0, cpu_count=2, others=lambda: 0.0)
    loaded_box.sample()
    assert loaded_box.check.reasons == ["load average 9.00 on 2 cores"]
    assert quiet_monitor().check.warning() is None


def test_emulated_end_of_sequence_reserves_the_cap_but_pages_what_is_used(loaded, tmp_path):
    config = EngineConfig(model=TINY, dtype="float32", device="cpu", num_kv_blocks=64, block_size=16, max_num_seqs=2)
    request = Request([101 + i for i in range(20)], 20, 60)
    result = run_throughput(loaded, config, [request], ["continuous", "reserved"], max_tokens_cap=512,
                            trace_dir=str(tmp_path), use_tqdm=False, monitor=quiet_monitor())
    runs = {r["mode"]: r for r in result["runs"]}
    for run in runs.values():
        assert run["total_output_tokens"] == 60
        _, records = read_trace(run["step_trace"])
        assert [r["num_output_tokens"] for r in records] == [60]
    assert runs["reserved"]["peak_kv_blocks"] == -(-(20 + 512) // 16)  # prompt + the whole cap, from admission
    assert runs["continuous"]["peak_kv_blocks"] <= -(-(20 + 60) // 16)  # only the tokens written
    steps, _ = read_trace(runs["reserved"]["step_trace"])
    assert {s["kv_blocks_used"] for s in steps} == {34}


def test_paged_allocation_fits_more_sequences_than_reserved_under_a_cap(loaded):
    config = EngineConfig(model=TINY, dtype="float32", device="cpu", num_kv_blocks=40, block_size=16, max_num_seqs=8)
    reqs = [Request([101 + i] * 16, 16, 8) for i in range(8)]
    result = run_throughput(loaded, config, reqs, ["continuous", "reserved"], max_tokens_cap=128, use_tqdm=False,
                            monitor=quiet_monitor())
    runs = {r["mode"]: r for r in result["runs"]}
    assert runs["continuous"]["peak_running"] == 8
    assert runs["reserved"]["peak_running"] == 40 // -(-(16 + 128) // 16)  # 4 reservations of 9 blocks
    assert runs["continuous"]["num_steps"] < runs["reserved"]["num_steps"]


def test_timeline_in_steps_and_joins_chart(result, tmp_path):
    traces = {r["mode"]: r["step_trace"] for r in result["runs"]}
    for x in ("steps", "time"):
        timeline_chart(traces, tmp_path / "new" / f"{x}.png", x=x, max_num_seqs=MAX_SEQS, stamp="a CPU, load 0.1")
        assert (tmp_path / "new" / f"{x}.png").read_bytes()[:4] == b"\x89PNG"  # its folder created
    joined = joins_chart(traces["continuous"], tmp_path / "joins.png", max_num_seqs=MAX_SEQS)
    assert joined == next(r["joined_running_batch"] for r in result["runs"] if r["mode"] == "continuous")
    with pytest.raises(ValueError, match="x-axis"):
        timeline_chart(traces, tmp_path / "bad.png", x="wall")


def test_requests_arrive_at_their_times_and_wait_from_then(loaded):
    from iterserve.bench.throughput import drive
    from iterserve.engine.llm_engine import LLMEngine
    from iterserve.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=TINY, dtype="float32", device="cpu", num_kv_blocks=64), loaded)
    reqs = [Request([101 + i] * 8, 8, 3) for i in range(3)]
    params = [SamplingParams(max_tokens=3, ignore_eos=True, temperature=0)] * 3
    outs = drive(engine, reqs, [r.prompt for r in reqs], params, arrivals=[0.0, 0.3, 0.3], use_tqdm=False)
    engine.close()
    t0 = outs[0].metrics.arrival_time
    assert [o.metrics.arrival_time - t0 for o in outs] == pytest.approx([0.0, 0.3, 0.3])
    assert all(o.metrics.first_scheduled_time >= o.metrics.arrival_time for o in outs)  # none ran before it came
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3, 3]


def test_dynamic_batching_offline_runs_as_static_when_every_request_is_queued_at_once(loaded, workload):
    config = EngineConfig(model=TINY, dtype="float32", device="cpu", num_kv_blocks=128, max_num_seqs=MAX_SEQS,
                          max_batch_wait=0.05)
    result = run_throughput(loaded, config, workload, ["static", "dynamic"], use_tqdm=False, monitor=quiet_monitor())
    static, dynamic = result["runs"]
    assert dynamic["num_steps"] == static["num_steps"] and dynamic["mean_running"] == static["mean_running"]


def test_speculation_against_no_spec_in_one_run(loaded, workload):
    """With --speculative-config, continuous decodes with drafts and no-spec without: the same tokens in
    fewer steps, the acceptance counted from the step trace, the speed-up reported."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    config = EngineConfig(model=TINY, dtype="float32", device="cpu", num_kv_blocks=128, max_num_seqs=MAX_SEQS,
                          speculative_config=spec)
    result = run_throughput(loaded, config, workload, ["continuous", "no-spec"], use_tqdm=False)
    runs = {r["mode"]: r for r in result["runs"]}
    spec_run, plain = runs["continuous"], runs["no-spec"]
    assert spec_run["total_output_tokens"] == plain["total_output_tokens"]
    assert plain["num_drafts"] == 0 and plain["acceptance_rate"] is None
    assert spec_run["num_accepted_tokens"] > 0  # greedy on random weights repeats itself: lookup drafts it
    assert spec_run["num_steps"] <= plain["num_steps"] - spec_run["num_accepted_tokens"] // MAX_SEQS
    assert spec_run["mean_accepted_length"] == pytest.approx(
        1 + spec_run["num_accepted_tokens"] / spec_run["num_drafts"])
    assert result["spec_over_no_spec"] > 0 and result["engine"]["speculative_config"]["num_speculative_tokens"] == 3
    report = throughput_report(result)
    assert "mean accepted length" in report and "speculative / no-spec" in report
    for run in result["runs"]:  # as on a workload where nothing matches: the cost of looking is still shown
        run.update(num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0)
    report = throughput_report(result)
    assert "mean accepted length" not in report and "speculative / no-spec" in report

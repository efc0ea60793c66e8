"""bench batch: the step timer runs the shapes it claims, the sweep's arithmetic, the planner's timer."""

from __future__ import annotations

import json

import pytest

from iterserve.bench.batch import BatchSweep, StepTimer, decode_step_timer, default_batch_sizes, sweep_batches
from iterserve.bench.knee import measured_knee, non_monotone_steps, read_knee
from iterserve.bench.validate import default_decode_timer
from iterserve.cli.main import main
from iterserve.models.loader import load_model

TINY = "random:smollm2-135m?num_layers=2"
NO_TOKENIZER = ("random:llama-3-8b?num_layers=1&vocab_size=1024&hidden_size=64&intermediate_size=128&num_heads=4"
                "&num_kv_heads=2&head_dim=16")


@pytest.fixture(scope="module")
def loaded():
    return load_model(TINY, dtype="float32", device="cpu")


def test_timer_runs_decode_and_prefill_shapes(loaded):
    seen = []
    hook = loaded.model.register_forward_pre_hook(lambda _m, args: seen.append((args[1].tolist(), args[3])))
    try:
        timer = StepTimer(loaded)
        assert timer.decode(3, 40) > 0 and timer.prefill(2, 24) > 0
    finally:
        hook.remove()
    (dec_positions, dec_meta), (pre_positions, pre_meta) = seen
    assert dec_positions == [40, 40, 40] and dec_meta.num_decode_tokens == 3 and not dec_meta.prefills
    # the prompts are attended as the engine attends them: as decode rows under the backend's limit, else spans
    as_decodes = timer.runner is not None and timer.runner.attn_backend.decode_prompts_up_to >= 24
    assert pre_positions == list(range(24)) * 2
    assert (pre_meta.num_decode_tokens, len(pre_meta.prefills)) == ((48, 0) if as_decodes else (0, 2))


def test_timer_rejects_bad_shapes(loaded):
    timer = StepTimer(loaded)
    with pytest.raises(ValueError, match="batch size must be a positive integer"):
        timer.decode(0, 16)
    with pytest.raises(ValueError, match=r"context must be an integer in \[1, 8191\]"):
        timer.decode(1, 8192)
    with pytest.raises(ValueError, match=r"context must be an integer in \[1, 8192\]"):
        timer.prefill(1, 0)


def test_sweep_points_and_knee_definition(loaded):
    sweep = sweep_batches(loaded, [4, 1, 2, 2], context=32, repeats=1, use_tqdm=False)
    assert [p.batch_size for p in sweep.points] == [1, 2, 4]
    for p in sweep.points:
        assert p.decode_tokens_per_s == pytest.approx(p.batch_size / p.decode_s)
        assert p.ms_per_token == pytest.approx(p.decode_s * 1000 / p.batch_size)
        assert p.prefill_tokens_per_s == pytest.approx(p.batch_size * 32 / p.prefill_s)
    # the knee follows the rule on whatever these timings were (refused when a busy machine made them non-monotone)
    assert (sweep.knee_batch_size, sweep.knee_refused) == read_knee([1, 2, 4], [p.decode_s for p in sweep.points], 0.5)
    assert sweep.max_gain_at_knee == pytest.approx(2**0.5 - 1)
    decode_only = sweep_batches(loaded, [1], context=16, repeats=1, prefill=False, use_tqdm=False)
    assert decode_only.points[0].prefill_s is None
    with pytest.raises(ValueError, match="elasticity"):
        sweep_batches(loaded, [1], elasticity=1.0, use_tqdm=False)


def test_default_batch_sizes_stop_where_the_kv_cache_is_full(loaded):
    # 2 layers x (K, V) x 3 KV heads x 64 dims x 4 bytes = 3072 bytes/token; context 31 (+1) = 2 blocks = 32 tokens
    assert default_batch_sizes(loaded, 31, "1MiB", 256) == [1, 2, 4, 8]  # 1 MiB / 98304 B = 10 sequences
    assert default_batch_sizes(loaded, 31, "1MiB", 4) == [1, 2, 4]
    with pytest.raises(ValueError, match="needs more KV cache"):
        default_batch_sizes(loaded, 31, "64KiB", 4)


def test_planner_default_timer_times_the_engine_step():
    timer = default_decode_timer(NO_TOKENIZER, "fp32")
    assert timer(2, 32) > 0
    assert decode_step_timer(load_model(NO_TOKENIZER, "float32", "cpu"))(1, 8) > 0


def test_cli_prints_table_and_writes_json_and_chart(loaded, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("iterserve.models.loader.load_model", lambda *a, **k: loaded)
    monkeypatch.setattr("iterserve.bench.machine.others_cpu_share", lambda: 0.0)
    out = tmp_path / "batch.json"
    rc = main(["bench", "batch", "--model", TINY, "--batch-sizes", "1,2,4", "--context", "16", "--repeats", "1",
               "--output-json", str(out), "--disable-tqdm", "--allow-busy"])  # a slow probe must not hold the chart
    assert rc == 0
    text = capsys.readouterr().out
    assert "decode tok/s" in text and "knee:" in text and "batch-1 decode reads" in text
    data = json.loads(out.read_text())
    assert len(data["machine"]["probe_s"]) == 2 and (data["busy_warning"] is None) == (not data["machine"]["busy"])
    assert data["benchmark"] == "batch" and [p["batch_size"] for p in data["points"]] == [1, 2, 4]
    assert set(data) >= {f.name for f in BatchSweep.__dataclass_fields__.values()} | {"max_gain_at_knee"}
    assert (tmp_path / "batch.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["bench", "batch", "--batch-sizes", "1,2.5"]) == 2


def test_cli_refuses_the_knee_chart_when_other_processes_kept_the_machine_busy(loaded, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("iterserve.models.loader.load_model", lambda *a, **k: loaded)
    monkeypatch.setattr("iterserve.bench.machine.others_cpu_share", lambda: 0.9)
    args = ["bench", "batch", "--model", TINY, "--batch-sizes", "1,2", "--context", "16", "--repeats", "1",
            "--disable-tqdm", "--chart", str(tmp_path / "busy.png")]
    assert main(args) == 0
    said = capsys.readouterr().out
    assert "decode tok/s" in said and "not drawing the batch sweep (its knee)" in said and "90% of the" in said
    assert not (tmp_path / "busy.png").exists()
    assert main([*args, "--allow-busy"]) == 0
    assert (tmp_path / "busy.png").read_bytes()[:4] == b"\x89PNG"


def test_no_knee_is_called_on_a_non_monotone_sweep():
    # what a loaded machine gave: batch 8 stalled for 2 s, batch 16 took 27 ms
    batches, noisy = [1, 2, 4, 8, 16, 32], [0.020, 0.021, 0.022, 2.136, 0.027, 0.060]
    assert measured_knee(batches, noisy) == 8  # the bare rule would call the stall a knee
    assert non_monotone_steps(batches, noisy) == [16]
    knee, why = read_knee(batches, noisy)
    assert knee is None and "B=16" in why and "rerun" in why
    clean = [0.020, 0.021, 0.022, 0.024, 0.027, 0.060]
    assert read_knee(batches, clean) == (32, None)
    assert read_knee(batches, [0.020, 0.019, 0.022, 0.024, 0.027, 0.060]) == (32, None)  # within the tolerance

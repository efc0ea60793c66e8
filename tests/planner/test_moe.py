"""The planner and the simulator on mixture-of-experts models: a token runs k of E experts, a step reads the
experts its tokens picked, the memory holds them all."""

from __future__ import annotations

import pytest

from iterserve import planner
from iterserve.config import get_preset
from iterserve.planner.weights import expert_share
from iterserve.simulate.cost import RooflineCost, StepShape
from iterserve.simulate.planning import planner_terms

QWEN = get_preset("qwen3-30b-a3b")
MIXTRAL = get_preset("mixtral-8x7b")


def expert_bytes(cfg, dtype_bytes: int = 2) -> int:
    """Every expert of every layer (all layers are sparse in both presets)."""
    return cfg.num_layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.expert_intermediate_size * dtype_bytes


def test_presets_have_the_published_sizes():
    assert round(QWEN.num_parameters() / 1e9, 1) == 30.5 and round(QWEN.active_parameters() / 1e9, 1) == 3.4
    assert round(MIXTRAL.num_parameters() / 1e9, 1) == 46.7 and round(MIXTRAL.active_parameters() / 1e9, 1) == 12.9


@pytest.mark.parametrize("cfg", [QWEN, MIXTRAL], ids=["qwen3-30b-a3b", "mixtral-8x7b"])
def test_decode_reads_the_active_experts_and_memory_holds_all(cfg):
    h, layers = cfg.hidden_size, cfg.num_layers
    attention = layers * (2 * h * cfg.q_size + 2 * h * cfg.kv_size)
    router = layers * cfg.num_experts * h
    head = cfg.vocab_size * h
    # per-token work: attention, router, k experts and the LM head
    active = attention + router + layers * cfg.num_experts_per_tok * 3 * h * cfg.expert_intermediate_size + head
    assert planner.matmul_parameters(cfg) == active
    assert planner.weight_bytes(cfg, "bf16") == 2 * cfg.num_parameters()  # every expert is in memory
    everything = planner.streamed_weight_bytes(cfg, "bf16")
    assert everything == 2 * (attention + router + head) + expert_bytes(cfg)
    for batch in (1, 4, 64):
        share = 1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** batch
        assert expert_share(cfg.num_experts, cfg.num_experts_per_tok, batch) == pytest.approx(share)
        step = planner.decode_cost(cfg, batch, 1024)
        kv = batch * 1024 * cfg.kv_bytes_per_token(2)
        assert step.bytes - kv == pytest.approx(2 * (attention + router + head) + share * expert_bytes(cfg), abs=1)
    one = planner.decode_cost(cfg, 1, 1024).bytes - 1024 * cfg.kv_bytes_per_token(2)
    assert one < 0.35 * everything  # batch 1 reads its k experts: a small part of the weights


def test_dense_models_read_every_weight_at_any_batch():
    cfg = get_preset("llama-3-8b")
    full = planner.streamed_weight_bytes(cfg, "bf16")
    assert all(planner.streamed_weight_bytes(cfg, "bf16", None, b) == full for b in (1, 7, 256))


def test_moe_decode_is_faster_than_its_size_says_and_the_knee_is_the_smallest_compute_bound_batch():
    hw = planner.get_accelerator("H100-SXM")
    plan = planner.build_plan(QWEN, hw, context=1024, batch=1)
    weights_only = planner.weight_bytes(QWEN, "bf16") / hw.bandwidth
    assert plan.tpot_s < 0.3 * weights_only  # reading every expert would take over 3x as long
    assert plan.streamed_weight_bytes < 0.2 * plan.weight_bytes
    knee = planner.decode_knee(QWEN, hw, 64)  # a short context: longer ones stay memory-bound
    assert knee is not None

    def bound(b: int) -> str:
        return planner.roofline(planner.decode_cost(QWEN, b, 64), hw).bound

    assert bound(knee) == "compute" and bound(knee - 1) == "memory"


def test_the_simulator_reads_the_same_bytes_as_the_planner():
    terms = planner_terms("qwen3-30b-a3b", gpu="H100-SXM")
    assert terms.num_experts == 128 and terms.experts_per_token == 8
    cost = RooflineCost(terms)
    for batch in (1, 16):
        shape = StepShape(prefill_tokens=0, decode_seqs=batch, total_context=batch * 512, attention_pairs=batch * 512,
                          sampling_seqs=batch)
        expected = planner.decode_cost(QWEN, batch, 512).bytes
        assert cost.memory_s(shape) * terms.bandwidth == pytest.approx(expected, rel=1e-9)

"""Mixture of experts (Mixtral, Qwen3-MoE) against transformers on tiny seeded-random models."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers

from iterserve import LLM, SamplingParams, kernels
from iterserve.attention import select_backend
from iterserve.config import ModelConfig
from iterserve.models.checkpoint import empty_model, load_hf_state_dict
from iterserve.models.cpu_linear import PackedLinear
from iterserve.models.linear import process_weights
from iterserve.models.loader import load_model
from iterserve.models.moe import SparseMoeBlock, mix_experts, route
from iterserve.platforms import ops as platform_ops
from tests.models.test_llama import run_ours

CPU = select_backend("cpu")
VOCAB = 300
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=256, bos_token_id=None,
              eos_token_id=None, pad_token_id=None)


def hf_config(kind: str) -> transformers.PretrainedConfig:
    """Tiny configs: Mixtral (8 experts), Qwen3-MoE with a dense first layer, renormalised or not."""
    if kind == "mixtral":
        return transformers.MixtralConfig(num_local_experts=8, **COMMON)
    if kind == "qwen3moe-3-layers":
        return transformers.Qwen3MoeConfig(num_experts=6, moe_intermediate_size=32, norm_topk_prob=True,
                                           decoder_sparse_step=2, **{**COMMON, "num_hidden_layers": 3})
    dense = [] if kind == "qwen3moe-all-sparse" else [0]  # llama.cpp's qwen3moe has no dense layers
    return transformers.Qwen3MoeConfig(num_experts=4, moe_intermediate_size=32, mlp_only_layers=dense, head_dim=32,
                                       norm_topk_prob=kind == "qwen3moe-norm", **COMMON)


def ours_config(cfg: transformers.PretrainedConfig) -> ModelConfig:
    arch = "MixtralForCausalLM" if cfg.model_type == "mixtral" else "Qwen3MoeForCausalLM"
    return ModelConfig.from_hf_config(cfg.to_dict() | {"architectures": [arch]})


KINDS = ["mixtral", "qwen3moe-norm", "qwen3moe-raw", "qwen3moe-3-layers"]


def hf_model(kind: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    cfg = hf_config(kind)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # routers start at zero in transformers: random ones spread the tokens over experts
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module", params=KINDS)
def saved(request, tmp_path_factory):
    """A tiny MoE model and the folder ``save_pretrained`` wrote it to (per-expert tensor names)."""
    hf = hf_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return request.param, hf, folder


def test_config_from_the_saved_folder(saved):
    kind, hf, folder = saved
    cfg = ModelConfig.from_hf_config(json.loads((folder / "config.json").read_text()))
    assert cfg.architecture == ("mixtral" if kind == "mixtral" else "qwen3_moe")
    assert cfg.num_experts == hf.config.num_local_experts if kind == "mixtral" else hf.config.num_experts
    assert cfg.num_parameters() == sum(p.numel() for p in hf.parameters())
    moe = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    assert moe == {"mixtral": [0, 1], "qwen3moe-3-layers": [1]}.get(kind, [1])
    assert cfg.norm_topk_prob == (kind != "qwen3moe-raw")
    # a token runs 2 experts: the inactive ones' weights drop out of the active count
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    assert cfg.num_parameters() - cfg.active_parameters() == len(moe) * (e - k) * 3 * 64 * cfg.expert_intermediate_size


def test_logits_match_transformers_from_the_in_memory_state_dict(saved):
    """transformers 5's fused 3-D expert tensors, prompt whole and in chunks."""
    kind, hf, _ = saved
    cfg = ours_config(hf.config)
    ours = empty_model(cfg, torch.float32, torch.device("cpu"))
    load_hf_state_dict(ours, hf.state_dict().items())
    ids = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    for steps in ([20], [7, 5, 3, 1, 1, 1, 1, 1]):
        got = run_ours(ours, ids, steps)
        assert (got - ref).abs().max().item() < 1e-4, f"{kind} {steps}"
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


PROMPTS = [[5, 17, 3, 199, 42, 8, 120], [64, 1, 33], [250, 12, 9, 77, 18, 3, 140, 41, 2, 96, 7, 11, 200], [31]]


def test_greedy_tokens_equal_transformers_generate_alone_and_batched(saved):
    kind, hf, folder = saved
    expected = []
    for p in PROMPTS:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    llm = LLM(model=str(folder), dtype="float32", device="cpu", num_kv_blocks=32, block_size=4)
    assert llm.llm_engine is not None
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)
    alone = [llm.generate({"prompt_token_ids": p}, greedy, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    together = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
    assert [list(t) for t in alone] == expected, kind
    assert [list(o.outputs[0].token_ids) for o in together] == expected, kind


def random_block(seed: int) -> tuple[SparseMoeBlock, torch.Tensor]:
    """A Mixtral-shaped MoE layer of seeded-random weights and 9 rows of input for it."""
    block = SparseMoeBlock(ours_config(hf_config("mixtral")))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return block, torch.randn(9, 64, generator=g)


def batches_holding(x: torch.Tensor, i: int) -> list[tuple[torch.Tensor, int]]:
    """Row i alone, first of a batch, and last of one: each batch with the row's index in it."""
    return [(x[i:i + 1], 0), (torch.cat([x[i:i + 1], x[:i]]), 0), (torch.cat([x[:i], x[i:i + 1]]), i)]


def test_a_rows_result_does_not_depend_on_its_batch():
    block, x = random_block(3)
    together = block(x, CPU)
    _, experts = route(block.gate.logits(x), 2, True)
    for i in range(9):
        for batch, row in batches_holding(x, i):
            assert torch.equal(route(block.gate.logits(batch), 2, True)[1][row], experts[i])
            # the same experts added in the same order: only the matmuls' blocking (by row count) may round apart
            torch.testing.assert_close(block(batch, CPU)[row], together[i], atol=1e-5, rtol=1e-5)


def packed_for_the_cpu(block: SparseMoeBlock) -> SparseMoeBlock:
    """``block`` as the engine prepares it on a CPU with the kernels: router and experts packed for them."""
    ops = platform_ops.cpu_kernels()
    assert ops is not None
    process_weights(block, lambda layer: PackedLinear(ops))
    block.experts.pack(ops)
    return block


@pytest.mark.skipif(kernels.ops is None, reason="the C++ CPU kernels are not built")
def test_packed_experts_match_f_linear_and_give_a_bf16_row_the_same_bits_in_any_batch():
    """On a CPU the router and the float experts run the packed kernel (one order over k per row, whatever the
    row count): float32 as ``F.linear`` gives, and a bf16 row's output the same bits whatever else is batched."""
    block, x = random_block(4)
    plain, half = block(x, CPU), copy.deepcopy(block).to(torch.bfloat16)
    packed_for_the_cpu(block)
    assert block.experts.gate_up_proj.is_meta and len(block.experts.down_packed) == block.num_experts
    torch.testing.assert_close(block(x, CPU), plain, atol=1e-5, rtol=1e-5)
    block, xb = packed_for_the_cpu(half), x.to(torch.bfloat16)
    together = block(xb, CPU)
    for i in range(9):
        for batch, row in batches_holding(xb, i):
            assert torch.equal(block(batch, CPU)[row], together[i])


def test_routing_renormalises_only_where_asked():
    x, router = torch.randn(5, 8), torch.randn(4, 8)
    raw, idx = route(x @ router.T, 2, renormalise=False)
    norm, idx2 = route(x @ router.T, 2, renormalise=True)
    assert torch.equal(idx, idx2) and raw.dtype == torch.float32
    assert (raw.sum(-1) < 1).all() and torch.allclose(norm.sum(-1), torch.ones(5))
    probs = torch.softmax(x @ router.T, -1)
    assert torch.allclose(raw, probs.gather(1, idx))
    # experts mixed by hand: each row's experts in turn
    gate_up, down = torch.randn(4, 6, 8), torch.randn(4, 8, 3)
    ref = torch.zeros(5, 8)
    for r in range(5):
        for k in range(2):
            g, u = (x[r] @ gate_up[idx[r, k]].T).split(3)
            ref[r] += norm[r, k] * (down[idx[r, k]] @ (torch.nn.functional.silu(g) * u))
    mixed = mix_experts(x, norm, idx, 4, lambda e, h: h @ gate_up[e].T, lambda e, h: h @ down[e].T, CPU)
    torch.testing.assert_close(mixed, ref, atol=1e-5, rtol=1e-5)


def test_random_weights_and_the_python_decode_path():
    """random:<preset> fills the 3-D experts too; the C++ whole-stack decoder declines a MoE model."""
    loaded = load_model("random:qwen3-30b-a3b?num_layers=2&vocab_size=256&hidden_size=64&num_heads=4&num_kv_heads=2"
                        "&head_dim=16&moe_intermediate_size=32&num_experts=8", dtype="float32", device="cpu")
    experts = loaded.model.layers[1].mlp.experts
    assert experts.gate_up_proj.shape == (8, 64, 64)
    filled = experts.gate_up_packed[0] if experts.gate_up_packed else experts.gate_up_proj  # packed on a CPU
    assert filled.std() > 0.01
    assert loaded.model.native_stack() is None
    assert loaded.config.num_parameters() == sum(p.numel() for p in loaded.model.parameters())


def test_tensor_parallel_is_refused_clearly():
    cfg = ours_config(hf_config("mixtral"))
    with pytest.raises(ValueError, match="mixture-of-experts model.*one device"):
        cfg.tensor_parallel_shard(2)


def test_a_missing_expert_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    hf = hf_model("qwen3moe-norm")
    hf.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.experts.3.down_proj.weight"], weights["model.layers.1.mlp.experts.0.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing expert weights: layers\.1\.mlp\.experts\.0\.up_proj, "
                                         r"layers\.1\.mlp\.experts\.3\.down_proj"):
        load_model(str(tmp_path), dtype="float32", device="cpu")


def test_to_hf_config_builds_the_same_model_in_transformers():
    """ModelConfig -> transformers config -> model: the shapes the planner and random presets use are real ones."""
    for kind in ("mixtral", "qwen3moe-3-layers"):
        ours_cfg = ours_config(hf_config(kind))
        hf_cfg = {k: v for k, v in ours_cfg.to_hf_config().items() if k not in ("architectures", "model_type")}
        rebuilt = transformers.AutoConfig.for_model(ours_cfg.architecture, **hf_cfg)
        again = ours_config(rebuilt)
        assert again.replace(name="") == ours_cfg.replace(name=""), kind
        model = transformers.AutoModelForCausalLM.from_config(rebuilt)
        assert sum(p.numel() for p in model.parameters()) == ours_cfg.num_parameters()


def test_bfloat16_and_int8_keep_the_experts_and_stay_close(saved):
    kind, _, folder = saved
    f32 = load_model(str(folder), dtype="float32", device="cpu").model
    bf16 = load_model(str(folder), dtype="bfloat16", device="cpu").model
    int8 = load_model(str(folder), dtype="float32", device="cpu", quantization="int8").model
    moe = next(layer.mlp for layer in int8.layers if isinstance(layer.mlp, SparseMoeBlock))
    assert moe.experts.gate_up_proj.dtype == torch.float32  # experts and router stay float under int8
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(6))
    ref = run_ours(f32, ids, [12])
    assert (run_ours(bf16, ids, [12]) - ref).abs().max().item() < 0.1
    assert (run_ours(int8, ids, [12]) - ref).abs().max().item() < 0.1

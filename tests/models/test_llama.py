"""Our decoder against transformers' implementation on the same random weights, per family."""

from __future__ import annotations

import pytest
import torch
import transformers

from iterserve.attention import AttentionMetadata, select_backend
from iterserve.config import ModelConfig
from iterserve.models.checkpoint import empty_model, load_hf_state_dict
from iterserve.models.native_decoder import NativeDecoder

CPU = select_backend("cpu")  # what the engine runs on the CPU: the C++ kernels when built
DECODER = NativeDecoder.for_device("cpu")  # and its decode steps in one C++ call (None without the kernels)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}


def tiny(arch: str, **kw) -> ModelConfig:
    base = dict(architecture=arch, vocab_size=320, hidden_size=64, intermediate_size=96, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256, rope_theta=10000.0)
    base.update(kw)
    return ModelConfig(**base)


FAMILIES = {
    "llama2-mha-untied": tiny("llama", num_kv_heads=4),
    "llama3-gqa-rope-scaling": tiny("llama", rope_theta=500000.0, rope_scaling=LLAMA3_SCALING),
    "smollm2-tied": tiny("llama", tie_word_embeddings=True, rope_theta=100000.0),
    "llama-linear-rope": tiny("llama", rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "mistral-sliding-window": tiny("mistral", sliding_window=6),
    "qwen2-qkv-bias": tiny("qwen2", attention_bias=True, tie_word_embeddings=True, rms_norm_eps=1e-6),
    "qwen3-qk-norm": tiny("qwen3", qk_norm=True, head_dim=32, rms_norm_eps=1e-6),
}


def hf_pair(cfg: ModelConfig):
    """A transformers model with random weights and ours holding the very same weights."""
    torch.manual_seed(0)
    hf_cfg = {k: v for k, v in cfg.to_hf_config().items() if k not in ("architectures", "model_type")}
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(cfg.architecture, **hf_cfg), dtype=torch.float32
    ).eval()
    ours = empty_model(cfg, torch.float32, torch.device("cpu"))
    load_hf_state_dict(ours, hf.state_dict().items())
    return hf, ours


def run_ours(model, ids: torch.Tensor, steps: list[int], block_size: int = 4) -> torch.Tensor:
    """Feed one sequence in chunks (e.g. [7, 5, 1, 1]); return logits of every position."""
    caches = model.allocate_kv_cache(32, block_size)
    table = list(range(31, -1, -1))  # deliberately reversed block order
    outs, done = [], 0
    for n in steps:
        meta = AttentionMetadata.build(block_size=block_size, block_tables=[table], num_cached=[done], query_lens=[n],
                                       sliding_window=model.config.sliding_window)
        outs.append(model(ids[done:done + n], torch.arange(done, done + n), caches, meta, CPU, decoder=DECODER))
        done += n
    return torch.cat(outs)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family):
    hf, ours = hf_pair(FAMILIES[family])
    ids = torch.randint(0, 320, (20,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    for steps in ([20], [7, 5, 3, 1, 1, 1, 1, 1]):
        got = run_ours(ours, ids, steps)
        assert (got - ref).abs().max().item() < 1e-4, f"{family} {steps}"
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_sequences_of_different_lengths_in_one_pass_match_separate_runs():
    _, ours = hf_pair(FAMILIES["llama3-gqa-rope-scaling"])
    g = torch.Generator().manual_seed(2)
    a, b, c = (torch.randint(0, 320, (n,), generator=g) for n in (9, 14, 3))
    alone = [run_ours(ours, x, [len(x)])[-1] for x in (a, b, c)]
    caches = ours.allocate_kv_cache(32, 4)
    tables = [[0, 1, 2], [3, 4, 5, 6], [7]]
    meta = AttentionMetadata.build(block_size=4, block_tables=tables, num_cached=[0, 0, 0], query_lens=[9, 14, 3])
    ids = torch.cat([a, b, c])
    pos = torch.cat([torch.arange(9), torch.arange(14), torch.arange(3)])
    together = ours(ids, pos, caches, meta, CPU, torch.tensor([8, 22, 25]))
    torch.testing.assert_close(together, torch.stack(alone), atol=1e-5, rtol=1e-5)


def test_logits_only_for_requested_rows():
    _, ours = hf_pair(FAMILIES["smollm2-tied"])
    caches = ours.allocate_kv_cache(8, 4)
    meta = AttentionMetadata.build(block_size=4, block_tables=[[0, 1]], num_cached=[0], query_lens=[6])
    out = ours(torch.arange(6), torch.arange(6), caches, meta, CPU, torch.tensor([5]))
    assert out.shape == (1, 320) and out.dtype == torch.float32


def test_bfloat16_stays_close_to_float32():
    hf, ours32 = hf_pair(FAMILIES["qwen3-qk-norm"])
    ours16 = empty_model(ours32.config, torch.bfloat16, torch.device("cpu"))
    load_hf_state_dict(ours16, hf.state_dict().items())
    ids = torch.randint(0, 320, (12,), generator=torch.Generator().manual_seed(3))
    a, b = run_ours(ours32, ids, [12]), run_ours(ours16, ids, [12])
    assert (a - b).abs().max().item() < 0.1


def test_unsupported_rope_scaling_is_named():
    with pytest.raises(ValueError, match="rope scaling type 'yarn'"):
        empty_model(tiny("llama", rope_scaling={"rope_type": "yarn", "factor": 4.0}), torch.float32,
                     torch.device("cpu"))

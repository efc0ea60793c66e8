"""Phi-3 and Gemma 3 Hugging Face folders: tiny seeded models saved by transformers, run by the engine, and their
greedy tokens against transformers' ``generate`` (float32, alone, batched and in chunks)."""

from __future__ import annotations

import json
import math

import gguf
import numpy as np
import pytest
import torch
import transformers

from iterserve import LLM, SamplingParams
from iterserve.attention import AttentionMetadata, select_backend
from iterserve.config import ModelConfig
from iterserve.models.gemma3 import Gemma3Model
from iterserve.models.loader import load_model, load_model_config
from iterserve.models.phi3 import Phi3Model, Phi3RotaryEmbedding
from iterserve.quantization.model import weight_formats
from tests.models.gguf_files import finish, write_shape

VOCAB, NEW_TOKENS = 320, 12


def prompts(*lengths: int) -> list[list[int]]:
    return [[5 + (i * 37 + j * 11) % (VOCAB - 10) for j in range(n)] for i, n in enumerate(lengths)]


PROMPTS = prompts(26, 5, 13, 9)  # beyond the 8-token window
# Phi-3's original context is 16 positions: these fit in it to the end (5 and 3 + 12 tokens generated) or are longer
# from the start; transformers recomputes the whole cache when a sequence grows past it, which the engine does not
PHI3_PROMPTS = prompts(26, 5, 19, 3)
SHAPES = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 128, "bos_token_id": 1, "eos_token_id": 2,
          "pad_token_id": 0, "initializer_range": 0.15}  # sharp attention: positions and windows show


def _longrope(dims: int) -> dict:
    return {"rope_type": "longrope", "short_factor": [1.0 + 0.15 * i for i in range(dims // 2)],
            "long_factor": [1.5 + 0.6 * i for i in range(dims // 2)]}


def phi3_config(**changes) -> transformers.Phi3Config:
    return transformers.Phi3Config(**{**SHAPES, "num_hidden_layers": 3, "sliding_window": 8,
                                      "original_max_position_embeddings": 16, "rope_scaling": _longrope(16),
                                      **changes})


def gemma3_config(**changes) -> transformers.Gemma3TextConfig:
    return transformers.Gemma3TextConfig(**{
        **SHAPES, "num_hidden_layers": 4, "head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 20,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        "rope_scaling": {"rope_type": "linear", "factor": 4.0}, **changes})


def save(folder, model_class, config) -> transformers.PreTrainedModel:
    """A seeded random model whose norms are not all zeros or ones (so a wrong norm formula shows)."""
    torch.manual_seed(0)
    hf = model_class(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    hf.save_pretrained(folder)
    return hf


def hf_greedy(hf, prompts: list[list[int]], n: int = NEW_TOKENS) -> list[list[int]]:
    out = []
    for p in prompts:
        with torch.no_grad():
            ids = hf.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        out.append(ids[0, len(p):].tolist())
    return out


def engine_greedy(folder, prompts: list[list[int]], **kwargs) -> list[list[int]]:
    llm = LLM(model=str(folder), dtype="float32", device="cpu", **{"num_kv_blocks": 64, "block_size": 4, **kwargs})
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def phi3_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("phi3")
    return folder, save(folder, transformers.Phi3ForCausalLM, phi3_config())


@pytest.fixture(scope="module")
def gemma3_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3")
    return folder, save(folder, transformers.Gemma3ForCausalLM, gemma3_config())


# -- Phi-3 --------------------------------------------------------------------------------------------


def test_phi3_longrope_greedy_alone_and_batched(phi3_folder):
    folder, hf = phi3_folder
    want = hf_greedy(hf, PHI3_PROMPTS)
    assert [engine_greedy(folder, [p])[0] for p in PHI3_PROMPTS[:2]] == want[:2]
    assert engine_greedy(folder, PHI3_PROMPTS) == want
    assert engine_greedy(folder, PHI3_PROMPTS[1::2], max_num_batched_tokens=3) == want[1::2]  # chunks of short ones
    # long prompts in chunks: a chunk within the original context is rotated by the whole prompt's length too
    assert engine_greedy(folder, PHI3_PROMPTS[::2], max_num_batched_tokens=16) == want[::2]


def test_phi3_window_pool_holds_a_window_of_each_sequence(phi3_folder):
    """Every layer in one 8-token window: 8 blocks of 4 tokens serve sequences of up to 15 blocks, in chunks, under
    preemption, from the prefix cache and with n-gram drafts, giving transformers' tokens."""
    folder, hf = phi3_folder
    long_prompts = prompts(40, 33, 47, 26)  # longer than the original context from the start, as PHI3_PROMPTS says
    want = hf_greedy(hf, long_prompts)
    llm = LLM(model=str(folder), dtype="float32", device="cpu", block_size=4, num_kv_blocks=8,
              max_num_batched_tokens=16, max_num_seqs=4)
    core = llm.engine
    window = core.block_manager.window
    assert window is not None and window.num_blocks - 1 == 8 and core.capacity.window_blocks == 9
    assert core.capacity.kv_bytes_per_token == 0 and core.block_manager.num_blocks > 8  # blocks only numbered
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in long_prompts], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert core.num_preemptions > 0 and core.prefix_hit_tokens > 0
    core.block_manager.check_no_leaks()
    for i, p in enumerate(long_prompts):  # aborted mid-prompt and mid-output, the others finish: nothing leaks
        core.add_request(p, params, request_id=str(i))
    for _ in range(3):
        core.step()
    assert core.abort_request("0") and core.abort_request("3")
    while core.has_unfinished_requests():
        core.step()
    core.block_manager.check_no_leaks()
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    assert engine_greedy(folder, long_prompts, speculative_config=spec, num_kv_blocks=8,
                         max_num_batched_tokens=16) == want
    with pytest.raises(ValueError, match="max_model_len"):  # one pool of 8 blocks holds no such sequence
        LLM(model=str(folder), dtype="float32", device="cpu", block_size=4, num_kv_blocks=8, max_model_len=64,
            hybrid_swa_memory=False)


def test_phi3_gguf_as_llama_cpp_writes_it(phi3_folder, tmp_path):
    """A Phi-3 GGUF (fused q/k/v and gate/up, longrope's factors as tensors) gives transformers' greedy tokens in
    float32, and in Q8_0 blocks kept as stored those of its values in float32."""
    _, hf = phi3_folder
    for matrices in ("F32", "Q8_0", "Q8_0-as-F32"):
        write_gguf(tmp_path / f"{matrices}.gguf", hf, "phi3", phi3_metadata(hf), matrices)
    config = load_model_config(str(tmp_path / "F32.gguf"))
    assert config.architecture == "phi3" and config.sliding_window == 8 and config.rope_scaling is not None
    assert engine_greedy(tmp_path / "F32.gguf", PHI3_PROMPTS) == hf_greedy(hf, PHI3_PROMPTS)
    assert engine_greedy(tmp_path / "Q8_0.gguf", PHI3_PROMPTS, quantization="gguf") == \
        engine_greedy(tmp_path / "Q8_0-as-F32.gguf", PHI3_PROMPTS)


def test_phi3_longrope_set_follows_the_sequence_length():
    """The short factors while a sequence fits in the original context, the long ones for all of its tokens once
    it is longer; both scaled by sqrt(1 + ln(128 / 16) / ln(16))."""
    config = ModelConfig.from_hf_config({**phi3_config().to_dict(), "architectures": ["Phi3ForCausalLM"]})
    rotary = Phi3RotaryEmbedding(config)
    positions = torch.tensor([3, 15, 3, 15, 16])
    cos, _ = rotary(positions, torch.float32, torch.tensor([16, 16, 17, 17, 17]))
    scale = (1 + math.log(8) / math.log(16)) ** 0.5
    short = 1 / (torch.tensor(config.rope_scaling["short_factor"]) * 10000.0 ** (torch.arange(0, 16, 2) / 16))
    long = 1 / (torch.tensor(config.rope_scaling["long_factor"]) * 10000.0 ** (torch.arange(0, 16, 2) / 16))
    for row, (pos, inv) in enumerate([(3, short), (15, short), (3, long), (15, long), (16, long)]):
        torch.testing.assert_close(cos[row, 0, :8], (pos * inv).cos() * scale)


def test_phi3_config_and_weights(phi3_folder):
    folder, _ = phi3_folder
    loaded = load_model(str(folder), dtype="float32", device="cpu")
    c = loaded.config
    assert isinstance(loaded.model, Phi3Model) and c.architecture == "phi3" and c.sliding_window == 8
    assert c.rope_scaling is not None and c.rope_scaling["original_max_position_embeddings"] == 16
    assert c.num_parameters() == sum(p.numel() for p in loaded.model.parameters())


def test_phi3_partial_rotary_default_rope(tmp_path):
    hf = save(tmp_path, transformers.Phi3ForCausalLM,
              phi3_config(rope_scaling=None, partial_rotary_factor=0.5, sliding_window=None))
    assert load_model_config(str(tmp_path)).rope_scaling is None
    assert engine_greedy(tmp_path, PROMPTS[:3]) == hf_greedy(hf, PROMPTS[:3])


def test_phi3_fused_checkpoint_tensors_split_before_tensor_parallel_shards(phi3_folder):
    """Each rank of two keeps its q, k and v heads (its gate and up rows) of the whole fused tensor."""
    from iterserve.distributed.parallel_state import ParallelState
    from iterserve.models.sources import HFFolder

    folder, hf = phi3_folder
    full = hf.model.layers[0].self_attn.qkv_proj.weight
    q, k, v = full.split([64, 32, 32])
    for rank in (0, 1):
        ps = ParallelState(rank=rank, world_size=2)
        model = HFFolder(str(folder), folder).load(torch.float32, torch.device("cpu"), ps, 0, False, False).model
        got = model.layers[0].self_attn.qkv_proj.weight
        rows = slice(rank * 32, rank * 32 + 32), slice(rank * 16, rank * 16 + 16)
        assert torch.equal(got, torch.cat([q[rows[0]], k[rows[1]], v[rows[1]]]))


# -- Gemma 3 ------------------------------------------------------------------------------------------


def test_gemma3_greedy_alone_batched_and_chunked(gemma3_folder):
    folder, hf = gemma3_folder
    want = hf_greedy(hf, PROMPTS)
    assert [engine_greedy(folder, [p])[0] for p in PROMPTS[:2]] == want[:2]
    assert engine_greedy(folder, PROMPTS) == want
    assert engine_greedy(folder, PROMPTS, max_num_batched_tokens=7, enable_prefix_caching=False) == want


def test_gemma3_window_pool_frees_blocks_and_keeps_the_tokens(gemma3_folder):
    """Hybrid SWA memory: the sliding layers' pool, smaller than one sequence, serves long sequences in chunks,
    under preemption, from the prefix cache, with n-gram drafts and with forks, giving transformers' tokens."""
    folder, hf = gemma3_folder
    long_prompts = prompts(40, 33, 47, 26)
    want = hf_greedy(hf, long_prompts)
    # an 8-token window in 4-token blocks: a step's 16-token chunk and the window before it span 8 blocks
    small = {"num_kv_blocks": 24, "max_num_batched_tokens": 16, "max_num_seqs": 4, "swa_full_tokens_ratio": 0.3}
    llm = LLM(model=str(folder), dtype="float32", device="cpu", block_size=4, **small)
    core = llm.engine
    window = core.block_manager.window
    assert window is not None and core.capacity.window_blocks == window.num_blocks
    assert window.num_blocks - 1 == 8  # where a sequence spans 13 blocks: only freeing lets it finish
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
    for _ in range(2):  # the second time from the prefix cache, as far as the window pool still holds
        outs = llm.generate([{"prompt_token_ids": p} for p in long_prompts], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert core.num_preemptions > 0 and core.prefix_hit_tokens > 0  # 24 full blocks hold two sequences at once
    core.block_manager.check_no_leaks()
    assert engine_greedy(folder, long_prompts, hybrid_swa_memory=False, max_num_batched_tokens=16) == want
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    assert engine_greedy(folder, long_prompts, speculative_config=spec) == want
    forked = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
    got = []
    for kwargs in ({}, {"hybrid_swa_memory": False}):  # forks share window blocks and copy the one they write
        llm = LLM(model=str(folder), dtype="float32", device="cpu", block_size=4, num_kv_blocks=96, **kwargs)
        got.append([[list(c.token_ids) for c in o.outputs]
                    for o in llm.generate([{"prompt_token_ids": p} for p in long_prompts], forked, use_tqdm=False)])
        llm.engine.block_manager.check_no_leaks()
    assert got[0] == got[1]


def assert_logits_match(folder, hf, backend) -> None:
    """A 26-token prompt in one forward pass: every position's logits."""
    model = load_model(str(folder), dtype="float32", device="cpu").model
    ids = torch.tensor(PROMPTS[0])
    meta = AttentionMetadata.build(block_size=4, block_tables=[list(range(7))], num_cached=[0], query_lens=[26],
                                   sliding_window=model.config.sliding_window)
    got = model(ids, torch.arange(26), model.allocate_kv_cache(8, 4), meta, backend)
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_gemma3_logits_on_the_reference_backend(gemma3_folder):
    from iterserve.attention.reference import ReferenceBackend

    assert_logits_match(*gemma3_folder, ReferenceBackend())
    assert_logits_match(*gemma3_folder, select_backend("cpu"))


def write_gguf(path, hf, arch: str, metadata, matrices: str = "F32") -> None:
    """The model as llama.cpp's converter writes it: gguf-py's tensor names, ``metadata(writer)``'s keys, a
    vocabulary, and for Gemma 3 every norm weight stored as ``1 + w``. ``matrices``: F32, Q8_0, or Q8_0's values in
    F32 (``Q8_0-as-F32``: the float reference of the Q8_0 file)."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    write_shape(w, c)
    w.add_sliding_window(c.sliding_window)
    metadata(w)
    w.add_tokenizer_model("llama")
    w.add_token_list(["<pad>", "<eos>", "<bos>", "<unk>"] + [f"t{i}" for i in range(4, VOCAB)])
    w.add_token_scores([0.0] * VOCAB)
    w.add_token_types([3, 3, 3, 2] + [1] * (VOCAB - 4))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        data = (t + 1 if arch == "gemma3" and name.endswith("norm.weight") else t).numpy().astype(np.float32)
        gname = names.get_name(name, try_suffixes=(".weight",))
        if matrices == "F32" or data.ndim != 2 or "embed" in name:
            w.add_tensor(gname, data)
        elif matrices == "Q8_0":
            w.add_tensor(gname, gguf.quants.quantize(data, q8), raw_dtype=q8)
        else:
            w.add_tensor(gname, gguf.quants.dequantize(gguf.quants.quantize(data, q8), q8))
    finish(w)


def phi3_metadata(hf):
    """Phi-3's keys as llama.cpp's converter writes them: longrope's factors as two tensors."""
    scaling, c = hf.config.rope_parameters, hf.config
    original = scaling["original_max_position_embeddings"]

    def add(w: gguf.GGUFWriter) -> None:
        w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
        w.add_rope_freq_base(scaling["rope_theta"])
        w.add_rope_scaling_orig_ctx_len(original)
        scale = c.max_position_embeddings / original
        w.add_rope_scaling_attn_factors((1 + math.log(scale) / math.log(original)) ** 0.5)
        w.add_tensor("rope_factors_long.weight", np.array(scaling["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(scaling["short_factor"], np.float32))
    return add


def gemma3_metadata(hf, pattern: bool = True):
    """Gemma 3's keys as llama.cpp's converter writes them, with one sliding-window flag a layer where ``pattern``
    (without it llama.cpp takes one global layer in six)."""
    c = hf.config

    def add(w: gguf.GGUFWriter) -> None:
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_rope_freq_base(1_000_000.0)
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(4.0)
        if pattern:
            w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
    return add


def test_gemma3_gguf_as_llama_cpp_writes_it(tmp_path):
    """A Gemma 3 GGUF in float32 gives transformers' greedy tokens, in Q8_0 blocks kept as stored those of its
    values in float32; a file without a pattern has one global layer in six. llama.cpp scales attention by the head
    size (the 27B model aside), so the model here has ``query_pre_attn_scalar == head_dim``."""
    hf = save(tmp_path, transformers.Gemma3ForCausalLM, gemma3_config(query_pre_attn_scalar=16))
    for matrices in ("F32", "Q8_0", "Q8_0-as-F32"):
        write_gguf(tmp_path / f"{matrices}.gguf", hf, "gemma3", gemma3_metadata(hf), matrices)
    assert engine_greedy(tmp_path / "F32.gguf", PROMPTS) == hf_greedy(hf, PROMPTS)
    assert engine_greedy(tmp_path / "Q8_0.gguf", PROMPTS, quantization="gguf") == \
        engine_greedy(tmp_path / "Q8_0-as-F32.gguf", PROMPTS)
    stored = load_model(str(tmp_path / "Q8_0.gguf"), dtype="float32", device="cpu", quantization="gguf").model
    assert {f.fmt: f.tensors for f in weight_formats(stored)}["Q8_0"] == 4 * 4  # q/k/v, o, gate/up, down a layer
    write_gguf(tmp_path / "six.gguf", hf, "gemma3", gemma3_metadata(hf, pattern=False))
    config = load_model_config(str(tmp_path / "six.gguf"))
    assert config.architecture == "gemma3" and config.extra["query_pre_attn_scalar"] == 16
    assert config.extra["layer_types"] == ["sliding_attention"] * 4  # layer 5 would be the first global one


def test_gemma3_config_and_weights(gemma3_folder):
    folder, _ = gemma3_folder
    loaded = load_model(str(folder), dtype="float32", device="cpu")
    c = loaded.config
    assert isinstance(loaded.model, Gemma3Model) and c.architecture == "gemma3" and c.tie_word_embeddings
    assert [layer.self_attn.window for layer in loaded.model.layers] == [8, 8, None, 8]
    assert c.rope_scaling == {"rope_type": "linear", "factor": 4.0} and c.extra["rope_local_base_freq"] == 10000.0
    assert c.num_parameters() == sum(p.numel() for p in loaded.model.parameters())


def test_gemma3_softcapped_logits_and_window_pattern(tmp_path):
    """``sliding_window_pattern`` (older configs) places the global layers; final soft-capping bounds the logits."""
    hf = save(tmp_path, transformers.Gemma3ForCausalLM, gemma3_config(final_logit_softcapping=0.5, layer_types=None,
                                                                     sliding_window_pattern=2, rope_scaling=None))
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("layer_types")
    raw["sliding_window_pattern"] = 2
    (tmp_path / "config.json").write_text(json.dumps(raw))
    c = load_model_config(str(tmp_path))
    assert c.extra["layer_types"] == ["sliding_attention", "full_attention"] * 2 and c.rope_scaling is None
    assert engine_greedy(tmp_path, PROMPTS[:2]) == hf_greedy(hf, PROMPTS[:2])
    assert_logits_match(tmp_path, hf, select_backend("cpu"))  # capped at +-0.5: greedy tokens alone cannot tell


def test_gemma3_multimodal_config_reads_the_text_decoder(gemma3_folder, tmp_path):
    """A Gemma3ForConditionalGeneration folder: its text_config, defaults for what it leaves out, and the
    language model's weights under their prefix (the vision tower's are skipped)."""
    from safetensors.torch import load_file, save_file

    folder, hf = gemma3_folder
    text = {k: v for k, v in json.loads((folder / "config.json").read_text()).items() if k != "architectures"}
    outer = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text,
             "vision_config": {"hidden_size": 8}, "eos_token_id": [2, 3]}
    (tmp_path / "config.json").write_text(json.dumps(outer))
    weights = {f"language_model.model.{k.removeprefix('model.')}": t
               for k, t in load_file(folder / "model.safetensors").items()}
    weights["vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(2, 2)
    save_file(weights, tmp_path / "model.safetensors")
    c = load_model_config(str(tmp_path))
    assert c.architecture == "gemma3" and c.eos_token_id == [2, 3] and c.extra["layer_types"][2] == "full_attention"
    assert engine_greedy(tmp_path, PROMPTS[:1]) == hf_greedy(hf, PROMPTS[:1])
    sparse = ModelConfig.from_hf_config({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                                         "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                                                         "num_hidden_layers": 34, "sliding_window": 1024,
                                                         "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}})
    assert (sparse.num_heads, sparse.num_kv_heads, sparse.head_dim, sparse.vocab_size) == (8, 4, 256, 262_208)
    types = sparse.extra["layer_types"]
    assert types[5] == "full_attention" and types.count("full_attention") == 5


def test_gemma3_attention_softcapping_is_refused(tmp_path):
    raw = {**gemma3_config().to_dict(), "architectures": ["Gemma3ForCausalLM"], "attn_logit_softcapping": 50.0}
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        ModelConfig.from_hf_config(raw)


def test_unsupported_architecture_lists_what_is_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"}))
    with pytest.raises(ValueError) as e:
        load_model(str(tmp_path))
    message = str(e.value)
    assert "\n" not in message and "'Gemma2ForCausalLM'" in message
    for arch in ("LlamaForCausalLM", "Phi3ForCausalLM", "Gemma3ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in message


def test_hub_configs_of_gemma3_1b_and_phi3_mini_give_their_parameter_counts():
    gemma = ModelConfig.from_hf_config({
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
        "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 256, "vocab_size": 262144, "sliding_window": 512, "sliding_window_pattern": 6, "rope_scaling": None,
        "rope_local_base_freq": 10000, "rope_theta": 1000000, "max_position_embeddings": 32768,
        "final_logit_softcapping": None, "attn_logit_softcapping": None, "query_pre_attn_scalar": 256})
    assert gemma.num_parameters() == 999_885_952 and gemma.extra["layer_types"].count("full_attention") == 4
    phi = ModelConfig.from_hf_config({
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32064,
        "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "sliding_window": 262144,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48}})
    assert phi.num_parameters() == 3_821_079_552 and phi.rope_scaling["original_max_position_embeddings"] == 4096

"""GGUF mixture-of-experts files (llama.cpp's 3-D ``ffn_*_exps`` experts and ``ffn_gate_inp`` router), written
here from a tiny transformers model and checked against it."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from iterserve.formats.gguf.reader import gguf_config, open_gguf
from iterserve.formats.gguf.tensors import gguf_block_tensors
from iterserve.formats.gguf.tensors import gguf_tensors as read_gguf_tensors
from iterserve.models.checkpoint import empty_model, load_hf_state_dict
from iterserve.models.moe import mix_experts, route
from iterserve.quantization.model import streamed_weight_bytes, weight_formats
from tests.models.gguf_files import finish, write_shape
from tests.models.test_llama import CPU, run_ours
from tests.models.test_moe import VOCAB, hf_model

Q = gguf.GGMLQuantizationType
NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's interleaving of Q/K rows for the llama architecture (what the loader undoes)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(hf, llama: bool) -> dict[str, np.ndarray]:
    """The model's weights under llama.cpp's names: experts as 3-D gate / up / down tensors."""
    cfg = hf.config
    out = {}
    for name, t in hf.state_dict().items():
        w = t.numpy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = w
        elif name == "model.norm.weight":
            out["output_norm.weight"] = w
        elif name == "lm_head.weight":
            out["output.weight"] = w
        else:
            _, _, layer, rest = name.split(".", 3)
            blk = f"blk.{layer}"
            if rest == "mlp.experts.gate_up_proj":
                gate, up = np.split(w, 2, axis=1)
                out[f"{blk}.ffn_gate_exps.weight"], out[f"{blk}.ffn_up_exps.weight"] = gate, up
            elif rest == "mlp.experts.down_proj":
                out[f"{blk}.ffn_down_exps.weight"] = w
            else:
                module = rest.removesuffix(".weight")
                if llama and module in ("self_attn.q_proj", "self_attn.k_proj"):
                    w = _permute(w, cfg.num_attention_heads if "q_proj" in module else cfg.num_key_value_heads)
                out[f"{blk}.{NAMES[module]}.weight"] = w
    return out


def write_gguf(path: Path, hf, experts_type=Q.F32) -> Path:
    cfg = hf.config
    llama = cfg.model_type == "mixtral"
    arch = "llama" if llama else "qwen3moe"
    w = gguf.GGUFWriter(str(path), arch)
    write_shape(w, cfg)
    w.add_key_length(cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(VOCAB)
    w.add_expert_count(cfg.num_local_experts if llama else cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if not llama:
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_weights_norm(cfg.norm_topk_prob)
    for name, x in gguf_tensors(hf, llama).items():
        if "_exps" in name and experts_type != Q.F32:
            w.add_tensor(name, gguf.quants.quantize(x, experts_type), raw_dtype=experts_type)
        else:
            w.add_tensor(name, np.ascontiguousarray(x, dtype=np.float32))
    finish(w)
    return path


def load(path: Path):
    """What load_model does with a GGUF file, without the tokenizer these files lack."""
    reader = open_gguf(path)
    config = gguf_config(reader, "tiny")
    model = empty_model(config, torch.float32, torch.device("cpu"))
    load_hf_state_dict(model, read_gguf_tensors(reader, config))
    return model


@pytest.mark.parametrize("kind", ["mixtral", "qwen3moe-all-sparse"])
def test_gguf_moe_matches_transformers(tmp_path, kind):
    hf = hf_model(kind)
    model = load(write_gguf(tmp_path / f"{kind}.gguf", hf))
    c = model.config
    assert c.architecture == ("mixtral" if kind == "mixtral" else "qwen3_moe")
    assert (c.num_experts, c.num_experts_per_tok) == ((8, 2) if kind == "mixtral" else (4, 2))
    assert c.norm_topk_prob == (kind == "mixtral") and c.num_parameters() == sum(p.numel() for p in hf.parameters())
    ids = torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    got = run_ours(model, ids, [9, 4, 1, 1, 1])
    assert (got - ref).abs().max().item() < 1e-4
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("experts_type", [Q.F16, Q.BF16, Q.Q8_0])
def test_gguf_experts_in_other_types_load_dequantized(tmp_path, experts_type):
    hf = hf_model("qwen3moe-all-sparse")
    exact = load(write_gguf(tmp_path / "f32.gguf", hf))
    model = load(write_gguf(tmp_path / "other.gguf", hf, experts_type))
    experts = model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.float32 and experts.gate_up_proj.shape == (4, 64, 64)
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(5))
    a, b = run_ours(exact, ids, [12]), run_ours(model, ids, [12])
    assert (a - b).abs().max().item() < 0.05


def load_in_blocks(path: Path):
    """The model as ``quantization="gguf"`` loads it: quantized experts kept in their blocks."""
    reader = open_gguf(path)
    config = gguf_config(reader, "tiny")
    model = empty_model(config, torch.float32, torch.device("cpu"))
    load_hf_state_dict(model, read_gguf_tensors(reader, config, keep_blocks=True))
    return model


@pytest.mark.parametrize("kind,experts_type", [("qwen3moe-all-sparse", Q.Q8_0), ("mixtral", Q.Q5_0),
                                               ("mixtral", Q.Q4_0)])
def test_gguf_experts_stay_in_their_blocks(tmp_path, kind, experts_type):
    path = write_gguf(tmp_path / "experts.gguf", hf_model(kind), experts_type)
    dense, kept = load(path), load_in_blocks(path)
    c = kept.config
    moe_layers = [layer.mlp for layer in kept.layers if hasattr(layer.mlp, "experts")]
    for mlp in moe_layers:
        assert mlp.experts.gate_up_proj.numel() == 0 and mlp.experts.down_proj.numel() == 0
        assert len(mlp.experts.gate_up_blocks) == len(mlp.experts.down_blocks) == c.num_experts
    # the engine counts every expert's blocks in their type: the file's bytes, blocks laid out for the kernel
    # padded to whole dwords (all but Q4_0)
    fmt = {f.fmt: f for f in weight_formats(kept)}[experts_type.name]
    params = len(moe_layers) * c.num_experts * 3 * c.expert_intermediate_size * c.hidden_size
    block, nbytes = gguf.GGML_QUANT_SIZES[experts_type]
    nbytes = nbytes if experts_type == Q.Q4_0 else -(-nbytes // 4) * 4
    assert (fmt.tensors, fmt.parameters, fmt.bytes) == (len(moe_layers) * c.num_experts * 2, params,
                                                       params // block * nbytes)
    # a decode step's memory floor counts the share of the experts its tokens run
    held = sum(w.nbytes for mlp in moe_layers for w in mlp.experts.qweights)
    assert held == fmt.bytes
    assert streamed_weight_bytes(kept, 1) - streamed_weight_bytes(kept, 0) == pytest.approx(
        held * c.num_experts_per_tok / c.num_experts, abs=1)
    assert streamed_weight_bytes(kept, 10_000) - streamed_weight_bytes(kept, 0) == pytest.approx(held, abs=1)
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(6))
    a, b = run_ours(dense, ids, [12]), run_ours(kept, ids, [12])
    assert (a - b).abs().max().item() < 0.05  # the kernel multiplies activations rounded to int8 per 32
    # a row's experts give it the same values whichever rows share them
    x = torch.randn(9, c.hidden_size, generator=torch.Generator().manual_seed(7))
    weights, chosen = route(moe_layers[0].gate.logits(x), c.num_experts_per_tok, True)
    e = moe_layers[0].experts

    def mix(rows: slice) -> torch.Tensor:
        return mix_experts(x[rows], weights[rows], chosen[rows], c.num_experts, e.gate_up, e.down, CPU)
    assert torch.equal(mix(slice(0, 9)), torch.cat([mix(slice(i, i + 1)) for i in range(9)]))


def test_gguf_gate_and_up_experts_stay_in_blocks_together(tmp_path):
    """A layer whose up experts are float keeps its gate experts float too (they fuse into one matmul)."""
    hf = hf_model("qwen3moe-all-sparse")
    tensors = gguf_tensors(hf, llama=False)
    kept = gguf_block_tensors((name, "F16" if "ffn_up_exps" in name else "Q8_0" if "_exps" in name else "F32",
                               x.ndim) for name, x in tensors.items())
    assert not any("gate_exps" in name for name in kept)
    assert all(as_stored for name, as_stored in kept.items()) and any("down_exps" in name for name in kept)

"""Models served from quantized blocks: a GGUF's Q4_0/Q4_1/Q8_0 tensors loaded into fused, sharded layers
and multiplied as stored, other types falling back to float, int8 quantized at load."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from iterserve import kernels
from iterserve.distributed.parallel_state import ParallelState
from iterserve.formats.gguf.reader import gguf_config, open_gguf
from iterserve.formats.gguf.tensors import gguf_tensors
from iterserve.models.checkpoint import empty_model, load_hf_state_dict
from iterserve.models.llama import LlamaModel
from iterserve.models.loader import load_model
from iterserve.quantization import packed as P
from iterserve.quantization.model import (
    check_quantization,
    describe,
    quantize_model,
    streamed_weight_bytes,
    weight_formats,
)
from tests.models.test_llama import run_ours
from tests.op_sets import use_kernels

HIDDEN, FFN, VOCAB, LAYERS, HEADS, KV_HEADS = 64, 128, 200, 2, 4, 2
Q = gguf.GGMLQuantizationType
# per tensor kind: its GGUF type (the fused q/k/v mix Q4_0 and Q4_1; ffn_down has no blocks to keep)
TYPES = {"token_embd": Q.Q8_0, "output": Q.Q4_0, "attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q4_1,
         "attn_output": Q.Q8_0, "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_1, "ffn_down": Q.F16}


def write_gguf(path: Path, types: dict[str, gguf.GGMLQuantizationType], tied: bool = False) -> Path:
    """A tiny llama GGUF with random weights in the given types (no tokenizer: loaded below without one)."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_block_count(LAYERS)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_context_length(64)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)

    def add(name: str, kind: str, shape: tuple[int, ...]) -> None:
        x = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        qtype = types[kind]
        if qtype == Q.F16:
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)

    kv = HIDDEN // HEADS * KV_HEADS
    add("token_embd.weight", "token_embd", (VOCAB, HIDDEN))
    if not tied:
        add("output.weight", "output", (VOCAB, HIDDEN))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    for i in range(LAYERS):
        for kind, shape in [("attn_q", (HIDDEN, HIDDEN)), ("attn_k", (kv, HIDDEN)), ("attn_v", (kv, HIDDEN)),
                            ("attn_output", (HIDDEN, HIDDEN)), ("ffn_gate", (FFN, HIDDEN)), ("ffn_up", (FFN, HIDDEN)),
                            ("ffn_down", (HIDDEN, FFN))]:
            add(f"blk.{i}.{kind}.weight", kind, shape)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def load(path: Path, quantization: str | None, ps: ParallelState | None = None) -> LlamaModel:
    """What load_model does with a GGUF file, without the tokenizer these files lack."""
    reader = open_gguf(path)
    config = gguf_config(reader, "tiny")
    model = empty_model(config, torch.float32, torch.device("cpu"), ps)
    load_hf_state_dict(model, gguf_tensors(reader, config, keep_blocks=quantization == "gguf"))
    quantize_model(model, quantization)
    return model


def dense(layer: torch.nn.Module) -> torch.Tensor:
    """A float layer's weight, whichever linear method holds it."""
    return layer.method.dense_weight(layer)


def logits(model: LlamaModel) -> torch.Tensor:
    ids = torch.tensor([5, 17, 3, 199, 42, 8, 120, 64, 1, 33])
    return run_ours(model, ids, [6, 3, 1])


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", TYPES)


def test_gguf_blocks_stay_in_blocks_and_other_types_load_float(tiny_gguf, caplog):
    with caplog.at_level(logging.WARNING, logger="iterserve.quantization.model"):
        model = load(tiny_gguf, "gguf")
    assert "2 matrices load as float (F16 x2)" in caplog.text
    formats = {f.fmt: f for f in weight_formats(model)}
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert attn.qkv_proj.qweight.fmt == "Q4_0+Q4_1" and attn.qkv_proj.qweight.bits == 4
    assert attn.o_proj.qweight.fmt == "Q8_0" and mlp.gate_up_proj.qweight.fmt == "Q4_1"
    assert mlp.down_proj.qweight is None and mlp.down_proj.weight.shape == (HIDDEN, FFN)
    assert model.embed_tokens.qweight.fmt == "Q8_0" and model.lm_head.qweight.fmt == "Q4_0"
    assert model.embed_tokens.weight.numel() == 0  # the float copy is gone
    assert formats["float32"].tensors == 2 * LAYERS + 1 + LAYERS  # norms, and the F16 ffn_down as float32
    assert formats["Q8_0"].tensors == 1 + LAYERS
    lines = describe(weight_formats(model))
    assert len(lines) == len(formats) and lines[0].startswith(f"weights in {weight_formats(model)[0].fmt}: ")


def test_gguf_model_computes_what_the_dequantized_model_does(tiny_gguf, monkeypatch):
    """Without the kernel (dequantize then matmul) the blocks give the float model's logits; with it, the
    int8 activations keep them within 2%."""
    float_logits = logits(load(tiny_gguf, None))
    quantized = load(tiny_gguf, "gguf")
    if kernels.ops is not None:
        fast = logits(quantized)
        assert ((fast - float_logits).norm() / float_logits.norm()).item() < 2e-2
    use_kernels(monkeypatch, None)  # a model loaded from now on multiplies by dequantizing
    torch.testing.assert_close(logits(load(tiny_gguf, "gguf")), float_logits, rtol=1e-4, atol=1e-4)


def test_tied_embedding_and_lm_head_share_one_packed_weight(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "tied.gguf", TYPES, tied=True)
    model = load(path, "gguf")
    assert model.lm_head.qweight is model.embed_tokens.qweight
    assert sum(f.fmt == "Q8_0" for f in weight_formats(model)) == 1
    use_kernels(monkeypatch, None)
    torch.testing.assert_close(logits(model), logits(load(path, None)), rtol=1e-4, atol=1e-4)


def test_each_rank_keeps_its_shard_of_the_blocks(tiny_gguf):
    whole = load(tiny_gguf, None)
    shards = [load(tiny_gguf, "gguf", ParallelState(rank, 2)) for rank in range(2)]
    qkv = [P.dequantize(s.layers[1].self_attn.qkv_proj.qweight) for s in shards]
    q, kv = HIDDEN, HIDDEN // HEADS * KV_HEADS
    w = dense(whole.layers[1].self_attn.qkv_proj)
    torch.testing.assert_close(torch.cat([x[:q // 2] for x in qkv]), w[:q])
    torch.testing.assert_close(torch.cat([x[q // 2:q // 2 + kv // 2] for x in qkv]), w[q:q + kv])
    o = [P.dequantize(s.layers[1].self_attn.o_proj.qweight) for s in shards]
    torch.testing.assert_close(torch.cat(o, dim=1), dense(whole.layers[1].self_attn.o_proj))
    heads = [P.dequantize(s.lm_head.qweight) for s in shards]
    torch.testing.assert_close(torch.cat(heads)[:VOCAB], dense(whole.lm_head))


def test_a_shard_that_splits_a_block_is_refused(tiny_gguf):
    """o's 64 inputs over 4 ranks are shards of 16: half a block each."""
    with pytest.raises(ValueError, match="Q8_0 weights split only at multiples of 32 inputs, not \\[16, 32\\) of 64"):
        load(tiny_gguf, "gguf", ParallelState(1, 4))


SMOL = "random:smollm2-135m?num_layers=2&vocab_size=960"


def test_int8_quantizes_every_linear_layer_of_a_float_checkpoint():
    dense = load_model(SMOL, "float32", "cpu")
    int8 = load_model(SMOL, "float32", "cpu", quantization="int8")
    formats = {f.fmt: f for f in weight_formats(int8.model)}
    assert formats["int8"].tensors == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the tied head
    assert int8.model.embed_tokens.qweight is int8.model.lm_head.qweight
    assert streamed_weight_bytes(int8.model) < 0.3 * streamed_weight_bytes(dense.model)
    ours, ref = logits(int8.model), logits(dense.model)
    assert ((ours - ref).norm() / ref.norm()).item() < 2e-2


def test_quantization_names_are_checked():
    assert check_quantization("GGUF") == "gguf" and check_quantization("none") is None
    with pytest.raises(ValueError, match="unknown quantization 'awq'; choose one of: none, gguf, int8"):
        check_quantization("awq")
    with pytest.raises(ValueError, match="is not a GGUF file; quantize a float checkpoint with quantization 'int8'"):
        load_model(SMOL, "float32", "cpu", quantization="gguf")

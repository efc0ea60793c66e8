"""A tiny llama GGUF in a mix of the types llama.cpp's presets write (K-quants, Q5_0/Q5_1, Q8_0, ...): with
quantization="gguf" every matrix stays quantized, in the file's bytes, and greedy decoding gives the tokens of
the same model loaded in float, alone and batched."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from iterserve import kernels
from iterserve.attention import AttentionMetadata
from iterserve.distributed.parallel_state import ParallelState
from iterserve.formats.gguf.tensors import gguf_block_tensors
from iterserve.models.native_decoder import LinearKind
from iterserve.quantization.gguf_weight import GGUFWeight
from iterserve.quantization.model import weight_formats
from iterserve.quantization.packed import dequantize
from tests.models.test_llama import CPU
from tests.op_sets import use_kernels
from tests.quantization.gguf_fixtures import random_blocks
from tests.quantization.test_model import load

HIDDEN, FFN, VOCAB, HEADS, KV_HEADS = 256, 512, 200, 4, 2
# Per layer, each kind's type: layer 0 as a Q4_K_M file, layer 1 the rarer types (and Q4_1 repacked), layer 2 as an
# IQ4_XS file (IQ4_NL where llama.cpp's IQ4_XS falls back to it).
LAYER_TYPES = [
    {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_0", "ffn_gate": "Q4_K",
     "ffn_up": "Q4_K", "ffn_down": "Q6_K"},
    {"attn_q": "Q2_K", "attn_k": "Q3_K", "attn_v": "Q8_0", "attn_output": "Q5_1", "ffn_gate": "Q5_K",
     "ffn_up": "Q5_0", "ffn_down": "Q4_1"},
    {"attn_q": "IQ4_XS", "attn_k": "IQ4_XS", "attn_v": "IQ4_NL", "attn_output": "IQ4_NL", "ffn_gate": "IQ4_NL",
     "ffn_up": "IQ4_XS", "ffn_down": "IQ4_XS"},
]


def write_mixed_gguf(path: Path, embedding: str = "Q6_K", head: str = "Q4_K") -> Path:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in [(w.add_embedding_length, HIDDEN), (w.add_feed_forward_length, FFN),
                       (w.add_block_count, len(LAYER_TYPES)), (w.add_head_count, HEADS),
                       (w.add_head_count_kv, KV_HEADS), (w.add_context_length, 64), (w.add_vocab_size, VOCAB)]:
        add(value)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    seed = iter(range(1000))

    def add(name: str, type_name: str, n: int, k: int, scale: float = 0.1) -> None:
        qtype = gguf.GGMLQuantizationType[type_name]
        w.add_tensor(name, random_blocks(type_name, n, k, next(seed), scale), raw_dtype=qtype)

    add("token_embd.weight", embedding, VOCAB, HIDDEN, 1.0)
    add("output.weight", head, VOCAB, HIDDEN)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    kv = HIDDEN // HEADS * KV_HEADS
    for i, types in enumerate(LAYER_TYPES):
        for kind, (n, k) in [("attn_q", (HIDDEN, HIDDEN)), ("attn_k", (kv, HIDDEN)), ("attn_v", (kv, HIDDEN)),
                             ("attn_output", (HIDDEN, HIDDEN)), ("ffn_gate", (FFN, HIDDEN)), ("ffn_up", (FFN, HIDDEN)),
                             ("ffn_down", (HIDDEN, FFN))]:
            add(f"blk.{i}.{kind}.weight", types[kind], n, k, 0.05)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory) -> Path:
    return write_mixed_gguf(tmp_path_factory.mktemp("gguf") / "mixed.gguf")


def greedy(model, prompts: list[list[int]], steps: int = 5) -> list[list[int]]:
    """Greedy tokens of every prompt, decoded together (one forward per step over all of them)."""
    caches = model.allocate_kv_cache(8 * len(prompts), 4)
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(prompts))]
    seqs, done = [list(p) for p in prompts], [0] * len(prompts)
    with torch.no_grad():
        for _ in range(steps):
            ids = [t for s, d in zip(seqs, done) for t in s[d:]]
            pos = [p for s, d in zip(seqs, done) for p in range(d, len(s))]
            lens = [len(s) - d for s, d in zip(seqs, done)]
            meta = AttentionMetadata.build(block_size=4, block_tables=tables, num_cached=done, query_lens=lens,
                                           sliding_window=None)
            logits = model(torch.tensor(ids), torch.tensor(pos), caches, meta, CPU)
            last = torch.tensor(lens).cumsum(0) - 1
            done = [len(s) for s in seqs]
            for s, t in zip(seqs, logits[last].argmax(-1).tolist()):
                s.append(t)
    return [s[len(p):] for s, p in zip(seqs, prompts)]


PROMPTS = [[5, 17, 3, 199, 42], [8, 120], [64, 1, 33, 7, 7, 150, 2]]


def test_every_matrix_stays_in_its_file_bytes(mixed_gguf):
    model = load(mixed_gguf, "gguf")
    formats = {f.fmt: f for f in weight_formats(model)}
    assert set(formats) == {"Q4_K", "Q6_K", "Q5_0", "Q2_K", "Q3_K", "Q8_0", "Q5_1", "Q5_K", "Q4_1", "IQ4_NL", "IQ4_XS",
                            "float32"}
    reader = gguf.GGUFReader(str(mixed_gguf))
    for fmt, f in formats.items():  # the file's bytes; tiles pad Q6_K blocks to 212 bytes, Q5_0 to 24, IQ4_NL to 20
        if fmt != "float32":
            on_file = sum(int(t.n_bytes) for t in reader.tensors if t.tensor_type.name == fmt)
            assert on_file <= f.bytes <= 1.12 * on_file, fmt
    quantized = sum(f.bytes for f in formats.values() if f.fmt != "float32")
    assert quantized >= 0.9 * sum(f.bytes for f in formats.values())
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert isinstance(attn.qkv_proj.qweight, GGUFWeight) and attn.qkv_proj.qweight.fmt == "Q4_K+Q6_K"
    assert [p.type_name for p in attn.qkv_proj.qweight.parts] == ["Q4_K", "Q6_K"]
    assert [p.tiled_rows for p in attn.qkv_proj.qweight.parts] == [HIDDEN + HIDDEN // 2, HIDDEN // 2]
    assert model.embed_tokens.qweight.parts[0].tiled_rows is None  # untied: looked up by rows
    assert mlp.gate_up_proj.qweight.fmt == "Q4_K" and len(mlp.gate_up_proj.qweight.parts) == 1
    assert model.layers[1].self_attn.qkv_proj.qweight.fmt == "Q2_K+Q3_K+Q8_0"
    assert [p.type_name for p in model.layers[2].mlp.gate_up_proj.qweight.parts] == ["IQ4_NL", "IQ4_XS"]
    assert model.embed_tokens.qweight.fmt == "Q6_K" and model.embed_tokens.weight.numel() == 0
    assert model.lm_head.qweight.fmt == "Q4_K"
    if kernels.ops is not None:  # the decode loop runs these too
        native = attn.qkv_proj.method.native(attn.qkv_proj)
        assert native is not None and native.kind is LinearKind.GGUF
        assert native.out_features == 2 * HIDDEN and len(native.weights) == 2
        assert native.type_ids == attn.qkv_proj.qweight.type_ids
        assert native.part_rows == [HIDDEN + HIDDEN // 2, HIDDEN // 2]


def test_greedy_tokens_equal_the_float_model(mixed_gguf, monkeypatch):
    dense = load(mixed_gguf, None)
    expected = greedy(dense, PROMPTS)
    quantized = load(mixed_gguf, "gguf")
    if kernels.ops is not None:
        assert greedy(quantized, PROMPTS) == expected
        assert [greedy(quantized, [p])[0] for p in PROMPTS] == expected
    use_kernels(monkeypatch, None)  # dequantize-then-matmul: the float model's numbers exactly
    reference = load(mixed_gguf, "gguf")
    assert greedy(reference, PROMPTS) == expected


def test_an_unsupported_type_is_refused_in_one_line():
    tensors = [("blk.0.attn_q.weight", "Q4_K", 2), ("blk.0.attn_k.weight", "IQ3_S", 2)]
    with pytest.raises(ValueError, match="GGUF tensor blk.0.attn_k.weight has type IQ3_S, which quantization=gguf "
                                         "does not load; supported types: F32, F16, BF16, Q4_0, Q4_1, Q5_0"):
        gguf_block_tensors(tensors)
    kept = gguf_block_tensors([("blk.0.attn_q.weight", "Q4_K", 2), ("blk.0.attn_k.weight", "Q8_0", 2),
                               ("blk.0.attn_v.weight", "Q8_0", 2), ("output.weight", "Q8_0", 2)])
    assert kept == {"blk.0.attn_q.weight": True, "blk.0.attn_k.weight": True, "blk.0.attn_v.weight": True,
                    "output.weight": False}  # stored when a fused partner is


def test_a_truncated_file_is_a_clear_error(tmp_path):
    path = write_mixed_gguf(tmp_path / "cut.gguf")
    path.write_bytes(path.read_bytes()[:-5000])
    with pytest.raises(ValueError, match="cut.gguf': it is corrupt or truncated"):
        load(path, "gguf")


def test_each_rank_keeps_its_shard_of_the_stored_blocks(mixed_gguf):
    """Two ranks: q/k/v and gate/up split by rows, o and down by whole blocks of inputs, the LM head by rows."""
    whole = load(mixed_gguf, "gguf")
    shards = [load(mixed_gguf, "gguf", ParallelState(rank, 2)) for rank in range(2)]
    for i in range(len(LAYER_TYPES)):
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            parts = [dequantize(s.get_submodule(f"layers.{i}.{name}").qweight) for s in shards]
            assert torch.equal(torch.cat(parts, dim=1), dequantize(whole.get_submodule(f"layers.{i}.{name}").qweight))
        gate_up = [dequantize(s.layers[i].mlp.gate_up_proj.qweight) for s in shards]
        w = dequantize(whole.layers[i].mlp.gate_up_proj.qweight)
        assert torch.equal(torch.cat([g[:FFN // 2] for g in gate_up]), w[:FFN])
    heads = [dequantize(s.lm_head.qweight) for s in shards]
    assert torch.equal(torch.cat(heads)[:VOCAB], dequantize(whole.lm_head.qweight))

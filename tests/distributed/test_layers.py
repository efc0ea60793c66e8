"""Each rank's shard, built in this process (no group is needed to build and load one): the Megatron split
of the weights and the KV cache, 1/N per rank apart from the replicated parts, and the rows it keeps."""

from __future__ import annotations

import pytest
import torch

from iterserve.config import get_preset
from iterserve.distributed.parallel_state import ParallelState
from iterserve.models.llama import LlamaModel
from iterserve.models.loader import load_model

SMOL = "random:smollm2-135m?num_layers=2&vocab_size=4800"  # 9 heads, 3 KV heads; a small vocabulary to load fast
PADDED = "random:qwen3-0.6b?num_layers=1&vocab_size=8191"  # 16 heads, 8 KV heads, q/k norms, an odd vocabulary


def _shards(name: str, tp: int) -> list[LlamaModel]:
    return [load_model(name, "float32", "cpu", parallel=ParallelState(rank, tp)).model for rank in range(tp)]


def _param_bytes(model: LlamaModel) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _kv_bytes(model: LlamaModel) -> int:
    return sum(c.k.nbytes + c.v.nbytes for c in model.allocate_kv_cache(4, 16))


def _replicated_bytes(model: LlamaModel) -> int:
    """The norms: every rank holds them whole."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "norm" in n)


def test_each_rank_holds_a_third_of_smollm2_weights_and_kv_cache():
    whole = load_model(SMOL, "float32", "cpu").model
    replicated = _replicated_bytes(whole)
    shards = _shards(SMOL, 3)
    for shard in shards:
        assert _param_bytes(shard) - replicated == (_param_bytes(whole) - replicated) // 3
        assert _kv_bytes(shard) * 3 == _kv_bytes(whole)  # 3 KV heads: one per rank
    # the shards put side by side are the whole model: q and k rows, o columns, vocabulary rows
    q, kv, d = whole.config.q_size, whole.config.kv_size, whole.config.head_dim
    attn = [s.layers[1].self_attn for s in shards]
    w = whole.layers[1].self_attn.qkv_proj.dense_weight()
    assert torch.equal(torch.cat([a.qkv_proj.dense_weight()[:3 * d] for a in attn]), w[:q])
    assert torch.equal(torch.cat([a.qkv_proj.dense_weight()[3 * d:4 * d] for a in attn]), w[q:q + kv])
    o = whole.layers[1].self_attn.o_proj.dense_weight()
    assert torch.equal(torch.cat([a.o_proj.dense_weight() for a in attn], dim=1), o)
    assert torch.equal(torch.cat([s.embed_tokens.weight for s in shards]), whole.embed_tokens.weight)
    assert all(s.lm_head.weight is s.embed_tokens.weight for s in shards)  # tied, shard for shard


def test_an_odd_vocabulary_is_padded_and_qk_norms_replicated():
    whole = load_model(PADDED, "float32", "cpu").model
    replicated = _replicated_bytes(whole)
    shards = _shards(PADDED, 2)
    row = whole.config.hidden_size * 4
    for shard in shards:
        # a half of everything split, plus the last rank's padding row of the vocabulary
        assert abs((_param_bytes(shard) - replicated) - (_param_bytes(whole) - replicated) / 2) <= row
        assert _kv_bytes(shard) * 2 == _kv_bytes(whole)
    assert torch.equal(torch.cat([s.embed_tokens.weight for s in shards])[:8191], whole.embed_tokens.weight)
    assert not shards[1].embed_tokens.weight[-1].any()


def test_kv_heads_are_replicated_when_fewer_than_ranks():
    name = "random:smollm2-135m?num_layers=1&vocab_size=999&intermediate_size=1152"  # 1152 splits 9 ways
    whole = load_model(name, "float32", "cpu").model
    d, q = whole.config.head_dim, whole.config.q_size
    w = whole.layers[0].self_attn.qkv_proj.dense_weight()
    for rank, shard in enumerate(_shards(name, 9)):  # 9 heads, 3 KV heads: each KV head on three ranks
        local = shard.layers[0].self_attn.qkv_proj.dense_weight()
        assert torch.equal(local[:d], w[rank * d:(rank + 1) * d])
        kv_head = rank // 3  # query head `rank` reads KV head rank // (9 / 3), as in the whole model
        assert torch.equal(local[d:2 * d], w[q + kv_head * d:q + (kv_head + 1) * d])
        assert shard.allocate_kv_cache(2, 16)[0].k.shape[1] == 1


def test_models_that_do_not_split_are_refused_with_the_reason():
    smol = get_preset("smollm2-135m")
    with pytest.raises(ValueError, match="9 attention heads"):
        smol.tensor_parallel_shard(2)
    with pytest.raises(ValueError, match="KV heads"):
        get_preset("qwen2-0.5b").tensor_parallel_shard(7)  # 14 heads split 7 ways, but 2 KV heads do not
    assert smol.tensor_parallel_shard(3).num_kv_heads == 1 and smol.tensor_parallel_shard(1) is smol

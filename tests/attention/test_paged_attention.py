"""PagedAttention against dense causal attention computed from the full K/V of each sequence, on every
backend (the CUDA backend's computation runs on CPU tensors too)."""

from __future__ import annotations

import pytest
import torch

from iterserve.attention import AttentionMetadata, KVCache
from iterserve.attention.cpu import CpuBackend
from iterserve.attention.cuda import CudaBackend
from iterserve.attention.reference import ReferenceBackend, gather_rows
from iterserve.platforms.ops import cpu_kernels
from tests.test_kernels import group_keys

H, KVH, D, BS = 4, 2, 8, 4

BACKENDS = {"reference": ReferenceBackend(), "cuda": CudaBackend()}
KERNELS = cpu_kernels()
if KERNELS is not None:
    BACKENDS["cpu"] = CpuBackend(KERNELS)  # as the engine runs it: short prompts attended as decodes
    BACKENDS["cpu-prompt-spans"] = CpuBackend(KERNELS)
    BACKENDS["cpu-prompt-spans"].decode_prompts_up_to = 0  # every prompt chunk through the prefill path


@pytest.fixture(params=sorted(BACKENDS))
def backend(request):
    return BACKENDS[request.param]


def dense_reference(q, k, v, window=None):
    """Causal GQA attention of one whole sequence: q/k/v are [len, heads, dim]."""
    n = q.shape[0]
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    mask = j <= i
    if window is not None:
        mask &= j > i - window
    k = k.repeat_interleave(H // KVH, dim=1)
    v = v.repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / D**0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_steps(backend, lengths, chunks, window=None, seed=0, built_with="same", window_pool=False):
    """Feed sequences through paged attention in the given per-step chunk sizes; compare each
    produced row with the dense reference. ``built_with`` other than "same" builds each step's metadata with
    that window and hands the layer its own through ``with_window`` (a model whose layers differ in window).
    ``window_pool``: the layer reads its own tables (hybrid SWA memory), in which every block a window behind
    the step's first query points at block 0, full of values no query may see."""
    g = torch.Generator().manual_seed(seed)
    seqs = [(torch.randn(n, H, D, generator=g), torch.randn(n, KVH, D, generator=g),
             torch.randn(n, KVH, D, generator=g))
            for n in lengths]
    cache = KVCache.allocate(64, BS, KVH, D, torch.float32, "cpu")
    # scattered, non-contiguous block tables
    perm = torch.randperm(64, generator=g).tolist()
    if window_pool:
        perm.remove(0)
        cache.k[0], cache.v[0] = 1e3, 1e3
    tables, nxt = [], 0
    for n in lengths:
        nb = -(-n // BS)
        tables.append(perm[nxt:nxt + nb])
        nxt += nb
    done = [0] * len(lengths)
    got = [torch.zeros(n, H, D) for n in lengths]
    for step_chunks in chunks:
        order = sorted(range(len(lengths)), key=lambda s: not (step_chunks[s] == 1 and done[s] > 0))
        order = [s for s in order if step_chunks[s] > 0]
        qs, ks, vs = [], [], []
        for s in order:
            a, b = done[s], done[s] + step_chunks[s]
            qs.append(seqs[s][0][a:b])
            ks.append(seqs[s][1][a:b])
            vs.append(seqs[s][2][a:b])
        freed = [[0 if (i + 1) * BS <= done[s] - window + 1 else b for i, b in enumerate(tables[s])]
                 for s in order] if window_pool else None
        meta = AttentionMetadata.build(block_size=BS, block_tables=[tables[s] for s in order],
                                       num_cached=[done[s] for s in order],
                                       query_lens=[step_chunks[s] for s in order],
                                       sliding_window=window if built_with == "same" else built_with,
                                       decode_prompts_up_to=backend.decode_prompts_up_to,
                                       window_tables=freed).with_window(window)
        out = backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, meta, D**-0.5)
        row = 0
        for s in order:
            n = step_chunks[s]
            got[s][done[s]:done[s] + n] = out[row:row + n]
            row += n
            done[s] += n
    for s in range(len(lengths)):
        ref = dense_reference(*seqs[s], window=window)
        torch.testing.assert_close(got[s], ref, atol=1e-5, rtol=1e-5)


def test_whole_prompts_in_one_batch(backend):
    run_steps(backend, [5, 9, 1], [[5, 9, 1]])


def test_chunked_prefill_then_decodes_mixed_with_prefills(backend):
    # seq0 prefills 3+4 then decodes; seq1 starts later and prefills while seq0 decodes.
    run_steps(backend, [10, 7], [[3, 0], [4, 0], [1, 5], [1, 2], [1, 0]])


def test_decode_batch_with_different_context_lengths(backend):
    run_steps(backend, [3, 17, 8], [[2, 16, 7], [1, 1, 1]])


def test_sliding_window_in_prefill_and_decode(backend):
    run_steps(backend, [12, 6], [[9, 5], [1, 1], [1, 0], [1, 0]], window=4)


@pytest.mark.parametrize(("window", "built_with"), [(4, None), (None, 4), (3, 5)])
def test_a_layers_own_window_over_the_steps_metadata(backend, window, built_with):
    run_steps(backend, [12, 6], [[9, 5], [1, 1], [1, 0], [1, 0]], window=window, built_with=built_with)
    run_steps(backend, [9, 8], [[3, 2], [4, 0], [1, 5], [1, 1]], window=window, built_with=built_with)


def test_a_windowed_layers_own_pool_never_sees_the_blocks_behind_its_window(backend):
    run_steps(backend, [14, 6], [[9, 5], [1, 1], [3, 0], [1, 0]], window=4, built_with=None, window_pool=True)
    run_steps(backend, [13, 11], [[2, 3], [5, 0], [1, 6], [1, 1], [1, 1], [3, 0]], window=3, built_with=None,
              window_pool=True)


def test_metadata_per_window_is_built_once():
    meta = AttentionMetadata.build(block_size=BS, block_tables=[[1, 2, 3]], num_cached=[4], query_lens=[6])
    local = meta.with_window(3)
    assert meta.with_window(None) is meta and meta.with_window(3) is local and local.sliding_window == 3
    assert local.slot_mapping is meta.slot_mapping and local.prefills[0].mask.sum() < meta.prefills[0].mask.sum()


def test_new_tokens_land_in_their_slots(backend):
    cache = KVCache.allocate(8, BS, KVH, D, torch.float32, "cpu")
    k = torch.randn(6, KVH, D)
    meta = AttentionMetadata.build(block_size=BS, block_tables=[[5, 2]], num_cached=[0], query_lens=[6])
    backend.forward(torch.randn(6, H, D), k, torch.randn(6, KVH, D), cache, meta, 1.0)
    assert meta.slot_mapping.tolist() == [20, 21, 22, 23, 8, 9]
    torch.testing.assert_close(cache.k[5].transpose(0, 1), k[:4])  # [kv_heads, offset, D] per block
    torch.testing.assert_close(cache.k[2, :, :2].transpose(0, 1), k[4:])
    assert cache.k[[0, 1, 3, 4, 6, 7]].abs().sum() == 0


def test_decode_reads_only_the_blocks_of_the_batch():
    """The gathered width follows the longest context in the batch, not the pool size."""
    meta = AttentionMetadata.build(block_size=BS, block_tables=[[7, 3], [1]], num_cached=[5, 2], query_lens=[1, 1])
    assert meta.decode_block_tables.shape == (2, 2)
    assert meta.decode_bias.shape[-1] == 2 * BS
    assert meta.decode_bias[1, 0, 0].tolist() == [0.0] * 3 + [float("-inf")] * 5


def test_slots_and_tables_of_a_mixed_batch():
    """Decodes first, then a chunk continuing a cached prefix, then a fresh prompt: every token's slot is
    table[pos // BS] * BS + pos % BS."""
    tables, cached, qlens = [[7, 3], [1], [4, 0, 6], [2, 5]], [5, 1, 6, 0], [1, 1, 4, 5]
    meta = AttentionMetadata.build(block_size=BS, block_tables=tables, num_cached=cached, query_lens=qlens)
    want = [t[p // BS] * BS + p % BS for t, c, n in zip(tables, cached, qlens) for p in range(c, c + n)]
    assert meta.slot_mapping.tolist() == want
    assert meta.num_decode_tokens == 2
    assert meta.decode_block_tables.tolist() == [[7, 3], [1, 0]]
    assert meta.decode_context_lens.tolist() == [6, 2]
    assert [(s.start, s.end, s.context_len, s.block_table.tolist()) for s in meta.prefills] == [
        (2, 6, 10, [4, 0, 6]), (6, 11, 5, [2, 5])]


def test_short_prompts_attended_as_decodes_up_to_the_backends_limit():
    """Each token of a prompt chunk whose sequence holds at most the limit becomes a decode row over its own
    prefix, while only such sequences come before it; the others stay prefill spans."""
    tables, cached, qlens = [[7, 3], [1], [4, 0, 6], [2, 5]], [5, 1, 6, 0], [1, 1, 4, 5]
    some = AttentionMetadata.build(block_size=BS, block_tables=tables, num_cached=cached, query_lens=qlens,
                                   decode_prompts_up_to=8)  # the third holds 10 tokens: it and all after stay spans
    assert some.num_decode_tokens == 2 and [(s.start, s.context_len) for s in some.prefills] == [(2, 10), (6, 5)]
    every = AttentionMetadata.build(block_size=BS, block_tables=tables, num_cached=cached, query_lens=qlens,
                                    decode_prompts_up_to=10)
    assert every.num_decode_tokens == 11 and not every.prefills
    assert every.decode_context_lens.tolist() == [6, 2, 7, 8, 9, 10, 1, 2, 3, 4, 5]
    assert every.decode_block_tables.tolist() == [[7, 3, 0], [1, 0, 0]] + [[4, 0, 6]] * 4 + [[2, 5, 0]] * 5
    want = [t[p // BS] * BS + p % BS for t, c, n in zip(tables, cached, qlens) for p in range(c, c + n)]
    assert every.slot_mapping.tolist() == want


def test_a_pool_of_keys_in_groups_is_gathered_as_rows():
    """The prefill path reads cached K through gather_rows whichever layout the backend chose."""
    pool = torch.randn(6, 2, 32, 64)
    grouped = KVCache.allocate(6, 32, 2, 64, torch.float32, "cpu", keys_in_groups=True)
    grouped.k.copy_(group_keys(pool))
    rows = torch.tensor([5, 0, 11, 2])  # (block, head) rows, as span.rows() lists them
    assert torch.equal(gather_rows(grouped.k, rows), gather_rows(pool, rows))
    assert gather_rows(pool, rows).shape == (4 * 32, 64)

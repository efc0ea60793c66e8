"""Block pool bookkeeping: reference counts, prefix-cache hits and LRU eviction."""

from __future__ import annotations

import pytest

from iterserve.engine.block_manager import BlockManager, chain_hash
from iterserve.engine.sequence import RequestMetrics, Sequence
from iterserve.sampling_params import SamplingParams


def seq(tokens, rid="r"):
    return Sequence(rid, None, list(tokens), SamplingParams(), 16, RequestMetrics(0.0))


def admit(bm: BlockManager, s: Sequence) -> int:
    """Admit a whole prompt the way the scheduler does; returns the cached tokens reused."""
    hits = bm.find_cached_prefix(s)
    assert bm.allocate(s, s.num_tokens - len(hits) * bm.block_size, hits)
    s.num_computed_tokens = s.num_tokens
    bm.commit(s)
    return len(hits) * bm.block_size


def test_allocate_and_free_restore_the_pool():
    bm = BlockManager(8, 4)
    s = seq(range(10))
    admit(bm, s)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    bm.free(s)
    assert bm.num_free_blocks == 8 and not s.block_table
    bm.check_no_leaks()


def test_allocation_fails_cleanly_when_the_pool_is_short():
    bm = BlockManager(2, 4)
    s = seq(range(9))
    assert not bm.allocate(s, 9)
    assert s.block_table == [] and bm.num_free_blocks == 2


def test_shared_prefix_is_reused_and_reference_counted():
    bm = BlockManager(16, 4)
    a, b = seq(list(range(12)) + [100], "a"), seq(list(range(12)) + [200, 201], "b")
    assert admit(bm, a) == 0
    assert admit(bm, b) == 12  # three full blocks shared
    assert b.block_table[:3] == a.block_table[:3]
    assert all(bm.blocks[i].ref_count == 2 for i in a.block_table[:3])
    bm.free(a)
    assert all(bm.blocks[i].ref_count == 1 for i in b.block_table[:3])
    bm.free(b)
    bm.check_no_leaks()


def test_last_prompt_token_is_never_served_from_cache():
    bm = BlockManager(16, 4)
    admit(bm, seq(range(8), "a"))
    # identical 8-token prompt: only the first block may hit, one token must still be computed
    assert admit(bm, seq(range(8), "b")) == 4


def test_freed_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(4, 4)
    a = seq(range(8), "a")
    admit(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4  # free, but still findable
    assert admit(bm, seq(list(range(8)) + [9], "b")) == 8
    bm2 = BlockManager(3, 4)
    a = seq(range(8), "a")
    admit(bm2, a)
    bm2.free(a)
    filler = seq(range(50, 58), "c")  # needs 2 blocks: the never-used one, then an evicted one
    admit(bm2, filler)
    bm2.free(filler)
    # the tail block of the old prefix was evicted first, so only its head block still hits
    assert admit(bm2, seq(list(range(8)) + [9], "d")) == 4


def test_a_hash_hit_is_confirmed_against_tokens_and_parent():
    bm = BlockManager(8, 2)
    a = seq([1, 2, 3, 4, 5], "a")
    admit(bm, a)
    h = chain_hash(None, (1, 2))
    # forge a colliding entry: same hash key, different tokens
    bm.cached[h].token_ids = (7, 7)
    assert bm.find_cached_prefix(seq([1, 2, 3, 4, 9], "b")) == []


def test_invalid_pool():
    with pytest.raises(ValueError):
        BlockManager(0, 16)

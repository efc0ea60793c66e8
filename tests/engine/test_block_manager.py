"""Block pool bookkeeping: reference counts, prefix-cache hits and LRU eviction."""

from __future__ import annotations

import pytest

from iterserve.engine.block_manager import BlockManager, chain_hash
from iterserve.engine.messages import KV_CACHED, KV_FIRST_ROW, KV_FREE, KV_HELD, KV_SHARED
from iterserve.engine.sequence import Sequence
from iterserve.lora import LoRARequest
from iterserve.outputs import RequestMetrics
from iterserve.sampling_params import SamplingParams


def seq(tokens, rid="r", lora: LoRARequest | None = None):
    return Sequence(rid, None, list(tokens), SamplingParams(), 16, RequestMetrics(0.0), lora=lora)


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


def test_each_lora_adapter_has_its_own_prefix_chains():
    """The adapter's id roots the chain: the same tokens under two adapters (or an adapter and the base model)
    hash apart, so neither is served the other's K/V; the same adapter again hits."""
    bm = BlockManager(16, 4)
    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    tokens = range(9)
    assert admit(bm, seq(tokens, "a1", a)) == 0
    assert admit(bm, seq(tokens, "b1", b)) == 0
    assert admit(bm, seq(tokens, "base")) == 0
    assert admit(bm, seq(tokens, "a2", a)) == 8
    assert admit(bm, seq(tokens, "a3", LoRARequest("a-again", 1, "/a"))) == 8  # the id is the identity


def test_invalid_pool():
    with pytest.raises(ValueError):
        BlockManager(0, 16)


def test_fork_shares_blocks_and_copies_the_partial_one_on_first_write():
    bm = BlockManager(8, 4)
    parent = seq(range(10))  # blocks: [0-3] [4-7] [8-9 + room]
    admit(bm, parent)
    children = [seq(range(10)) for _ in range(2)]
    for child in children:
        child.num_computed_tokens = parent.num_computed_tokens
        bm.fork(parent, child)
    assert bm.num_used_blocks == 3  # three sequences, one copy of the prompt
    assert all(c.block_table == parent.block_table for c in children)
    partial = parent.block_table[2]
    for i, s in enumerate([children[0], children[1], parent]):
        s.output_token_ids.append(100 + i)
        assert bm.allocate(s, 1)
    copies = bm.take_copies()
    # the first two writers get private copies; the last holder writes in place
    assert [src for src, _ in copies] == [partial, partial]
    assert children[0].block_table[2] == copies[0][1] and children[1].block_table[2] == copies[1][1]
    assert parent.block_table[2] == partial and bm.blocks[partial].ref_count == 1
    assert children[0].block_table[:2] == parent.block_table[:2]  # full blocks stay shared
    assert bm.blocks[parent.block_table[0]].ref_count == 3
    assert bm.num_used_blocks == 5 and bm.take_copies() == []
    for s in [parent, *children]:
        bm.free(s)
    bm.check_no_leaks()


def test_copy_on_write_refused_when_the_pool_is_full_changes_nothing():
    bm = BlockManager(3, 4)
    parent = seq(range(10))
    admit(bm, parent)
    child = seq(range(10))
    child.num_computed_tokens = parent.num_computed_tokens
    bm.fork(parent, child)
    child.output_token_ids.append(1)
    table = list(child.block_table)
    assert not bm.allocate(child, 1)  # no free block for the copy
    assert child.block_table == table and bm.take_copies() == []
    bm.free(parent)
    assert bm.allocate(child, 1) and bm.take_copies() == []  # sole holder now: writes in place
    bm.free(child)
    bm.check_no_leaks()


def test_block_states_tell_free_cached_shared_and_each_rows_blocks():
    bm = BlockManager(12, 4)
    a, b, c = seq(list(range(8)) + [100], "a"), seq(list(range(8)) + [200], "b"), seq(range(50, 55), "c")
    admit(bm, a)
    admit(bm, b)  # shares a's two full blocks
    admit(bm, c)
    gone = seq(range(300, 308), "gone")
    admit(bm, gone)
    cached = list(gone.block_table)
    bm.free(gone)  # its two full blocks stay cached until handed out again
    states = bm.block_states([b, a])  # row 0 is b, row 1 is a; c holds blocks but is not in the batch
    assert len(states) == bm.num_blocks
    for block_id in a.block_table[:2]:
        assert states[block_id] == KV_SHARED
    assert states[a.block_table[2]] == KV_FIRST_ROW + 1 and states[b.block_table[2]] == KV_FIRST_ROW
    assert all(states[i] == KV_HELD for i in c.block_table)
    assert [states[i] for i in cached] == [KV_CACHED, KV_CACHED]
    assert list(states).count(KV_FREE) == 12 - 2 - 1 - 1 - 2 - 2  # shared, a's, b's, c's, cached

"""The data-parallel router: the least queued work once a recorded prefix is counted off, then fewest
queued tokens; its record is the block manager's own chain hashes and stays within its bound, least
recently used out first."""

from __future__ import annotations

import pytest

from iterserve.engine.block_manager import BlockManager
from iterserve.engine.router import Replica, Router, prompt_block_hashes
from iterserve.engine.sequence import Sequence
from iterserve.outputs import RequestMetrics
from iterserve.sampling_params import SamplingParams

BS = 4
SHARED = list(range(100, 116))  # four full blocks


def test_hashes_are_the_ones_the_block_manager_registers():
    bm = BlockManager(8, BS)
    tokens = list(range(30))
    seq = Sequence("r", None, tokens, SamplingParams(), 4, RequestMetrics(0.0))
    assert bm.allocate(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    bm.commit(seq)
    assert prompt_block_hashes(tokens, BS, len(tokens) // BS) == seq.block_hashes


def test_a_shared_prefix_follows_its_replica_even_when_that_one_is_busier():
    r = Router(2, BS, max_blocks=64)
    assert r.route("a", SHARED + [1], max_new_tokens=10) == 0  # a tie: the lowest index
    assert r.route("b", [7] * 9, max_new_tokens=10) == 1  # no prefix anywhere: the less loaded
    assert r.route("c", SHARED + [2, 3], max_new_tokens=10) == 0  # 27 queued less 16 cached beat 19 queued
    assert r.route("d", [8] * 9, max_new_tokens=10) == 1
    assert r.replicas[0].queued_tokens == 27 + 28 and r.replicas[1].queued_tokens == 2 * 19


def test_a_prefix_shorter_than_the_imbalance_does_not_pull_requests_to_its_replica():
    r = Router(2, BS, max_blocks=64)
    assert r.route("a", SHARED + [1], max_new_tokens=1000) == 0
    assert r.route("b", SHARED + [2], max_new_tokens=10) == 1  # 16 cached tokens do not outweigh 1,017 queued


def test_chats_sharing_only_a_system_prompt_spread_over_the_replicas():
    r = Router(2, BS, max_blocks=64)
    system = SHARED[:8]  # two blocks every chat starts with, as a chat template's system prompt
    chosen = [r.route(f"chat{i}", system + [200 + i] * 7, max_new_tokens=64) for i in range(8)]
    assert chosen.count(0) == 4 and chosen.count(1) == 4


def test_the_longest_prefix_wins_and_equal_prefixes_go_by_load():
    r = Router(3, BS, max_blocks=64)
    r.replicas[0].remember(prompt_block_hashes(SHARED, BS, 2))
    r.replicas[1].remember(prompt_block_hashes(SHARED, BS, 4))
    r.replicas[2].remember(prompt_block_hashes(SHARED, BS, 4))
    r.route("busy", [9] * 5, max_new_tokens=5)  # nothing matches: replica 0, the lowest index
    assert r.route("x", [5] * 5, max_new_tokens=5) == 1
    assert r.route("long", SHARED + [1], max_new_tokens=5) == 2  # 1 and 2 match 4 blocks; 2 is idle
    # the last prompt token is always computed, so a prompt of exactly 4 blocks can use 3: 3 and 4
    # blocks recorded count the same, and the tie goes to the lowest index
    r = Router(2, BS, max_blocks=64)
    r.replicas[0].remember(prompt_block_hashes(SHARED, BS, 3))
    r.replicas[1].remember(prompt_block_hashes(SHARED, BS, 4))
    assert r.route("exact", SHARED, max_new_tokens=5) == 0


def test_finish_returns_the_replica_and_its_load():
    r = Router(2, BS, max_blocks=64)
    r.route("a", [1] * 10, max_new_tokens=20)
    r.route("b", [2] * 10, max_new_tokens=20)
    assert r.requests_on(0) == ["a"] and r.replica_of("b") == 1
    assert r.finish("a") == 0 and r.finish("a") is None
    assert r.replicas[0].queued_tokens == 0 and r.replicas[1].queued_tokens == 30
    assert r.route("c", [3] * 10, max_new_tokens=20) == 0
    with pytest.raises(ValueError, match="already routed"):
        r.route("c", [3], max_new_tokens=1)


def test_without_prefix_caching_only_the_load_counts():
    r = Router(2, BS, max_blocks=64, prefix_caching=False)
    assert r.route("a", SHARED + [1], max_new_tokens=100) == 0
    assert r.route("b", SHARED + [1], max_new_tokens=100) == 1
    assert not r.replicas[0].blocks


def test_the_record_is_bounded_least_recently_used_out_first():
    rep = Replica(max_blocks=3)
    rep.remember([1, 2])
    rep.remember([3])
    rep.remember([1, 2])  # used again: now more recent than 3
    rep.remember([4])
    assert list(rep.blocks) == [1, 2, 4]
    assert rep.matched_blocks([1, 2, 4, 5]) == 3 and rep.matched_blocks([3]) == 0
    r = Router(2, BS, max_blocks=3)
    r.route("a", SHARED + [1], max_new_tokens=1)  # four blocks, three kept: the chain's head is gone
    assert len(r.replicas[0].blocks) == 3
    assert r.replicas[0].matched_blocks(prompt_block_hashes(SHARED, BS, 4)) == 0


def test_restarting_replicas_are_skipped_and_a_restarted_one_starts_with_no_prefix():
    r = Router(3, BS, max_blocks=64)
    assert r.route("a", SHARED + [1], max_new_tokens=5) == 0
    assert r.route("b", SHARED + [2], max_new_tokens=5, exclude={0}) in (1, 2)  # its prefix is on 0, which is down
    assert r.route("c", [3] * 9, max_new_tokens=5, exclude={0, 1}) == 2
    with pytest.raises(ValueError, match="every replica"):
        r.route("d", [4], max_new_tokens=1, exclude={0, 1, 2})
    r.forget(0)
    assert r.replicas[0].matched_blocks(prompt_block_hashes(SHARED, BS, 4)) == 0

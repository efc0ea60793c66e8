"""The sliding-window layers' own pool (hybrid SWA memory): blocks a window behind the next token go back to it,
allocations cover both pools or neither, forks share and copy on write, and nothing leaks."""

from __future__ import annotations

from iterserve.engine.block_manager import BlockManager
from iterserve.engine.sequence import Sequence
from iterserve.engine.window_blocks import NULL_BLOCK, WindowBlocks
from iterserve.outputs import RequestMetrics
from iterserve.sampling_params import SamplingParams


def seq(n: int, rid: str = "r") -> Sequence:
    return Sequence(rid, None, list(range(n)), SamplingParams(), 64, RequestMetrics(0.0))


def pools(full: int = 32, window_blocks: int = 8, window: int = 6) -> BlockManager:
    return BlockManager(full, 4, enable_prefix_caching=False, window=WindowBlocks(window_blocks, 4, window))


def compute(bm: BlockManager, s: Sequence, n: int) -> None:
    """Schedule and commit ``n`` more tokens of ``s`` (appending a generated token where the prompt has run out)."""
    while s.num_tokens < s.num_computed_tokens + n:
        s.output_token_ids.append(7)
    assert bm.allocate(s, n)
    s.num_computed_tokens += n


def test_blocks_a_window_behind_go_back_and_the_table_keeps_its_length():
    bm = pools()
    w = bm.window
    assert w is not None
    s = seq(10)
    compute(bm, s, 10)  # positions 0-9 in blocks 0-2 of both pools
    assert len(s.window_table) == 3 and w.num_free_blocks == 4 and NULL_BLOCK not in s.window_table
    for _ in range(30):  # decode: the next query at position p sees keys p - 5 .. p
        compute(bm, s, 1)
        p = s.num_computed_tokens - 1  # the position the last step wrote
        first = max(0, p - 6 + 1) // 4  # the first block that step's query could see
        assert s.window_table[:first] == [NULL_BLOCK] * first
        assert NULL_BLOCK not in s.window_table[first:]
        assert len(s.window_table) == len(s.block_table) == -(-s.num_computed_tokens // 4)
    assert len(s.block_table) == 10 and sum(b != NULL_BLOCK for b in s.window_table) <= 3
    bm.free(s)
    bm.check_no_leaks()


def test_a_prompt_chunk_holds_its_whole_span_and_then_lets_it_go():
    bm = pools(window_blocks=9)
    w = bm.window
    assert w is not None
    s = seq(40)
    compute(bm, s, 20)  # the first chunk writes positions 0-19: five blocks held while it runs
    assert w.num_free_blocks == 8 - 5
    compute(bm, s, 8)  # the next chunk's first query (20) sees keys from 15 on: blocks 0-2 go back
    assert s.window_table[:3] == [NULL_BLOCK] * 3 and w.num_free_blocks == 8 - 4
    bm.free(s)
    bm.check_no_leaks()


def test_an_allocation_the_window_pool_cannot_hold_changes_neither_pool():
    bm = pools(window_blocks=4)  # three usable blocks
    a = seq(12, "a")
    compute(bm, a, 12)
    assert bm.usage == 1.0  # the window pool is full: it binds, though the full pool holds 3 of 32 blocks
    b = seq(8, "b")
    full_free = bm.num_free_blocks
    assert not bm.allocate(b, 8)
    assert b.block_table == [] and b.window_table == [] and bm.num_free_blocks == full_free
    bm.free(a)
    assert bm.allocate(b, 8)
    bm.free(b)
    bm.check_no_leaks()


def test_forks_share_window_blocks_and_copy_the_one_they_write():
    bm = pools()
    w = bm.window
    assert w is not None
    parent, child = seq(10, "p"), seq(10, "c")
    compute(bm, parent, 10)
    child.num_computed_tokens = parent.num_computed_tokens
    bm.fork(parent, child)
    assert child.window_table == parent.window_table and w.refs[parent.window_table[2]] == 2
    compute(bm, child, 1)  # position 10 goes into the shared, partly filled block 2: the child gets a copy
    assert bm.take_window_copies() == [(parent.window_table[2], child.window_table[2])]
    assert child.window_table[2] != parent.window_table[2] and w.refs[parent.window_table[2]] == 1
    for s in (parent, child):
        bm.free(s)
    bm.check_no_leaks()


def test_trim_gives_back_the_blocks_of_rejected_drafts():
    bm = pools()
    s = seq(8)
    compute(bm, s, 8)
    assert bm.allocate(s, 1 + 6)  # a decode verifying six drafts: positions 8-14
    assert len(s.window_table) == 4
    s.num_computed_tokens += 2  # one draft accepted
    bm.trim(s)
    assert len(s.window_table) == len(s.block_table) == 3
    bm.free(s)
    bm.check_no_leaks()


def cached_pools(window_blocks: int = 16) -> BlockManager:
    return BlockManager(32, 4, window=WindowBlocks(window_blocks, 4, 6))


def admit(bm: BlockManager, s: Sequence) -> int:
    """Admit a whole prompt as the scheduler does (prefix hits first), compute it and commit; the tokens hit."""
    hits = bm.find_cached_prefix(s)
    assert bm.allocate(s, s.num_tokens - len(hits) * 4, hits)
    s.num_computed_tokens = s.num_tokens
    bm.commit(s)
    return len(hits) * 4


def test_a_prefix_hit_takes_only_the_last_window_of_blocks():
    bm = cached_pools()
    a = seq(30, "a")
    compute(bm, a, 16)
    bm.commit(a)
    compute(bm, a, 14)
    bm.commit(a)
    assert a.window_table[:2] == [NULL_BLOCK] * 2  # given back, still cached
    bm.free(a)
    b = seq(31, "b")  # a's 30 tokens and one more: 7 full blocks hit
    assert admit(bm, b) == 28
    first = (28 - 6 + 1) // 4  # the first block the query at position 28 sees
    assert b.window_table[:first] == [NULL_BLOCK] * first and NULL_BLOCK not in b.window_table[first:]
    assert b.window_start == first and len(b.window_table) == 8
    bm.free(b)
    bm.check_no_leaks()


def test_a_hit_is_cut_to_what_the_window_pool_still_holds():
    bm = cached_pools(window_blocks=9)
    a = seq(30, "a")
    admit(bm, a)  # one chunk: all 8 usable window blocks held, then hashed
    bm.free(a)
    other = seq(12, "o")
    other.prompt_token_ids = [900 + t for t in range(12)]
    admit(bm, other)  # takes the 3 window blocks given back first: a's last ones, so a hit of 7 blocks fails
    b = seq(31, "b")
    hit = admit(bm, b)
    assert 0 < hit < 28
    assert hit == 20  # 5 blocks: the window before position 20 (blocks 3 and 4) is still cached
    for s in (other, b):
        bm.free(s)
    bm.check_no_leaks()

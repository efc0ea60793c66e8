"""The sliding-window layers' KV pool: blocks that go back to the pool once they fall out of the window.

A model whose layers mix sliding-window and full attention (Gemma 3: five local layers to one global) keeps
its windowed layers' K/V in a pool of its own, as SGLang's hybrid SWA memory does. A sequence's
``window_table`` maps its logical blocks to this pool's blocks, as its ``block_table`` does for the full
layers' pool. Once no query to come can see a block (every position in it lies a whole window behind the
next token to compute), the block goes back to the pool and the table points at the null block 0, which
nothing writes and every windowed layer masks out: a long sequence holds about a window of blocks here,
not its whole context. Forked sequences share blocks by reference count and copy one on first write.

Prefix caching works as in the full pool: a full block keeps its chain hash and tokens after it is given
back, findable until the pool hands it out again (least recently given back first). A prefix hit of ``n``
blocks needs the full pool's ``n`` blocks and only the last window's worth of them here (those the first
query after the hit sees), as vLLM's sliding-window manager reasons.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from iterserve.engine.sequence import Sequence

NULL_BLOCK = 0  # never handed out: the table entry of a block that fell out of the window


@dataclass
class WindowBlocks:
    num_blocks: int  # the null block included
    block_size: int
    window: int
    refs: list[int] = field(init=False)
    hashes: list[int | None] = field(init=False)  # a full block's chain hash, as the full pool's block there
    tokens: list[tuple[int, ...]] = field(init=False)  # ... and its tokens, to confirm a hit
    free_queue: OrderedDict[int, None] = field(init=False)  # handed out from the front
    cached: dict[int, int] = field(init=False)  # chain hash -> block
    pending_copies: list[tuple[int, int]] = field(init=False)  # (src, dst) the next step copies, windowed layers

    def __post_init__(self) -> None:
        if self.num_blocks < 2 or self.block_size < 1 or self.window < 1:
            raise ValueError("a window pool needs num_blocks >= 2, block_size >= 1 and window >= 1")
        self.refs = [0] * self.num_blocks
        self.refs[NULL_BLOCK] = 1
        self.hashes, self.tokens = [None] * self.num_blocks, [()] * self.num_blocks
        self.free_queue = OrderedDict((b, None) for b in range(1, self.num_blocks))
        self.cached, self.pending_copies = {}, []

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1 - len(self.free_queue) / (self.num_blocks - 1)

    def first_seen(self, num_computed: int) -> int:
        """The first logical block a query at position ``num_computed`` (or later) sees."""
        return max(0, num_computed - self.window + 1) // self.block_size

    # -- prefix cache ---------------------------------------------------------------------------

    def longest_hit(self, hashes: list[int], chunks: list[tuple[int, ...]]) -> int:
        """How many of a prefix's full-pool hits (their chain hashes and tokens) this pool can serve: the most
        ``n`` whose last window of blocks, from :meth:`first_seen` of ``n`` blocks' tokens on, is cached here."""
        here = [self._holds(h, chunk) for h, chunk in zip(hashes, chunks)]
        for n in range(len(hashes), 0, -1):
            if all(here[self.first_seen(n * self.block_size):n]):
                return n
        return 0

    def _holds(self, h: int, chunk: tuple[int, ...]) -> bool:
        block = self.cached.get(h)
        return block is not None and self.tokens[block] == chunk

    def hit_blocks(self, hashes: list[int]) -> list[int]:
        """The cached blocks a hit of ``len(hashes)`` blocks takes (checked by :meth:`longest_hit`)."""
        first = self.first_seen(len(hashes) * self.block_size)
        return [self.cached[h] for h in hashes[first:]]

    def register(self, seq: Sequence, start: int, end: int) -> None:
        """Blocks ``start``-``end`` of ``seq`` are full and hashed in the full pool (``seq.block_hashes``): cache
        those it still holds here under the same hashes."""
        tokens = seq.token_ids
        for i in range(max(start, seq.window_start), min(end, len(seq.window_table))):
            block, h = seq.window_table[i], seq.block_hashes[i]
            if self.hashes[block] is None and h not in self.cached:
                self.hashes[block], self.tokens[block] = h, tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
                self.cached[h] = block

    def reset(self) -> None:
        """Forget every cached block (the prefix cache was reset)."""
        for block in self.cached.values():
            self.hashes[block], self.tokens[block] = None, ()
            if self.refs[block] == 0:
                self.free_queue.move_to_end(block, last=False)
        self.cached.clear()

    # -- allocation -----------------------------------------------------------------------------

    def release_behind(self, seq: Sequence) -> None:
        """Give back the blocks of ``seq`` that no query from its next token on can see."""
        first = min(self.first_seen(seq.num_computed_tokens), len(seq.window_table))
        table = seq.window_table
        for i in range(seq.window_start, first):
            self._release(table[i])
            table[i] = NULL_BLOCK
        seq.window_start = max(seq.window_start, first)

    def allocate(self, seq: Sequence, target_tokens: int, writes: bool, hits: list[int], hit_tokens: int) -> bool:
        """Cover ``target_tokens`` of ``seq`` (after :meth:`release_behind`), its first ``hit_tokens`` from the
        cached ``hits`` (:meth:`hit_blocks`, for a sequence holding none yet), and make the block its next token
        goes into its own where it ``writes``; False, changing nothing, when the pool cannot."""
        covered = len(seq.window_table) or (self.first_seen(hit_tokens) + len(hits) if hits else 0)
        blocks = max(0, -(-target_tokens // self.block_size) - covered)
        shared = self._shared_write_block(seq) if writes else None
        if blocks + (shared is not None) + sum(self.refs[b] == 0 for b in hits) > len(self.free_queue):
            return False
        if hits:
            first = self.first_seen(hit_tokens)
            seq.window_table, seq.window_start = [NULL_BLOCK] * first, first
            for block in hits:
                if self.refs[block] == 0:
                    del self.free_queue[block]
                self.refs[block] += 1
                seq.window_table.append(block)
        if shared is not None:
            copy = self._take_free_block()
            self.refs[shared] -= 1
            seq.window_table[seq.num_computed_tokens // self.block_size] = copy
            self.pending_copies.append((shared, copy))
        while len(seq.window_table) * self.block_size < target_tokens:
            seq.window_table.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        h = self.hashes[block]
        if h is not None:  # evict its cached content
            if self.cached.get(h) == block:
                del self.cached[h]
            self.hashes[block], self.tokens[block] = None, ()
        self.refs[block] = 1
        return block

    def _shared_write_block(self, seq: Sequence) -> int | None:
        i = seq.num_computed_tokens // self.block_size
        if i < len(seq.window_table) and self.refs[seq.window_table[i]] > 1:
            return seq.window_table[i]
        return None

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give ``child`` the parent's window blocks (shared by reference count, copied on first write)."""
        for block in parent.window_table[parent.window_start:]:
            self.refs[block] += 1
        child.window_table, child.window_start = list(parent.window_table), parent.window_start

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.window_table[seq.window_start:]):
            self._release(block)
        seq.window_table, seq.window_start = [], 0

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past ``seq``'s computed tokens (those of drafts it rejected)."""
        keep = max(seq.window_start, -(-seq.num_computed_tokens // self.block_size))
        for block in reversed(seq.window_table[keep:]):
            self._release(block)
        del seq.window_table[keep:]

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def _release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free_queue[block] = None
            if self.hashes[block] is None:  # uncached content is worthless: hand it out first
                self.free_queue.move_to_end(block, last=False)

    def check_no_leaks(self) -> None:
        held = [b for b, r in enumerate(self.refs) if r and b != NULL_BLOCK]
        if held or len(self.free_queue) != self.num_blocks - 1:
            raise AssertionError(f"window KV blocks still referenced: {held[:16]}")

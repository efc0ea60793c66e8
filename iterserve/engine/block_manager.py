"""The KV block pool: fixed-size blocks, reference counts, and hash-chained prefix caching.

A sequence holds a *block table*: the ids of the blocks that store its tokens, in order. Blocks
are handed out from a free queue. When a block fills up its content is hashed together with its
parent's hash, so equal hashes mean equal whole prefixes; a later sequence with the same prefix
reuses those blocks instead of recomputing them (a hit is confirmed against the stored tokens).
Freed blocks keep their cached content and stay findable until the free queue hands them out
again, least recently used first.

With KV-cache events on, the blocks a scheduled step will fill are announced (BlockStored) when it is
scheduled, before the forward pass, as vLLM announces them, so a router learns where a prefix lives while
its prefill runs. They join the prefix cache only when the step commits them: no sequence reads K/V
that is still being computed. An announced block that never enters the cache (its sequence aborted,
preempted or failed first) is withdrawn with a BlockRemoved, so a router never keeps a block nobody holds.

A model whose layers mix sliding-window and full attention keeps its windowed layers' blocks in a
:class:`~iterserve.engine.window_blocks.WindowBlocks` pool (``window``): every allocation covers both pools or
neither, its blocks that fall out of the window go back to that pool, and a prefix hit is as long as that
pool still holds the last window of.

A forked sequence (n > 1) shares its parent's whole block table; the first time either writes
into a shared, partly filled block, :meth:`BlockManager.allocate` gives the writer a private copy
(copy-on-write) and queues the (source, destination) pair for the model runner to copy.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from iterserve.engine.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, external_hash
from iterserve.engine.messages import KV_CACHED, KV_FIRST_ROW, KV_HELD, KV_SHARED
from iterserve.engine.sequence import Sequence
from iterserve.engine.window_blocks import WindowBlocks


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and registered in the prefix cache
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()


ROOT_PARENT = 0  # stands for "no parent" in the hash: hash(None) differs between processes before Python 3.12


def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """The hash of a block's tokens and its whole prefix; the same in every process (ints and tuples of ints
    hash alike everywhere), so the events' hashes and a router's copy agree."""
    return hash((ROOT_PARENT if parent_hash is None else parent_hash, token_ids))


LORA_ROOT = -1  # tags the chain root of an adapter's blocks, so no adapter's root equals a block's hash by design


def chain_root(seq: Sequence) -> int | None:
    """The parent of a sequence's first block: none for the base model, its LoRA adapter's id otherwise, so that
    the K/V one adapter computed is never served to another adapter or to the base model."""
    return None if seq.lora is None else hash((LORA_ROOT, seq.lora.lora_int_id))


@dataclass
class BlockManager:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    window: WindowBlocks | None = None  # the windowed layers' pool (hybrid SWA memory); None: one pool
    blocks: list[Block] = field(init=False)
    free_queue: OrderedDict[int, None] = field(init=False)  # LRU order: evict from the front
    cached: dict[int, Block] = field(init=False)  # chain hash -> block
    pending_copies: list[tuple[int, int]] = field(init=False)  # (src, dst) KV copies the next step must do
    # what entered and left the prefix cache since the last take_events(); None: nobody listens, nothing kept
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] | None = field(init=False, default=None)
    # chain hash -> id() of the sequence that announced it: announced, not yet in the cache (never both)
    announced: dict[int, int] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self.free_queue = OrderedDict((i, None) for i in range(self.num_blocks))
        self.cached = {}
        self.pending_copies = []

    # -- accounting -----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence references (cached-and-evictable ones included)."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def usage(self) -> float:
        """The fraction of the pool held; with a window pool, of the fuller of the two (the one that binds)."""
        full = self.num_used_blocks / self.num_blocks
        return full if self.window is None else max(full, self.window.usage)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ---------------------------------------------------------------------------

    def find_cached_prefix(self, seq: Sequence) -> list[Block]:
        """Full cached blocks matching the start of the sequence's tokens, leaving at least one token
        to compute (the last token must run through the model to produce logits)."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position to run through the model
        hits: list[Block] = []
        parent = chain_root(seq)
        if seq.block_table:
            return hits
        tokens = seq.token_ids
        for i in range((len(tokens) - 1) // self.block_size):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            h = chain_hash(parent, chunk)
            block = self.cached.get(h)
            if block is None or block.token_ids != chunk or block.parent_hash != parent:
                break
            hits.append(block)
            parent = h
        if self.window is not None:  # as many as the windowed layers' pool holds the last window of
            hits = hits[:self.window.longest_hit([b.hash for b in hits if b.hash is not None],
                                                 [b.token_ids for b in hits])]
        return hits

    def _register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Hash the blocks of ``seq`` that ``num_tokens`` computed tokens have filled into the prefix cache,
        publishing those not announced when scheduled."""
        full = num_tokens // self.block_size
        if full <= seq.num_hashed_blocks:
            return  # most decode steps fill no block; skip copying the sequence's tokens
        tokens, root = seq.token_ids, chain_root(seq)
        for i in range(seq.num_hashed_blocks, full):
            parent = seq.block_hashes[-1] if seq.block_hashes else root
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            h = chain_hash(parent, chunk)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.cached:
                block.hash, block.parent_hash, block.token_ids = h, parent, chunk
                self.cached[h] = block
                if self.events is not None and self.announced.pop(h, None) is None:
                    self._stored(h, None if i == 0 else parent, chunk, seq)
            elif self.announced.get(h) == id(seq):  # announced, yet not cached (its block holds other content)
                self._withdraw(h)
        seq.num_hashed_blocks = full

    def announce(self, seq: Sequence, num_tokens: int) -> None:
        """Publish the blocks that this step's ``num_tokens`` tokens of ``seq`` fill, before the step computes
        them (vLLM caches them when it schedules them). Only :meth:`commit` makes them hits."""
        if self.events is None or not self.enable_prefix_caching:
            return
        full = (seq.num_computed_tokens + num_tokens) // self.block_size
        if full <= seq.num_hashed_blocks:
            return
        tokens = seq.token_ids
        parent = seq.block_hashes[-1] if seq.block_hashes else chain_root(seq)
        for i in range(seq.num_hashed_blocks, full):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            h = chain_hash(parent, chunk)
            if h not in self.cached and h not in self.announced:
                self.announced[h] = id(seq)
                self._stored(h, None if i == 0 else parent, chunk, seq)
            parent = h

    def _withdraw(self, h: int) -> None:
        """An announced block that will not enter the cache: the router must forget it."""
        del self.announced[h]
        self._removed(h)

    def _stored(self, h: int, parent: int | None, chunk: tuple[int, ...], seq: Sequence) -> None:
        """Record a block entering the cache, in the last BlockStored when it continues that one's chain."""
        assert self.events is not None
        last = self.events[-1] if self.events else None
        lora_id, lora_name = (seq.lora.lora_int_id, seq.lora.lora_name) if seq.lora is not None else (None, None)
        if isinstance(last, BlockStored) and last.lora_id == lora_id and last.block_hashes[-1] == (
                None if parent is None else external_hash(parent)):
            last.block_hashes.append(external_hash(h))
            last.token_ids.extend(chunk)
            return
        self.events.append(BlockStored(block_hashes=[external_hash(h)], token_ids=list(chunk),
                                       parent_block_hash=None if parent is None else external_hash(parent),
                                       block_size=self.block_size, lora_id=lora_id, medium=MEDIUM_GPU,
                                       lora_name=lora_name))

    def record_events(self) -> None:
        """Keep the prefix cache's stores and evictions for :meth:`take_events` from now on."""
        if self.events is None:
            self.events = []

    def take_events(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        """The events recorded since the last call (none unless :meth:`record_events` was called)."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    # -- allocation -----------------------------------------------------------------------------

    def _take_free_block(self) -> Block:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict its cached content
            if self.cached.get(block.hash) is block:
                del self.cached[block.hash]
                if self.events is not None:
                    self._removed(block.hash)
            block.hash, block.parent_hash, block.token_ids = None, None, ()
        block.ref_count = 1
        return block

    def _removed(self, h: int) -> None:
        """Record an eviction, in the last BlockRemoved when evictions follow each other."""
        assert self.events is not None
        if self.events and isinstance(self.events[-1], BlockRemoved):
            self.events[-1].block_hashes.append(external_hash(h))
        else:
            self.events.append(BlockRemoved(block_hashes=[external_hash(h)], medium=MEDIUM_GPU))

    def allocate(
        self, seq: Sequence, num_new_tokens: int, cached_prefix: list[Block] | None = None, reserve_tokens: int = 0
    ) -> bool:
        """Make ``seq``'s block table cover its computed tokens plus ``num_new_tokens`` (or
        ``reserve_tokens`` if more). ``cached_prefix`` (from :meth:`find_cached_prefix`, for a
        sequence holding no blocks yet) is shared; the scheduler then counts it as computed. Returns False, changing
        nothing, when the pool cannot supply the blocks."""
        hits = cached_prefix or []
        computed = seq.num_computed_tokens + len(hits) * self.block_size
        target = max(computed + num_new_tokens, reserve_tokens)
        need = self.blocks_needed(target) - len(seq.block_table) - len(hits)
        reusable_free = sum(1 for b in hits if b.ref_count == 0)
        shared = self._shared_write_block(seq) if num_new_tokens else None
        if need + (shared is not None) > len(self.free_queue) - reusable_free:
            return False
        if self.window is not None:
            self.window.release_behind(seq)
            window_hits = self.window.hit_blocks([b.hash for b in hits if b.hash is not None]) if hits else []
            if not self.window.allocate(seq, target, bool(num_new_tokens), window_hits, len(hits) * self.block_size):
                return False
        if shared is not None:  # copy-on-write: the next token lands in a block a sibling also holds
            i = computed // self.block_size
            copy = self._take_free_block()
            self.blocks[shared].ref_count -= 1
            seq.block_table[i] = copy.block_id
            self.pending_copies.append((shared, copy.block_id))
        for block in hits:
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
            block.ref_count += 1
            seq.block_table.append(block.block_id)
            assert block.hash is not None  # a prefix-cache hit is a hashed block
            seq.block_hashes.append(block.hash)
        if hits:
            seq.num_hashed_blocks = len(hits)
        for _ in range(max(0, need)):
            seq.block_table.append(self._take_free_block().block_id)
        return True

    def _shared_write_block(self, seq: Sequence) -> int | None:
        """The block the sequence's next computed token goes into, if another sequence holds it too."""
        i = seq.num_computed_tokens // self.block_size
        if i < len(seq.block_table) and self.blocks[seq.block_table[i]].ref_count > 1:
            return seq.block_table[i]
        return None

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give ``child`` the parent's blocks (shared by reference count, copied on first write)."""
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        if self.window is not None:
            self.window.fork(parent, child)
        child.block_hashes = list(parent.block_hashes)
        child.num_hashed_blocks = parent.num_hashed_blocks

    def fork_reserved(self, parent: Sequence, children: list[Sequence], own_blocks: int) -> None:
        """Reserved allocation: the parent's table holds its ``own_blocks`` and then each child's share
        of the group's reservation. Each child shares the prompt's full blocks and takes its share, the
        first block of which gets a copy of the partly filled prompt block, so no child ever needs a
        block from the free queue (and nobody is preempted for one)."""
        full = parent.num_computed_tokens // self.block_size
        shares = parent.block_table[own_blocks:]
        del parent.block_table[own_blocks:]
        per_child = own_blocks - full
        for i, child in enumerate(children):
            share = shares[i * per_child:(i + 1) * per_child]
            for block_id in parent.block_table[:full]:
                self.blocks[block_id].ref_count += 1
            child.block_table = parent.block_table[:full] + share
            child.block_hashes = parent.block_hashes[:full]
            child.num_hashed_blocks = min(parent.num_hashed_blocks, full)
            if parent.num_computed_tokens % self.block_size:
                self.pending_copies.append((parent.block_table[full], share[0]))

    def reset_prefix_cache(self) -> None:
        """Empty the prefix cache (vLLM's ``reset_prefix_cache``) and record AllBlocksCleared: free blocks lose
        their content; blocks running sequences hold stay theirs, but no later request finds them."""
        for block in self.cached.values():
            block.hash, block.parent_hash, block.token_ids = None, None, ()
            if block.ref_count == 0:  # empty now: handed out before any block that still caches something
                self.free_queue.move_to_end(block.block_id, last=False)
        self.cached.clear()
        if self.window is not None:
            self.window.reset()
        self.announced.clear()  # the clear covers them; their commit announces them again
        if self.events is not None:
            self.events.append(AllBlocksCleared())

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write pairs queued since the last call, for the next forward pass."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def take_window_copies(self) -> list[tuple[int, int]]:
        """The window pool's copy-on-write pairs queued since the last call (none without one)."""
        return self.window.take_copies() if self.window is not None else []

    def commit(self, seq: Sequence) -> None:
        """After a step computed tokens of ``seq``: publish newly filled blocks to the prefix cache."""
        if self.enable_prefix_caching:
            hashed = seq.num_hashed_blocks
            self._register_full_blocks(seq, seq.num_computed_tokens)
            if self.window is not None and seq.num_hashed_blocks > hashed:
                self.window.register(seq, hashed, seq.num_hashed_blocks)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; unreferenced blocks join the free queue, tail blocks first in
        line for eviction so a shared prefix outlives the suffixes hanging off it. Blocks it announced and
        never computed are withdrawn."""
        if self.announced:
            for h in [h for h, owner in self.announced.items() if owner == id(seq)]:
                self._withdraw(h)
        self._release(seq.block_table)
        if self.window is not None:
            self.window.free(seq)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_hashed_blocks = 0

    def trim(self, seq: Sequence) -> None:
        """Return the blocks past ``seq``'s computed tokens: those allocated for drafts it rejected.
        They hold no accepted token, so none of them was published to the prefix cache."""
        keep = self.blocks_needed(seq.num_computed_tokens)
        if len(seq.block_table) > keep:
            self._release(seq.block_table[keep:])
            del seq.block_table[keep:]
        if self.window is not None:
            self.window.trim(seq)

    def _release(self, block_ids: list[int]) -> None:
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    # Uncached content is worthless: hand it out before any cached block.
                    self.free_queue[block_id] = None
                    self.free_queue.move_to_end(block_id, last=False)
                else:
                    self.free_queue[block_id] = None

    def block_states(self, batch: list[Sequence]) -> bytes:
        """One byte per block (the ``KV_*`` codes of :mod:`iterserve.engine.messages`): free, cached
        but evictable, shared, or held by one sequence, numbered by its place in ``batch`` (a step's
        rows) when it is there. Walks every block: the caller bounds how often."""
        states = bytearray(self.num_blocks)  # zeros: KV_FREE
        for block in self.blocks:
            if block.ref_count > 1:
                states[block.block_id] = KV_SHARED
            elif block.ref_count == 1:
                states[block.block_id] = KV_HELD
            elif block.hash is not None:
                states[block.block_id] = KV_CACHED
        for row, seq in enumerate(batch):
            code = min(KV_FIRST_ROW + row, 255)
            for block_id in seq.block_table:
                if states[block_id] == KV_HELD:
                    states[block_id] = code
        return bytes(states)

    def check_no_leaks(self) -> None:
        """Raise if any block is still referenced (call when no sequence is alive)."""
        held = [b.block_id for b in self.blocks if b.ref_count != 0]
        if held or len(self.free_queue) != self.num_blocks:
            raise AssertionError(f"KV blocks still referenced: {held[:16]}")
        if self.window is not None:
            self.window.check_no_leaks()

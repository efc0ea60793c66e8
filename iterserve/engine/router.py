"""Which data-parallel replica (engine core) runs a request: the one most likely to hold its prefix.

Each replica has its own KV pool and prefix cache, so a request sent where its prefix was computed
before skips that prefill. The router cannot see inside the cores; it keeps, per replica, the chain
hashes of the full prompt blocks it sent there (the block manager's own :func:`chain_hash` over the
same block size, so equal hashes mean equal whole prefixes), least recently used first and bounded
like the replica's pool. A request goes to the replica where the most work would be waiting after
it: the queued tokens (the prompt and the most tokens it may generate, of every request sent there and
not finished) less the tokens of this prompt's prefix recorded there, which it would not compute; ties
go to the fewest queued tokens, then to the lowest index. So a long shared prefix (a document, few-shot
examples) keeps its replica against a smaller imbalance, while a short one that most requests share (a
chat template's system prompt) cannot pull every request to the replica that saw it first.

The record is a guess, never a promise: a core may have evicted blocks the router still lists, and a
miss only costs the prefill that any other replica would have paid too.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass, field

from iterserve.engine.block_manager import chain_hash


def prompt_block_hashes(prompt: list[int], block_size: int, num_blocks: int) -> list[int]:
    """Chain hashes of the first ``num_blocks`` full blocks of ``prompt``, as the block manager computes them."""
    hashes: list[int] = []
    parent: int | None = None
    for i in range(num_blocks):
        parent = chain_hash(parent, tuple(prompt[i * block_size:(i + 1) * block_size]))
        hashes.append(parent)
    return hashes


@dataclass
class Replica:
    """What the router knows of one replica: the prefix blocks it sent there, and its queued tokens."""

    max_blocks: int
    blocks: OrderedDict[int, None] = field(default_factory=OrderedDict)  # chain hash, least recent first
    queued_tokens: int = 0
    num_routed: int = 0

    def matched_blocks(self, hashes: list[int]) -> int:
        """How many leading blocks of a prompt this replica was sent before (and may still cache)."""
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def remember(self, hashes: list[int]) -> None:
        """Record a prompt's blocks as the most recently used, dropping the least recent beyond the bound."""
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)


class Router:
    """The least work waiting once the cached prefix is counted off; one instance per API server.

    ``max_blocks`` bounds each replica's record (a replica's KV pool: it cannot cache more blocks).
    With prefix caching off only the load counts.
    """

    def __init__(self, num_replicas: int, block_size: int, max_blocks: int, prefix_caching: bool = True) -> None:
        if num_replicas < 1 or block_size < 1 or max_blocks < 1:
            raise ValueError("num_replicas, block_size and max_blocks must be >= 1")
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.replicas = [Replica(max_blocks) for _ in range(num_replicas)]
        self._inflight: dict[str, tuple[int, int]] = {}  # request id -> (replica, queued tokens)

    def route(self, request_id: str, prompt: list[int], max_new_tokens: int,
              exclude: Collection[int] = ()) -> int:
        """Pick the replica for a request, none of ``exclude`` (replicas restarting), and count it there until
        :meth:`finish`; returns its index."""
        if request_id in self._inflight:
            raise ValueError(f"request id {request_id!r} is already routed")
        candidates = [i for i in range(len(self.replicas)) if i not in exclude]
        if not candidates:
            raise ValueError("every replica is excluded")
        hashes: list[int] = []
        if len(candidates) == 1:
            index = candidates[0]
        else:
            if self.prefix_caching:  # every full block is cached after the prefill ...
                hashes = prompt_block_hashes(prompt, self.block_size, len(prompt) // self.block_size)
            usable = hashes[:(len(prompt) - 1) // self.block_size]  # ... but the last token is always computed
            saved = [rep.matched_blocks(usable) * self.block_size for rep in self.replicas]
            index = min(candidates, key=lambda i: (
                self.replicas[i].queued_tokens - saved[i], self.replicas[i].queued_tokens, i))
        replica = self.replicas[index]
        if hashes:
            replica.remember(hashes)
        tokens = len(prompt) + max_new_tokens
        replica.queued_tokens += tokens
        replica.num_routed += 1
        self._inflight[request_id] = (index, tokens)
        return index

    def forget(self, index: int) -> None:
        """Replica ``index`` lost its cache (its core restarted): nothing it was sent is cached there now."""
        self.replicas[index].blocks.clear()

    def replica_of(self, request_id: str) -> int | None:
        entry = self._inflight.get(request_id)
        return None if entry is None else entry[0]

    def finish(self, request_id: str) -> int | None:
        """The request left its replica (finished, aborted or failed); returns that replica, None if unknown."""
        entry = self._inflight.pop(request_id, None)
        if entry is None:
            return None
        index, tokens = entry
        self.replicas[index].queued_tokens -= tokens
        return index

    def requests_on(self, index: int) -> list[str]:
        """The requests routed to replica ``index`` and not finished."""
        return [rid for rid, (i, _) in self._inflight.items() if i == index]

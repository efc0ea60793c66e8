"""PagedAttention over a block-structured KV cache: the cache and each step's metadata (:mod:`.metadata`),
and the backends that write K/V and attend (:mod:`.backend`), one chosen per device by
:func:`~.selector.select_backend`, each carrying its device's op set (:mod:`iterserve.platforms.ops`)."""

from iterserve.attention.backend import AttentionBackend
from iterserve.attention.metadata import AttentionMetadata, KVCache
from iterserve.attention.selector import select_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "KVCache", "select_backend"]

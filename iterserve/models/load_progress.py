"""A per-tensor progress bar on stderr while weights load, as vLLM shows its checkpoint shards: a large model
takes minutes to load, and a silent terminal looks hung. It is drawn only where stderr is a terminal (never
into logs, pipes or tests) and not at all with ``--no-load-progress``; an update costs far less than reading
the tensor it counts."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")


def tensor_progress(tensors: Iterable[T], total: int | None, enabled: bool) -> Iterable[T]:
    """``tensors``, counted on stderr as they are taken when ``enabled`` and stderr is a terminal."""
    if not enabled or not sys.stderr.isatty():
        return tensors
    return tqdm(tensors, total=total, desc="Loading weights", unit="tensor", file=sys.stderr, mininterval=0.25)

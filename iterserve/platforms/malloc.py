"""Allocator tuning for CPU inference: applied by the ``iterserve`` command and by every CPU engine.

A step allocates the same large activations and gathered K/V every time; by default glibc serves
them with fresh mmaps and unmaps them on free, so every step pays page faults for tens of megabytes
(measured: a 256-sequence decode step took twice as long). Keeping freed memory in the heap makes
the allocations reuse warm pages, the effect TCMalloc has for other CPU inference servers.

The settings are glibc's own environment variables, :data:`MALLOC_ENV`. glibc reads them when a
process starts, so :func:`tune_allocator` applies them to the running process with ``mallopt`` and
leaves them in the environment for the processes it starts (the engine core). The CLI calls it once
at start-up and an engine on the CPU when it is built (so ``LLM`` users get it too); a program can
also start Python with the variables set (``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1073741824
python ...``). Values already in the environment win, so a user can choose others; nothing here runs
on import.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

logger = logging.getLogger(__name__)

# glibc variable -> (mallopt parameter number, value): never serve allocations with mmap, and trim
# the heap back to the OS only when more than 1 GiB lies free at its top
MALLOC_ENV = {"MALLOC_MMAP_MAX_": (-4, 0), "MALLOC_TRIM_THRESHOLD_": (-1, 1 << 30)}


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, found once (``find_library`` runs a subprocess); None where it cannot be loaded."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def tune_allocator() -> bool:
    """Keep freed memory in this process and in the processes it starts; False where libc is not glibc."""
    for name, (_, value) in MALLOC_ENV.items():
        os.environ.setdefault(name, str(value))
    libc = _libc()
    if libc is None:
        return False
    try:
        return all(bool(libc.mallopt(param, int(os.environ[name]))) for name, (param, _) in MALLOC_ENV.items())
    except (AttributeError, ValueError):  # not glibc, or a value that is not an integer
        logger.debug("mallopt unavailable; CPU steps will pay page faults on large buffers")
        return False


def release_free_heap() -> bool:
    """Hand the heap's free pages back to the OS (glibc's ``malloc_trim``): loading leaves freed float copies
    and per-tensor buffers behind, below the trim threshold above, which the steps would never reuse.
    False where libc is not glibc."""
    libc = _libc()
    try:
        return libc is not None and bool(libc.malloc_trim(0))
    except AttributeError:
        return False

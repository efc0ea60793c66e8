"""How much host memory there is, and how much is free: for KV-cache sizing and benchmark buffers.

psutil reads it on every OS (``/proc/meminfo``'s MemAvailable on Linux), where reading that file by hand
knew Linux alone."""

from __future__ import annotations

import psutil


def physical_memory_bytes() -> int:
    """Installed RAM."""
    return int(psutil.virtual_memory().total)


def available_memory_bytes() -> int:
    """RAM the kernel could hand out now without swapping (MemAvailable on Linux)."""
    return int(psutil.virtual_memory().available)

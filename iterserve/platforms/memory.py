"""How much host memory there is, and how much is free: for KV-cache sizing and benchmark buffers."""

from __future__ import annotations

import os


def physical_memory_bytes() -> int:
    """Installed RAM, 0 where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def available_memory_bytes() -> int:
    """RAM the kernel could hand out now (MemAvailable), else all of it."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return physical_memory_bytes()

"""The heap's free pages go back to the OS after a load or a burst, even with the engine's malloc tuning (no
mmap for large buffers, a 1 GiB trim threshold), which otherwise keeps them for the process's life."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHILD = """
import re
from iterserve.platforms.malloc import release_free_heap, tune_allocator

def rss_mb():
    return int(re.search(r"RssAnon:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) / 1024

tune_allocator()
base = rss_mb()
chunks = [bytearray(b"x" * (1 << 20)) for _ in range(300)]  # 300 MB from the heap, not mmap
del chunks[:-1]  # the last one stays: the freed ones lie below it and no trim at the heap's top reaches them
held = rss_mb()
assert release_free_heap()
print(base, held, rss_mb())
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc and /proc are Linux's")
def test_release_free_heap_returns_freed_pages():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout
    base, held, released = map(float, out.split())
    assert held - base > 250  # the tuned allocator kept the freed chunks
    assert released - base < 50

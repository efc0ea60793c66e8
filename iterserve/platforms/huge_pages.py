"""CPU tensors that a step streams whole, placed on 2 MiB pages where the kernel gives them.

A decode step reads every weight once and each sequence's K/V blocks once. On 4 KiB pages each of those
reads walks the page tables every 4 KiB; on 2 MiB pages the TLB covers them. Linux backs anonymous memory
with transparent huge pages where a program asks (``madvise``, the common setting; ``always`` needs no
asking and ``never`` ignores it), so these tensors live in a mapping of their own that asks
(docs/benchmarks-history.md has what it saves).
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor; one of at least a huge page starts on a huge-page boundary, its whole huge
    pages of memory that asked for them. The tensor keeps its mapping alive."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    # private: shared anonymous memory is shmem, which transparent huge pages leave alone by default; anonymous
    # memory comes zeroed; the spare page aligns the start
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(buf, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    # only whole huge pages ask: a tail on one would hold up to 2 MiB the tensor does not use
    buf.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    return raw[start:start + nbytes].view(dtype).view(shape)


def copy(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a contiguous tensor from :func:`empty`."""
    out = empty(t.shape, t.dtype)
    out.copy_(t)
    return out

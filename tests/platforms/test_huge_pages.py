import gc

import torch

from iterserve.platforms import huge_pages


def test_large_tensors_start_on_a_huge_page_and_come_zeroed():
    t = huge_pages.empty((3, 1 << 20), torch.bfloat16)  # 6 MiB
    assert t.shape == (3, 1 << 20) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert not t.any()


def test_small_tensors_are_plain_zeros():
    t = huge_pages.empty((4, 5), torch.float32)
    assert t.shape == (4, 5) and not t.any()


def test_copy_keeps_values_and_memory_outlives_the_mapping_object():
    src = torch.randn(700, 1024)  # 2.7 MiB
    out = huge_pages.copy(src)
    gc.collect()  # only the tensor holds the mapping now
    assert torch.equal(out, src)
    out.mul_(2)  # still writable memory of its own
    assert torch.equal(out, src * 2)


def mapping_of(ptr: int) -> dict[str, int]:
    """The kB fields of /proc/self/smaps for the mapping that holds address ``ptr``."""
    fields: dict[str, int] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(a, 16) for a in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and line.split()[-1] == "kB":
                fields[head.rstrip(":")] = int(line.split()[1])
    return fields


def resident_pages(start: int, end: int) -> int:
    """How many 4 KiB pages of [start, end) are in memory (bit 63 of their /proc/self/pagemap entries): exact
    where smaps would count a mapping the kernel merged with its neighbours."""
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(start // 4096 * 8)
        entries = f.read((end - start) // 4096 * 8)
    return sum(entries[i + 7] >> 7 for i in range(0, len(entries), 8))


def transparent_huge_pages() -> str:
    """The kernel's mode for anonymous memory: always, madvise or never ("" where it has none)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return ""


def test_a_tensor_gets_huge_pages_for_its_whole_ones_and_small_pages_past_them():
    """2.5 MiB: one huge page where the kernel gives them on asking, the last half MiB on small pages (not a
    second huge page of which three quarters would sit unused)."""
    t = huge_pages.empty((5, 1 << 18), torch.int16)
    t.fill_(1)
    whole = mapping_of(t.data_ptr())
    tail = t.data_ptr() + huge_pages.HUGE_PAGE
    mapped_end = t.untyped_storage().data_ptr() + t.untyped_storage().nbytes()
    # the half MiB written, no page past it up to the next huge-page boundary or the mapping's end
    assert resident_pages(tail, min(tail + huge_pages.HUGE_PAGE, mapped_end)) == 128
    if transparent_huge_pages() in ("always", "madvise"):
        assert whole["AnonHugePages"] == 2048

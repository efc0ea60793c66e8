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

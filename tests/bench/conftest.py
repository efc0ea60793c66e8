"""One intra-op thread for the bench tests: their tiny models' steps are too small to gain from
more, and on a machine shared with other test runs, competing thread pools slow them many-fold."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

"""One size parser for every size option: binary K/M/G/T, decimal KB/MB/GB/TB, a bare number is GiB."""

from __future__ import annotations

import pytest

from iterserve.config import EngineConfig, get_preset
from iterserve.config.units import parse_size
from iterserve.engine.capacity import Capacity

GiB = 2**30


@pytest.mark.parametrize("text,size", [
    ("80", 80 * GiB), ("2G", 2 * GiB), ("2g", 2 * GiB), ("2GiB", 2 * GiB), ("512MiB", 512 * 2**20),
    ("512M", 512 * 2**20), ("1.5GB", 1_500_000_000), ("85.9GB", int(85.9e9)), ("4096B", 4096), ("1TiB", 2**40),
    (" 3 KiB ", 3072), (1048576, 1048576),
])
def test_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["lots", "2 GiBs", "-1G", "0", "G", "", True])
def test_bad_sizes_say_what_is_accepted(bad):
    with pytest.raises(ValueError, match="memory size|must be positive|must be a size"):
        parse_size(bad)


def test_the_engine_reads_kv_cache_memory_with_it():
    model = get_preset("smollm2-135m")
    per_block = model.kv_bytes_per_token(4) * 16
    for text in ("1G", "1"):  # a bare number is GiB here too, not bytes
        capacity = Capacity.of(EngineConfig(kv_cache_memory=text, block_size=16, max_model_len=256), model, 4)
        assert capacity.num_blocks == GiB // per_block

"""dtype names, and ``auto`` choosing bf16 only where the hardware computes in it."""

from __future__ import annotations

import pytest
import torch

from iterserve import config
from iterserve.config import cpu_has_native_bf16, parse_dtype

AVX2_EPYC = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma f16c\n"
SAPPHIRE_RAPIDS = "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
GRAVITON3 = "Features\t: fp asimd sve bf16 i8mm\n"


def test_bf16_instructions_are_read_from_cpu_flags():
    assert not cpu_has_native_bf16(AVX2_EPYC)
    assert cpu_has_native_bf16(SAPPHIRE_RAPIDS)
    assert cpu_has_native_bf16(GRAVITON3)
    assert not cpu_has_native_bf16("model name\t: bf16 in a name is not a flag\n")


@pytest.mark.parametrize("native,expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_is_bf16_only_where_it_is_native(monkeypatch, native, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: native)
    assert parse_dtype("auto") == expected
    assert parse_dtype("AUTO") == expected


def test_named_dtypes_and_errors():
    assert parse_dtype("bf16") == torch.bfloat16 and parse_dtype("float32") == torch.float32
    assert parse_dtype(torch.float16) == torch.float16
    with pytest.raises(ValueError, match="choose one of auto"):
        parse_dtype("int4")

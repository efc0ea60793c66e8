"""The KV cache's storage dtype (``kv_cache_dtype``, spelled as vLLM spells it) and what a token costs in it.

``auto`` stores K/V in the model's dtype. ``fp8`` (= ``fp8_e4m3``) and ``fp8_e5m2`` store one float8 byte per
value with no scale (vLLM's default scale of 1.0: K/V of the models served here lie well inside fp8's range).
``int8`` stores one byte per value and one float16 scale per token and KV head (``amax / 127`` of the head's
row): a head of 64 values costs 66 bytes where bf16 costs 128. Per-row scales, not llama.cpp's q8_0 blocks of
32, because a block scale every 32 values costs 2 bytes per 32 (1.88x the tokens at head_dim 64, not 1.94x).

No torch here: the planner and the capacity arithmetic read it without loading torch.
"""

from __future__ import annotations

import typing
from typing import Literal

KVCacheDtype = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"]
KV_CACHE_DTYPES: tuple[str, ...] = typing.get_args(KVCacheDtype)
QUANTIZED_KV_DTYPES = ("fp8_e4m3", "fp8_e5m2", "int8")
INT8_SCALE_BYTES = 2  # one float16 scale per (token, KV head), for K and for V


def canonical_kv_cache_dtype(name: object) -> str:
    """``fp8`` -> ``fp8_e4m3``; anything not accepted raises ValueError listing what is."""
    key = str(name).lower()
    if key not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return "fp8_e4m3" if key == "fp8" else key


def kv_value_bytes(kv_cache_dtype: str, dtype_bytes: int) -> int:
    """Bytes per stored K or V value: the model dtype's under ``auto``, else one."""
    return dtype_bytes if canonical_kv_cache_dtype(kv_cache_dtype) == "auto" else 1


def kv_head_bytes(kv_cache_dtype: str, dtype_bytes: int, head_dim: int) -> int:
    """Bytes of one token's K (or V) of one KV head, its scale included."""
    scale = INT8_SCALE_BYTES if canonical_kv_cache_dtype(kv_cache_dtype) == "int8" else 0
    return head_dim * kv_value_bytes(kv_cache_dtype, dtype_bytes) + scale


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str,
                       dtype_bytes: int) -> int:
    """K and V of one token over all layers: layers x 2 x kv_heads x (head_dim x value bytes + scale bytes)."""
    return num_layers * 2 * num_kv_heads * kv_head_bytes(kv_cache_dtype, dtype_bytes, head_dim)

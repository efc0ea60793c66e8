"""The quantized KV cache's numbers in PyTorch: what a store writes and what a read gets back
(:mod:`iterserve.config.kv_cache` says what each ``kv_cache_dtype`` stores).

These are the ground truth the C++ kernels (``csrc/kv_quant_write.cpp``) match byte for byte on store: float8 by
torch's own round-to-nearest-even conversion after clamping to the format's finite range (an out-of-range
value would become NaN in e4m3fn, infinity in e5m2), int8 as ``round(x / scale)`` with ``scale`` the row's
``amax / 127`` rounded to float16 first, so that the scale stored is the scale divided by.
"""

from __future__ import annotations

import torch

FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
# a float16 scale never below this: an all-zero row divides by it, not by zero
MIN_INT8_SCALE = 2.0 ** -24


def storage_dtype(kv_cache_dtype: str) -> torch.dtype:
    """The torch dtype of a quantized cache's values (``kv_cache_dtype`` canonical, not ``auto``)."""
    return {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}[kv_cache_dtype]


def quantize(x: torch.Tensor, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` ``[..., head_dim]`` as stored: the values, and for int8 one float16 scale per row (``[...]``)."""
    xf = x.float()
    if kv_cache_dtype == "int8":
        scale = (xf.abs().amax(-1) / 127).to(torch.float16).clamp_min(MIN_INT8_SCALE)
        q = torch.round(xf / scale.float()[..., None]).clamp(-127, 127).to(torch.int8)
        return q, scale
    limit = FP8_MAX[kv_cache_dtype]
    return xf.clamp(-limit, limit).to(storage_dtype(kv_cache_dtype)), None


def dequantize(q: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows back in ``dtype``: float8 converts exactly (to bf16, fp16 or fp32); int8 is ``q * scale``
    in float32, rounded once to ``dtype``."""
    if scale is None:
        return q.to(dtype)
    return (q.float() * scale.float()[..., None]).to(dtype)


def gather_scales(scale: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The scales of a gathered cache's rows (:func:`iterserve.attention.reference.gather_rows`): ``[rows *
    block_size]`` from a ``[num_blocks, kv_heads, block_size]`` scale pool."""
    num_blocks, kv_heads, block_size = scale.shape
    return scale.view(num_blocks * kv_heads, block_size).index_select(0, rows).view(-1)

"""The one dtype table: the spellings users write, each dtype's storage size and its torch dtype.

torch is imported only by :func:`torch_dtype`, so the planner's arithmetic reads the table without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# canonical key -> (bytes per element, name of the torch dtype that stores it)
DTYPES: dict[str, tuple[int, str]] = {
    "fp32": (4, "float32"),
    "tf32": (4, "float32"),  # float32 storage; TF32 is a matmul mode of float32 tensors
    "fp16": (2, "float16"),
    "bf16": (2, "bfloat16"),
    "fp8": (1, "float8_e4m3fn"),
    "int8": (1, "int8"),
}

_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "f32": "fp32",
    "tensorfloat32": "tf32",
    "float16": "fp16",
    "half": "fp16",
    "f16": "fp16",
    "bfloat16": "bf16",
    "float8": "fp8",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
    "e4m3": "fp8",
    "e5m2": "fp8",
}


def canonical_dtype(name: object) -> str:
    """Normalise a dtype spelling ("bfloat16", "BF16", "torch.float16") to a key of :data:`DTYPES`."""
    key = str(name).lower().removeprefix("torch.").replace("-", "_")
    key = _ALIASES.get(key, key)
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return key


def dtype_bytes(name: object) -> int:
    """Bytes per element (fp32/tf32 4, fp16/bf16 2, fp8/int8 1)."""
    return DTYPES[canonical_dtype(name)][0]


def torch_dtype(name: object) -> torch.dtype:
    """The torch dtype that stores ``name`` (tf32 is stored as float32)."""
    import torch

    dtype: torch.dtype = getattr(torch, DTYPES[canonical_dtype(name)][1])
    return dtype

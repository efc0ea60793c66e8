"""The one dtype table: the spellings users write, each dtype's storage size and its torch dtype.

torch is imported only by :func:`torch_dtype`, :func:`parse_dtype` and :func:`bf16_runs_fast`, so the planner's
arithmetic reads the table without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from iterserve.platforms.cpu import cpu_has_native_bf16

# What weights may be kept in instead of a dtype (iterserve.quantization): a GGUF file's own blocks, or int8
# quantized at load. The engine's option and a draft model's both take these.
Quantization = Literal["gguf", "int8"]

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

# the dtypes the engine runs in
RUNNABLE_DTYPES = ("fp32", "bf16", "fp16")

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


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map a user-facing dtype name to a torch dtype, with a clear error for anything else.

    ``auto`` is bfloat16 where it runs at full speed (:func:`bf16_runs_fast`) and float32 elsewhere,
    where bf16 matmuls would only be emulated.
    """
    import torch

    if isinstance(dtype, torch.dtype):
        if dtype in {torch_dtype(key) for key in RUNNABLE_DTYPES}:
            return dtype
        raise ValueError(f"unsupported dtype {dtype}; choose one of auto, float32, bfloat16, float16")
    key = str(dtype).lower()
    if key == "auto":
        return torch.bfloat16 if bf16_runs_fast() else torch.float32
    try:
        canonical = canonical_dtype(key)
    except ValueError:
        canonical = None
    if canonical not in RUNNABLE_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, float32, bfloat16, float16")
    return torch_dtype(canonical)


def bf16_runs_fast() -> bool:
    """Whether bf16 runs at full speed here: on a CUDA device, on a CPU with bf16 instructions, and on any CPU
    the C++ kernels built for, whose matmuls widen bf16 weights to float32 as they load them (half the bytes
    of a float32 weight to stream, at float32's arithmetic). Not on PyTorch's reference path without bf16
    instructions, where ``F.linear`` emulates bf16 several times slower than float32 (docs/benchmarks.md)."""
    import torch

    from iterserve.platforms.ops import cpu_kernels

    return torch.cuda.is_available() or cpu_has_native_bf16() or cpu_kernels() is not None

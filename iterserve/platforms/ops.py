"""The op set: the one place that decides between the C++ CPU kernels and the PyTorch reference.

The fused operations around attention (RMSNorm with the residual add, RoPE, SiLU-and-multiply), the greedy
argmax, the linear kernels (the column-blocked dense matmul and LoRA's add) and the quantized matmuls are
looked up on an op set instead of asking whether the extension loaded. :class:`ReferenceOps` computes them in
plain PyTorch (the ground truth the kernels are tested against, and what runs on other devices, without a
build or with ``ITERSERVE_CPU_KERNELS=0``); :class:`CpuOps` calls :mod:`iterserve.kernels`' extension.
:func:`ops_for` picks one per device, from a choice made once, at import.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from iterserve import kernels


class ReferenceOps:
    """Every op in PyTorch, on any device."""

    name = "reference"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of the last dimension, normalised in float32 and cast back before the weight."""
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(dtype)

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual + x`` (the new residual stream) and its RMSNorm: ``(normed, new_residual)``."""
        residual = x + residual
        return self.rms_norm(residual, weight, eps), residual

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` and ``k`` rotated by RoPE (rotate-half convention); ``cos``/``sin`` are ``[tokens, 1, head_dim]``."""
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a ``[tokens, 2 * width]`` tensor holding ``[gate | up]``."""
        gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
        return F.silu(gate) * up

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits.argmax(dim=-1)``."""
        return logits.argmax(dim=-1)

    def keys_in_groups(self, dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
        """Whether the attention of this op set reads a K cache of this kind in key groups
        (:meth:`iterserve.attention.metadata.KVCache.allocate`); the reference reads rows."""
        return False

    def best_isa(self) -> int:
        """The widest quantized-matmul kernel built for this machine; 0: none."""
        return 0


class CpuOps(ReferenceOps):
    """The C++ kernels of ``csrc/`` on CPU tensors; ``extension`` is the loaded module, which the CPU attention
    backend and the native decode stack call too."""

    name = "cpu"

    def __init__(self, extension: ModuleType) -> None:
        self.extension = extension

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out: torch.Tensor = self.extension.rms_norm(x, weight, eps)
        return out

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        self.extension.fused_add_rms_norm(x, residual, weight, eps)  # in place on both: one pass over the activations
        return x, residual

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.extension.rope_(q, k, cos[:, 0], sin[:, 0])  # in place, one pass per row
        return q, k

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.extension.silu_and_mul(gate_up)
        return out

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        # the kernel takes contiguous float32 rows only; anything else keeps torch's argmax
        if logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[1] > 0 and logits.stride(1) == 1:
            out: torch.Tensor = self.extension.argmax_rows(logits)
            return out
        return super().argmax_rows(logits)

    def keys_in_groups(self, dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
        return bool(self.extension.keys_in_groups(dtype, head_dim, block_size))

    def best_isa(self) -> int:
        return int(self.extension.quant_best_isa())

    # -- linear kernels (csrc/linear.cpp) -------------------------------------------------------------------

    def pack_linear_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight [out, in]`` laid out in column blocks for :meth:`packed_linear`."""
        out: torch.Tensor = self.extension.pack_linear_weight(weight)
        return out

    def packed_linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None,
                      amx_min_rows: int, float_out: bool = False) -> torch.Tensor:
        """``x @ W^T (+ bias)`` with ``W`` from :meth:`pack_linear_weight`; in float32 with ``float_out``."""
        out: torch.Tensor = self.extension.packed_linear(x, packed, out_features, bias, amx_min_rows, float_out)
        return out

    def lora_add_(self, out: torch.Tensor, x: torch.Tensor, a: list[torch.Tensor | None], b: list[torch.Tensor],
                  parts: list[int], row_slots: torch.Tensor | None) -> torch.Tensor:
        """``out`` plus each row's adapter's ``x @ A^T @ B^T``, in place (A per slot and B's blocks column-blocked,
        four numbers per block in ``parts``: :class:`iterserve.lora.batch.PackedStack`)."""
        result: torch.Tensor = self.extension.lora_add_(out, x, a, b, parts, row_slots)
        return result

    # -- quantized matmuls (csrc/quant_ops.cpp) ----------------------------------------------------------------

    def qgemm(self, x: torch.Tensor, data: torch.Tensor, n: int, bits: int, isa: int,
              float_out: bool = False) -> torch.Tensor:
        """``x [rows, k] @ W^T`` for ``W`` in 4/8-bit quantized blocks; in float32 with ``float_out``."""
        out: torch.Tensor = self.extension.qgemm(x, data, n, bits, isa, float_out)
        return out

    def qrows(self, data: torch.Tensor, rows: torch.Tensor, n: int, k: int, bits: int,
              dtype: torch.dtype) -> torch.Tensor:
        """Rows ``rows`` of a weight in 4/8-bit quantized blocks, dequantized to ``dtype``."""
        out: torch.Tensor = self.extension.qrows(data, rows, n, k, bits, dtype)
        return out

    def kgemm(self, x: torch.Tensor, raws: list[torch.Tensor], type_ids: list[int], part_rows: list[int],
              isa: int, float_out: bool = False) -> torch.Tensor:
        """``x [rows, k] @ W^T`` for ``W`` in GGUF blocks as stored, one part per tensor of ``raws``; in float32
        with ``float_out``."""
        out: torch.Tensor = self.extension.kgemm(x, raws, type_ids, part_rows, isa, float_out)
        return out

    def krows(self, raw: torch.Tensor, type_id: int, rows: torch.Tensor, k: int, dtype: torch.dtype,
              part_rows: int) -> torch.Tensor:
        """Rows ``rows`` of one GGUF tensor as stored, dequantized to ``dtype``."""
        out: torch.Tensor = self.extension.krows(raw, type_id, rows, k, dtype, part_rows)
        return out

    def decoder_stack(self, num_heads: int, num_kv_heads: int, head_dim: int, eps: float, scale: float,
                      gemma: bool = False) -> Any:
        """An empty ``csrc/decoder.cpp`` ``DecoderStack`` in Llama's or Gemma 3's layer order
        (:func:`iterserve.models.native_decoder.build_stack` adds the layers)."""
        return self.extension.DecoderStack(num_heads, num_kv_heads, head_dim, eps, scale, gemma)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


REFERENCE = ReferenceOps()
CPU: ReferenceOps = CpuOps(kernels.ops) if kernels.ops is not None else REFERENCE
"""The op set of CPU tensors: the kernels where they loaded (:mod:`iterserve.kernels` says when), else the
reference."""


def ops_for(device: torch.device | str) -> ReferenceOps:
    """The op set of tensors on ``device``: :data:`CPU` on the CPU, the reference elsewhere."""
    return CPU if torch.device(device).type == "cpu" else REFERENCE


def ops_of(tensor: torch.Tensor) -> ReferenceOps:
    """The op set of ``tensor``'s device (:func:`ops_for` without building a device: one check per call)."""
    return CPU if tensor.is_cpu else REFERENCE


def cpu_kernels() -> CpuOps | None:
    """The C++ kernels' op set, None where they did not load (or are turned off)."""
    return CPU if isinstance(CPU, CpuOps) else None

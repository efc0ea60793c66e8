"""GGUF tensors kept exactly as the file stores them: the K-quants (Q2_K..Q6_K, super-blocks of 256 inputs),
the 5-bit Q5_0/Q5_1 and the non-linear 4-bit IQ4_NL/IQ4_XS (codes indexing a table of 16 int8 values), plus
Q4_0/Q4_1/Q8_0 when they share a fused layer with one of those.

A :class:`GGUFWeight` holds each part's raw bytes, row-major (``uint8 [rows, row bytes]``: a row is one output
column's blocks, as in the file), so its memory is the file's bytes. The C++ kernel (``csrc/kquant_ops.cpp``)
decodes 16 columns x 256 inputs at a time and multiplies them with the activations quantized to int8 per block
of 32; its row lookup gives gguf-py's dequantized values to the bit. A fused layer whose parts have different
types keeps one part per type run, all multiplied in one call.

The parts of linear layers (all types but Q4_0/Q4_1) are then "tiled" (:meth:`GGUFWeight.tiled`): per 16 rows
and block, the rows' dwords side by side, each block padded to whole dwords (Q6_K: 212 bytes, not 210; Q5_0: 24,
not 22), so the SIMD decoders load what they would otherwise gather from 16 rows. An untied embedding keeps the
rows; a tied one is tiled with its LM head, and its lookup reads a row back out of the tile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from iterserve.formats.gguf.types import STORED_TYPES, type_id
from iterserve.platforms import huge_pages
from iterserve.platforms.ops import CpuOps, ops_of

TILE = 16
# with a decoder that reads tiles
TILED_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "IQ4_XS")
# Where a tiled block's padding goes: after the 2-byte scale of Q5_0, Q8_0 and IQ4_NL (their codes then start on
# a dword), else at the end.
_PAD_AT = {"Q5_0": 2, "Q8_0": 2, "IQ4_NL": 2}


@dataclass
class GGUFPart:
    """Rows of one GGUF type: ``raw`` is ``uint8 [rows, k / block * bytes per block]``, or when ``tiled_rows``
    is set, that many rows tiled: ``uint8 [tiles, blocks, 16 * padded bytes per block]``."""

    raw: torch.Tensor
    type_name: str
    tiled_rows: int | None = None

    @property
    def rows(self) -> int:
        return int(self.raw.shape[0]) if self.tiled_rows is None else self.tiled_rows

    def tiled(self) -> GGUFPart:
        if self.tiled_rows is not None or self.type_name not in TILED_TYPES:
            return self
        n, nbytes = self.rows, STORED_TYPES[self.type_name][1]
        padded, tiles = -(-nbytes // 4) * 4, -(-n // TILE)
        blocks = self.raw.view(n, -1, nbytes)
        at = _PAD_AT.get(self.type_name, nbytes)
        pad = torch.zeros(n, blocks.shape[1], padded - nbytes, dtype=torch.uint8, device=blocks.device)
        blocks = F.pad(torch.cat([blocks[..., :at], pad, blocks[..., at:]], -1), (0, 0, 0, 0, 0, tiles * TILE - n))
        # [tile, row, block, dword, 4] -> [tile, block, dword, row, 4]
        tiled = blocks.view(tiles, TILE, -1, padded // 4, 4).permute(0, 2, 3, 1, 4)
        return GGUFPart(tiled.reshape(tiles, -1, padded * TILE).contiguous(), self.type_name, n)

    def untiled(self) -> GGUFPart:
        if self.tiled_rows is None:
            return self
        tiles, blocks, width = self.raw.shape
        padded, nbytes = width // TILE, STORED_TYPES[self.type_name][1]
        rows = self.raw.view(tiles, blocks, padded // 4, TILE, 4).permute(0, 3, 1, 2, 4)
        rows = rows.reshape(tiles * TILE, blocks, -1)[:self.rows]
        at = _PAD_AT.get(self.type_name, nbytes)
        rows = torch.cat([rows[..., :at], rows[..., at + padded - nbytes:]], -1)
        return GGUFPart(rows.reshape(self.rows, -1).contiguous(), self.type_name)


@dataclass
class GGUFWeight:
    """A ``[n, k]`` weight as GGUF blocks, in parts of rows stacked in order (one part unless fused)."""

    parts: list[GGUFPart]
    k: int
    type_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.type_ids = [type_id(p.type_name) for p in self.parts]

    @property
    def n(self) -> int:
        return sum(p.rows for p in self.parts)

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    @property
    def fmt(self) -> str:
        return "+".join(sorted({p.type_name for p in self.parts}))

    @property
    def nbytes(self) -> int:
        return sum(p.raw.numel() for p in self.parts)

    def _only(self) -> GGUFPart:
        if len(self.parts) != 1:
            raise ValueError(f"a fused {self.fmt} weight is sliced through its parts, not as one")
        return self.parts[0]

    def rows(self, index: torch.Tensor | slice) -> GGUFWeight:
        p = self._only()
        return GGUFWeight([GGUFPart(p.raw[index], p.type_name)], self.k)

    def columns(self, start: int, size: int) -> GGUFWeight:
        """Inputs ``[start, start + size)``: whole blocks only, a shard's columns under tensor parallelism."""
        p = self._only()
        block, nbytes = STORED_TYPES[p.type_name]
        if start % block or size % block:
            raise ValueError(f"{p.type_name} weights split only at multiples of {block} inputs, not [{start}, "
                             f"{start + size}) of {self.k}")
        raw = p.raw[:, start // block * nbytes:(start + size) // block * nbytes]
        return GGUFWeight([GGUFPart(raw, p.type_name)], size)

    def padded_rows(self, n: int) -> GGUFWeight:
        """``n`` rows, the ones past this weight's zero (all-zero bytes decode to zero weights)."""
        p = self._only()
        return GGUFWeight([GGUFPart(F.pad(p.raw, (0, 0, 0, n - p.rows)), p.type_name)], self.k)

    @staticmethod
    def cat(weights: list[GGUFWeight]) -> GGUFWeight:
        """Rows of several weights stacked (q, k, v or gate, up): runs of one type join into one part."""
        if len({w.k for w in weights}) != 1:
            raise ValueError(f"cannot stack weights of {sorted({w.k for w in weights})} inputs")
        parts: list[GGUFPart] = []
        for p in (p for w in weights for p in w.parts):
            if parts and parts[-1].type_name == p.type_name:
                parts[-1] = GGUFPart(torch.cat([parts[-1].raw, p.raw]), p.type_name)
            else:
                parts.append(p)
        return GGUFWeight(parts, weights[0].k)

    def tiled(self) -> GGUFWeight:
        """The parts of :data:`TILED_TYPES` tiled for the matmul (a linear layer's weight)."""
        return GGUFWeight([p.tiled() for p in self.parts], self.k)

    def to(self, device: torch.device | str) -> GGUFWeight:
        """On ``device``, each part one contiguous run (what the kernel reads); on the CPU a copy on huge pages,
        since a decode step streams it whole."""
        def place(raw: torch.Tensor) -> torch.Tensor:
            return huge_pages.copy(raw) if torch.device(device).type == "cpu" else raw.to(device).contiguous()

        return GGUFWeight([GGUFPart(place(p.raw), p.type_name, p.tiled_rows) for p in self.parts], self.k)


def from_stored(raw: np.ndarray, type_name: str, n: int, k: int) -> GGUFWeight:
    """A GGUF tensor's data (``raw``: its bytes, ``n`` rows of ``k`` weights) kept as stored (copied: the
    file's memory map is read-only)."""
    if type_name not in STORED_TYPES:
        raise ValueError(f"GGUF type {type_name} is not kept in blocks; kept types: {', '.join(STORED_TYPES)}")
    block, nbytes = STORED_TYPES[type_name]
    if k % block:
        raise ValueError(f"a {type_name} row of {k} weights is not a whole number of blocks of {block}")
    need = n * k // block * nbytes
    data = np.asarray(raw).reshape(-1).view(np.uint8)
    if data.size != need:
        raise ValueError(f"a [{n}, {k}] {type_name} tensor takes {need} bytes, the file holds {data.size}")
    return GGUFWeight([GGUFPart(torch.from_numpy(data.reshape(n, -1).copy()), type_name)], k)


def dequantize(w: GGUFWeight, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The float weight ``[n, k]``, or its ``rows`` (``[*rows.shape, k]``): gguf-py's values exactly."""
    if rows is not None and len(w.parts) == 1:
        p = w.parts[0]
        ops = ops_of(p.raw)
        if isinstance(ops, CpuOps):
            return ops.krows(p.raw, w.type_ids[0], rows, w.k, dtype, p.rows)
        p = p.untiled()
        return _dequantize_part(p, w.k, rows.reshape(-1).to(p.raw.device)).to(dtype).view(*rows.shape, w.k)
    full = torch.cat([_dequantize_part(p, w.k) for p in w.parts]).to(dtype)
    return full if rows is None else full[rows.to(full.device)]


def _dequantize_part(p: GGUFPart, k: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    p = p.untiled()
    raw = p.raw if rows is None else p.raw[rows]
    qtype = gguf.GGMLQuantizationType[p.type_name]
    values = gguf.quants.dequantize(raw.cpu().numpy(), qtype)
    return torch.from_numpy(np.ascontiguousarray(values).reshape(-1, k)).to(p.raw.device)


def linear(x: torch.Tensor, w: GGUFWeight, isa: int = 0, float_out: bool = False) -> torch.Tensor:
    """``x @ w.T`` for ``x [..., k]``: the C++ kernel on the CPU (``isa`` and ``float_out`` as in
    :func:`iterserve.quantization.packed.linear`), else dequantize then matmul."""
    ops = ops_of(x)
    if not isinstance(ops, CpuOps):
        return F.linear(x, dequantize(w, x.dtype))
    raws, ns = [p.raw for p in w.parts], [p.rows for p in w.parts]
    if x.dim() == 2 and x.stride(1) == 1:
        return ops.kgemm(x, raws, w.type_ids, ns, isa, float_out)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return ops.kgemm(rows, raws, w.type_ids, ns, isa, float_out).view(*x.shape[:-1], w.n)

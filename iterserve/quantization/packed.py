"""Weights kept in 4- or 8-bit blocks of 32 inputs, in the layout the CPU kernel streams.

Every supported format is one formula per output column and block of 32 inputs: ``w = d * q + c`` with
``q`` unsigned (a nibble for Q4_0/Q4_1, the int8 value + 128 for Q8_0 and int8), ``d`` and ``c`` float16.
GGUF's Q4_1 stores exactly ``d`` and ``c`` (its ``m``); Q4_0 is ``c = -8 d`` and the 8-bit formats
``c = -128 d``, all exact in float16. So one kernel (``csrc/quant_ops.cpp``) serves all of them.
Other GGUF types (Q5_0, Q5_1, the K-quants) stay in the file's own blocks: :mod:`gguf_weight`, which
:func:`linear` and :func:`dequantize` hand a :class:`GGUFWeight` to. A GGUF tensor's bytes become blocks in
:func:`iterserve.formats.gguf.tensors.from_gguf`.

Layout of :attr:`PackedWeight.data`, ``uint8 [tiles, blocks, bytes]``: output columns in tiles of 16; for
each tile and block, the 16 columns' quants in 64-byte chunks of 16 columns x 4 consecutive inputs (4-bit:
low nibbles inputs ``4j..4j+3``, high nibbles ``16+4j..16+4j+3`` of chunk ``j``), then the 16 ``d`` and the 16
``c``. A tile's block is one contiguous run, read once per matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from iterserve.platforms.ops import CpuOps, ops_for, ops_of
from iterserve.quantization import gguf_weight
from iterserve.quantization.gguf_weight import GGUFWeight

BLOCK = 32
TILE = 16


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PackedWeight:
    """A ``[n, k]`` weight in blocks; ``fmt`` names where it came from (``Q4_1``, ``Q8_0``, ``int8``...)."""

    data: torch.Tensor
    n: int
    k: int
    bits: int
    fmt: str

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    def to(self, device: torch.device | str) -> PackedWeight:
        return PackedWeight(self.data.to(device), self.n, self.k, self.bits, self.fmt)


# A weight the quantized linear method multiplies: repacked blocks of 32, or GGUF blocks as stored.
QuantizedWeight = PackedWeight | GGUFWeight


@dataclass
class BlockWeight:
    """A weight's blocks before packing: quants ``q`` (uint8 ``[n, k]``, below ``2**bits``), float16 ``d``
    and ``c`` (``[n, ceil(k / 32)]``). Rows and whole blocks of columns slice and join freely, which is
    what loading a fused or sharded layer needs; :func:`pack` lays it out for the kernel."""

    q: torch.Tensor
    d: torch.Tensor
    c: torch.Tensor
    bits: int
    fmt: str

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1]

    def rows(self, index: torch.Tensor | slice) -> BlockWeight:
        return BlockWeight(self.q[index], self.d[index], self.c[index], self.bits, self.fmt)

    def columns(self, start: int, size: int) -> BlockWeight:
        """Inputs ``[start, start + size)``: whole blocks only, a shard's columns under tensor parallelism."""
        k = self.shape[1]
        if start % BLOCK or (size % BLOCK and start + size != k):
            raise ValueError(f"{self.fmt} weights split only at multiples of {BLOCK} inputs, not [{start}, "
                             f"{start + size}) of {k}")
        b0, b1 = start // BLOCK, _ceil_div(start + size, BLOCK)
        return BlockWeight(self.q[:, start:start + size], self.d[:, b0:b1], self.c[:, b0:b1], self.bits, self.fmt)

    def padded_rows(self, n: int) -> BlockWeight:
        """``n`` rows, the ones past this weight's zero (a rank's padded slice of the vocabulary)."""
        extra = n - self.shape[0]
        return BlockWeight(F.pad(self.q, (0, 0, 0, extra)), F.pad(self.d, (0, 0, 0, extra)),
                           F.pad(self.c, (0, 0, 0, extra)), self.bits, self.fmt)

    @staticmethod
    def cat(parts: list[BlockWeight]) -> BlockWeight:
        """Rows of several weights of one bit width stacked (q, k, v or gate, up fused into one layer)."""
        if len({p.bits for p in parts}) != 1:
            raise ValueError(f"cannot fuse weights of different bit widths: {', '.join(p.fmt for p in parts)}")
        fmt = "+".join(sorted({p.fmt for p in parts}))
        return BlockWeight(torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]),
                           torch.cat([p.c for p in parts]), parts[0].bits, fmt)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return _dequantize(self.q, self.d, self.c, dtype)


def _dequantize(q: torch.Tensor, d: torch.Tensor, c: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    k, blocks = q.shape[-1], d.shape[-1]
    qf = F.pad(q.float(), (0, blocks * BLOCK - k)).unflatten(-1, (blocks, BLOCK))
    out = qf * d.float().unsqueeze(-1) + c.float().unsqueeze(-1)
    return out.flatten(-2)[..., :k].to(dtype)


def pack(w: BlockWeight) -> PackedWeight:
    """Lay out a weight's blocks for the kernel; the tails of ``n`` and ``k`` are padded with zero weights."""
    q, d, c, bits = w.q, w.d, w.c, w.bits
    n, k = q.shape
    blocks, tiles = _ceil_div(k, BLOCK), _ceil_div(n, TILE)
    if tuple(d.shape) != (n, blocks) or tuple(c.shape) != (n, blocks):
        raise ValueError(f"scales of shape {tuple(d.shape)} and {tuple(c.shape)} for a [{n}, {k}] weight, "
                         f"expected ({n}, {blocks})")
    q = F.pad(q.to(torch.uint8), (0, blocks * BLOCK - k, 0, tiles * TILE - n))
    if bits == 8:
        # [tile, col, block, chunk, 4] -> [tile, block, chunk, col, 4]
        quants = q.view(tiles, TILE, blocks, 8, 4).permute(0, 2, 3, 1, 4)
    elif bits == 4:
        # [tile, col, block, half, chunk, 4] -> [tile, block, chunk, col, 4, half]; the halves share a byte
        halves = q.view(tiles, TILE, blocks, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)
        quants = halves[..., 0] | (halves[..., 1] << 4)
    else:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    quants = quants.reshape(tiles, blocks, -1)

    def scales(s: torch.Tensor) -> torch.Tensor:
        s = F.pad(s.to(torch.float16), (0, 0, 0, tiles * TILE - n))
        return s.view(tiles, TILE, blocks).transpose(1, 2).contiguous().view(torch.uint8)

    data = torch.cat([quants, scales(d), scales(c)], dim=-1).contiguous()
    return PackedWeight(data, n, k, bits, w.fmt)


def unpack(w: PackedWeight, rows: torch.Tensor | None = None) -> BlockWeight:
    """The inverse of :func:`pack`; with ``rows``, only those rows (read from their tiles alone: an
    embedding lookup touches a few hundred bytes per token)."""
    tiles, blocks, nbytes = w.data.shape
    qbytes = nbytes - 4 * TILE
    if rows is None:
        rows = torch.arange(w.n, device=w.data.device)
    rows = rows.to(w.data.device).reshape(-1)
    data, col = w.data[rows // TILE], rows % TILE  # [r, blocks, bytes]: each row's tile
    r = torch.arange(rows.numel(), device=data.device)
    if w.bits == 8:
        q = data[..., :qbytes].reshape(-1, blocks, 8, TILE, 4)[r, :, :, col]  # [r, blocks, chunk, 4]
    else:
        byte = data[..., :qbytes].reshape(-1, blocks, 4, TILE, 4)[r, :, :, col]
        q = torch.stack([byte & 0x0F, byte >> 4], dim=2)  # [r, blocks, half, chunk, 4]
    q = q.reshape(-1, blocks * BLOCK)[:, :w.k]

    def scales(offset: int) -> torch.Tensor:
        s = data[..., offset:offset + 2 * TILE].contiguous().view(torch.float16)  # [r, blocks, 16]
        return s[r, :, col]

    return BlockWeight(q, scales(qbytes), scales(qbytes + 2 * TILE), w.bits, w.fmt)


def dequantize(w: QuantizedWeight, dtype: torch.dtype = torch.float32,
               rows: torch.Tensor | None = None) -> torch.Tensor:
    """The float weight ``[n, k]``, or its ``rows`` (``[*rows.shape, k]``: the C++ op on the CPU)."""
    if isinstance(w, GGUFWeight):
        return gguf_weight.dequantize(w, dtype, rows)
    ops = ops_of(w.data)
    if rows is not None and isinstance(ops, CpuOps):
        return ops.qrows(w.data, rows, w.n, w.k, w.bits, dtype)
    out = unpack(w, rows).dequantize(dtype)
    return out if rows is None else out.view(*rows.shape, w.k)


def quantize_int8(w: torch.Tensor) -> BlockWeight:
    """Symmetric int8 with one float16 scale per output column and block of 32 inputs (GGUF's Q8_0
    rounding: ``q = round(w / d)``, ``d = max|w| / 127``)."""
    n, k = w.shape
    blocks = _ceil_div(k, BLOCK)
    wb = F.pad(w.detach().float().cpu(), (0, blocks * BLOCK - k)).view(n, blocks, BLOCK)
    d = (wb.abs().amax(-1) / 127).to(torch.float16)
    inv = torch.where(d > 0, 1 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    q = (wb * inv.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int16) + 128
    return BlockWeight(q.flatten(1)[:, :k].to(torch.uint8), d, d * -128, 8, "int8")


# -- matmul --------------------------------------------------------------------------------------------


def linear(x: torch.Tensor, w: QuantizedWeight, isa: int = 0, float_out: bool = False) -> torch.Tensor:
    """``x @ w.T`` for ``x [..., k]``: the C++ kernel on the CPU, else dequantize then matmul (CUDA, or
    ``ITERSERVE_CPU_KERNELS=0``). ``isa`` forces one kernel (1 scalar, 2 AVX2, 3 AVX-512 VNNI; 0 the best);
    ``float_out`` returns the kernel's float32 sums unrounded (the LM head's logits).

    A decode step makes one call per linear layer (121 for SmolLM2) on a few rows, so the common case, 2-D
    rows on the CPU, goes straight to the op: a general path would cost more than the op itself."""
    if isinstance(w, GGUFWeight):
        return gguf_weight.linear(x, w, isa, float_out)
    ops = ops_of(x)
    if not isinstance(ops, CpuOps):
        return F.linear(x, dequantize(w, x.dtype))
    if x.dim() == 2 and x.stride(1) == 1:
        return ops.qgemm(x, w.data, w.n, w.bits, isa, float_out)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return ops.qgemm(rows, w.data, w.n, w.bits, isa, float_out).view(*x.shape[:-1], w.n)


def best_isa() -> int:
    """The widest kernel built for this machine (see :func:`linear`); 0 without the build."""
    return ops_for("cpu").best_isa()

"""Weights kept in 4- or 8-bit blocks of 32 inputs, in the layout the CPU kernel streams.

Every supported format is one formula per output column and block of 32 inputs: ``w = d * q + c`` with
``q`` unsigned (a nibble for Q4_0/Q4_1, the int8 value + 128 for Q8_0 and int8), ``d`` and ``c`` float16.
GGUF's Q4_1 stores exactly ``d`` and ``c`` (its ``m``); Q4_0 is ``c = -8 d`` and the 8-bit formats
``c = -128 d``, all exact in float16. So one kernel (``csrc/quant_ops.cpp``) serves all of them.

Layout of :attr:`PackedWeight.data`, ``uint8 [tiles, blocks, bytes]``: output columns in tiles of 16; for
each tile and block, the 16 columns' quants in 64-byte chunks of 16 columns x 4 consecutive inputs (4-bit:
low nibbles inputs ``4j..4j+3``, high nibbles ``16+4j..16+4j+3`` of chunk ``j``), then the 16 ``d`` and the 16
``c``. A tile's block is one contiguous run, read once per matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from iterserve import kernels

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


def pack(q: torch.Tensor, d: torch.Tensor, c: torch.Tensor, bits: int, fmt: str) -> PackedWeight:
    """Lay out quants ``q`` (uint8 ``[n, k]``, values below ``2**bits``) with float16 ``d``, ``c``
    (``[n, ceil(k / 32)]``); the tails of ``n`` and ``k`` are padded with zero weights."""
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
    return PackedWeight(data, n, k, bits, fmt)


def unpack(w: PackedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack`: ``q`` (uint8 ``[n, k]``), ``d`` and ``c`` (float16 ``[n, blocks]``)."""
    tiles, blocks, nbytes = w.data.shape
    qbytes = nbytes - 4 * TILE
    raw = w.data.cpu() if w.data.device.type != "cpu" else w.data
    quants = raw[..., :qbytes]
    if w.bits == 8:
        q = quants.reshape(tiles, blocks, 8, TILE, 4).permute(0, 3, 1, 2, 4)
    else:
        byte = quants.reshape(tiles, blocks, 4, TILE, 4)
        q = torch.stack([byte & 0x0F, byte >> 4], dim=-1).permute(0, 3, 1, 5, 2, 4)
    q = q.reshape(tiles * TILE, blocks * BLOCK)[:w.n, :w.k]

    def scales(offset: int) -> torch.Tensor:
        s = raw[..., offset:offset + 2 * TILE].contiguous().view(torch.float16)  # [tiles, blocks, 16]
        return s.transpose(1, 2).reshape(tiles * TILE, blocks)[:w.n]

    return q.to(w.data.device), scales(qbytes).to(w.data.device), scales(qbytes + 2 * TILE).to(w.data.device)


def dequantize(w: PackedWeight, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The float weight ``[n, k]`` (only ``rows`` of it when given: an embedding lookup)."""
    q, d, c = unpack(w)
    if rows is not None:
        q, d, c = q[rows], d[rows], c[rows]
    blocks = d.shape[-1]
    qf = F.pad(q.float(), (0, blocks * BLOCK - w.k)).unflatten(-1, (blocks, BLOCK))
    out = qf * d.float().unsqueeze(-1) + c.float().unsqueeze(-1)
    return out.flatten(-2)[..., :w.k].to(dtype)


# -- from GGUF blocks --------------------------------------------------------------------------------

# Bytes of one GGUF block of 32 weights and where its parts lie (see ggml's block_q4_0/q4_1/q8_0).
_GGUF_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
GGUF_PACKED_TYPES = tuple(_GGUF_BLOCK_BYTES)


def from_gguf(raw: np.ndarray, type_name: str, n: int, k: int) -> PackedWeight:
    """Repack a GGUF tensor's blocks (``raw``: its uint8 data, ``n`` rows of ``k`` weights) without loss."""
    if type_name not in _GGUF_BLOCK_BYTES:
        raise ValueError(f"GGUF type {type_name} is not kept in blocks; kept types: {', '.join(GGUF_PACKED_TYPES)}")
    if k % BLOCK:
        raise ValueError(f"a {type_name} row of {k} weights is not a whole number of blocks of {BLOCK}")
    blocks = k // BLOCK
    b = torch.from_numpy(np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, blocks, _GGUF_BLOCK_BYTES[type_name]))
    d = b[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
    if type_name == "Q8_0":
        q = (b[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        return pack(q.reshape(n, k), d, d * -128, 8, type_name)
    if type_name == "Q4_1":
        c, qs = b[..., 2:4].contiguous().view(torch.float16).squeeze(-1), b[..., 4:]
    else:
        c, qs = d * -8, b[..., 2:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # element i < 16 in the low nibble of byte i, i >= 16 high
    return pack(q.reshape(n, k), d, c, 4, type_name)


def quantize_int8(w: torch.Tensor) -> PackedWeight:
    """Symmetric int8 with one float16 scale per output column and block of 32 inputs (GGUF's Q8_0
    rounding: ``q = round(w / d)``, ``d = max|w| / 127``)."""
    n, k = w.shape
    blocks = _ceil_div(k, BLOCK)
    wb = F.pad(w.detach().float().cpu(), (0, blocks * BLOCK - k)).view(n, blocks, BLOCK)
    d = (wb.abs().amax(-1) / 127).to(torch.float16)
    inv = torch.where(d > 0, 1 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    q = (wb * inv.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int16) + 128
    return pack(q.flatten(1)[:, :k].to(torch.uint8), d, d * -128, 8, "int8").to(w.device)


# -- matmul --------------------------------------------------------------------------------------------


def kernel_available(x: torch.Tensor) -> bool:
    """Whether the C++ kernel serves ``x`` (built, not disabled, on the CPU)."""
    return kernels.ops_for(x) is not None


def linear(x: torch.Tensor, w: PackedWeight, isa: int = 0) -> torch.Tensor:
    """``x @ w.T`` for ``x [..., k]``: the C++ kernel on the CPU, else dequantize then matmul (CUDA, or
    ``ITERSERVE_CPU_KERNELS=0``). ``isa`` forces one kernel (1 scalar, 2 AVX2, 3 AVX-512 VNNI; 0 the best)."""
    if not kernel_available(x):
        return F.linear(x, dequantize(w, x.dtype))
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.ops.iterserve_quant.qgemm(rows, w.data, w.n, w.bits, isa)
    return out.view(*x.shape[:-1], w.n)


def best_isa() -> int:
    """The widest kernel built for this machine (see :func:`linear`); 0 without the build."""
    return int(torch.ops.iterserve_quant.best_isa()) if kernels.ops is not None else 0

"""Random but valid GGUF blocks of every type kept as stored: random bytes with small finite float16 scales,
so each type's full code range is exercised (gguf-py quantizes none of the K-quants)."""

from __future__ import annotations

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType
# Byte offsets of each type's float16 scales in a block, and the size of its largest |scale x code| product
# (a random weight then has values of about `scale`).
_HALVES = {Q.Q4_0: ([0], 8), Q.Q4_1: ([0, 2], 15), Q.Q5_0: ([0], 16), Q.Q5_1: ([0, 2], 31), Q.Q8_0: ([0], 127),
           Q.Q2_K: ([80, 82], 45), Q.Q3_K: ([108], 128), Q.Q4_K: ([0, 2], 945), Q.Q5_K: ([0, 2], 1953),
           Q.Q6_K: ([208], 4064), Q.IQ4_NL: ([0], 127), Q.IQ4_XS: ([0], 4064)}
STORED = [t.name for t in _HALVES]


def random_blocks(type_name: str, n: int, k: int, seed: int = 0, scale: float = 0.1) -> np.ndarray:
    """``uint8 [n, row bytes]``: the data of an ``[n, k]`` tensor of ``type_name``."""
    qtype = Q[type_name]
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // block, nbytes), dtype=np.uint8)
    offsets, largest = _HALVES[qtype]
    for at in offsets:
        halves = (rng.standard_normal((n, k // block)) * scale / largest * 4).astype(np.float16)
        raw[..., at:at + 2] = halves.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


def filled_blocks(type_name: str, n: int, k: int, fill: int) -> np.ndarray:
    """Like :func:`random_blocks`, every byte but the float16 scales ``fill``: each code and sub-block scale at one
    extreme (0xFF: all bits set; 0x80 / 0x7F: the largest signed bytes), the float16 scales 1 / the largest product."""
    qtype = Q[type_name]
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.full((n, k // block, nbytes), fill, dtype=np.uint8)
    offsets, largest = _HALVES[qtype]
    for at in offsets:
        raw[..., at:at + 2] = np.array([1 / largest], dtype=np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def reference(raw: np.ndarray, type_name: str) -> torch.Tensor:
    """gguf-py's dequantized values: the reference for the bit layout."""
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, Q[type_name])))

"""GGUF's tensor types as iterserve keeps them: which stay in their blocks, their block sizes and type ids, and
the byte layout of the three it repacks for its own block kernel."""

from __future__ import annotations

import gguf

# The types decoded from their stored blocks, with (inputs, bytes) per block.
STORED_TYPES: dict[str, tuple[int, int]] = {
    name: gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
}
KEPT_TYPES = tuple(STORED_TYPES)  # every type quantization="gguf" keeps quantized
FLOAT_TYPES = ("F32", "F16", "BF16")

# Bytes of one block of 32 weights of the types repacked into the block kernel's tiles (ggml's block_q4_0,
# block_q4_1, block_q8_0): a float16 scale d, Q4_1's float16 minimum m, then the quants.
REPACKED_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
REPACKED_TYPES = tuple(REPACKED_BLOCK_BYTES)


def type_id(type_name: str) -> int:
    """ggml's id of a type (what the C++ kernels switch on)."""
    return int(gguf.GGMLQuantizationType[type_name].value)

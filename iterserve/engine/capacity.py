"""What the KV pool holds: sized once, from the engine's config and the model's shape."""

from __future__ import annotations

from dataclasses import dataclass

from iterserve.config import EngineConfig, ModelConfig, parse_dtype
from iterserve.config.kv_cache import kv_bytes_per_token
from iterserve.config.units import parse_size


def token_bytes(model_config: ModelConfig, kv_cache_dtype: str, dtype_bytes: int) -> int:
    """One token's K and V over all layers of ``model_config``, as the pool stores them."""
    c = model_config
    return kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, kv_cache_dtype, dtype_bytes)


@dataclass(frozen=True)
class Capacity:
    """What the KV pool holds; a pure function of the config and the model's shape."""

    kv_bytes_per_token: int
    num_blocks: int
    block_size: int
    total_tokens: int
    max_model_len: int
    max_full_length_seqs: int

    @classmethod
    def of(cls, config: EngineConfig, model_config: ModelConfig, dtype_bytes: int | None = None,
           draft: ModelConfig | None = None) -> Capacity:
        """Raises ValueError when the pool cannot hold one block or one max_model_len sequence.

        Under tensor parallelism the pool is one rank's: ``kv_cache_memory`` is per rank, and a rank's
        token holds only its KV heads, so the same memory holds more tokens. A speculative ``draft``
        model keeps its K/V in the same blocks, so a token costs both models' bytes. A quantized
        ``kv_cache_dtype`` costs one byte per value, int8 a float16 scale per token and KV head too.
        """
        bs = config.block_size
        shard = model_config.tensor_parallel_shard(config.tensor_parallel_size)
        itemsize = dtype_bytes or parse_dtype(config.dtype).itemsize
        per_token = token_bytes(shard, config.kv_cache_dtype, itemsize) + (
            token_bytes(draft, config.kv_cache_dtype, itemsize) if draft else 0)
        num_blocks = config.num_kv_blocks or parse_size(config.kv_cache_memory) // (bs * per_token)
        if num_blocks < 1:
            raise ValueError(f"KV cache memory {config.kv_cache_memory!r} does not hold a single block of {bs} tokens")
        capacity = num_blocks * bs
        context = min(model_config.max_position_embeddings,
                      draft.max_position_embeddings if draft else model_config.max_position_embeddings)
        max_len = config.max_model_len or min(context, capacity)
        if max_len > context:
            raise ValueError(f"max_model_len {max_len} exceeds the model's maximum context ({context})")
        if max_len > capacity:
            raise ValueError(
                f"max_model_len {max_len} needs more KV cache than the pool holds ({capacity} tokens in "
                f"{num_blocks} blocks); raise kv_cache_memory/num_kv_blocks or lower max_model_len"
            )
        return cls(per_token, num_blocks, bs, capacity, max_len, capacity // max_len)

"""What the KV pool holds: sized once, from the engine's config and the model's shape."""

from __future__ import annotations

import math
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

    kv_bytes_per_token: int  # of the full pool: every layer's, or with a window pool the full layers' alone
    num_blocks: int
    block_size: int
    total_tokens: int
    max_model_len: int
    max_full_length_seqs: int
    window_blocks: int = 0  # the sliding-window layers' own pool, null block included (0: no such pool)
    window_bytes_per_token: int = 0

    @property
    def kv_blocks(self) -> int:
        """The blocks that hold every layer's K/V: the full pool's, or the window pool's where every layer is
        windowed (the full pool's blocks then only number a sequence's tokens)."""
        return self.num_blocks if self.kv_bytes_per_token else self.window_blocks - 1

    @property
    def memory_bytes(self) -> int:
        """What both pools hold, the window pool's null block included."""
        return self.block_size * (self.num_blocks * self.kv_bytes_per_token
                                  + self.window_blocks * self.window_bytes_per_token)

    @classmethod
    def of(cls, config: EngineConfig, model_config: ModelConfig, dtype_bytes: int | None = None,
           draft: ModelConfig | None = None) -> Capacity:
        """Raises ValueError when the pool cannot hold one block or one max_model_len sequence.

        Under tensor parallelism the pool is one rank's: ``kv_cache_memory`` is per rank, and a rank's
        token holds only its KV heads, so the same memory holds more tokens. A speculative ``draft``
        model keeps its K/V in the same blocks, so a token costs both models' bytes. A quantized
        ``kv_cache_dtype`` costs one byte per value, int8 a float16 scale per token and KV head too.
        A model whose layers mix sliding-window and full attention (hybrid SWA memory) splits the memory
        between the full layers' pool and the windowed layers' (:func:`window_pool_blocks`).
        """
        bs = config.block_size
        shard = model_config.tensor_parallel_shard(config.tensor_parallel_size)
        itemsize = dtype_bytes or parse_dtype(config.dtype).itemsize
        layer_bytes = token_bytes(shard, config.kv_cache_dtype, itemsize) // shard.num_layers
        draft_bytes = token_bytes(draft, config.kv_cache_dtype, itemsize) if draft else 0
        windowed = sum(w is not None for w in shard.layer_windows()) if uses_window_pool(config, model_config) else 0
        per_token = layer_bytes * (shard.num_layers - windowed) + draft_bytes
        memory = parse_size(config.kv_cache_memory)
        if windowed and not per_token:
            return cls.windows_only(config, model_config, memory, layer_bytes * windowed)
        window_blocks = window_pool_blocks(config, model_config, memory, per_token, layer_bytes * windowed) \
            if windowed else 0
        num_blocks = config.num_kv_blocks or (memory - window_blocks * bs * layer_bytes * windowed) // (bs * per_token)
        if num_blocks < 1 and window_blocks:
            raise ValueError(f"KV cache memory {config.kv_cache_memory!r} does not hold the sliding-window layers' "
                             f"{window_blocks - 1} blocks one sequence needs (a window and a step's chunk) and a "
                             f"block of the full layers; raise kv_cache_memory, lower max_num_batched_tokens or "
                             f"turn hybrid_swa_memory off")
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
        return cls(per_token, num_blocks, bs, capacity, max_len, capacity // max_len, window_blocks,
                   layer_bytes * windowed)

    @classmethod
    def windows_only(cls, config: EngineConfig, model_config: ModelConfig, memory: int, window_bytes: int) -> Capacity:
        """Every layer attends to the same sliding window (Mistral v0.1, Phi-3-mini-4k): the window pool holds all
        the K/V (``num_kv_blocks`` blocks where given) and a sequence holds a window of it however long it grows.
        The full pool's blocks hold no memory; they number the sequences' blocks for the prefix cache, as many as
        the window pool's sequences can number at ``max_model_len``."""
        bs, window = config.block_size, model_config.sliding_window
        assert window is not None
        context = model_config.max_position_embeddings
        max_len = config.max_model_len or context
        if max_len > context:
            raise ValueError(f"max_model_len {max_len} exceeds the model's maximum context ({context})")
        blocks = config.num_kv_blocks or memory // (bs * window_bytes)
        alone = one_sequence_blocks(config, window, max_len)
        if blocks < alone:
            raise ValueError(f"the KV pool holds {blocks} blocks of {bs} tokens where one sequence needs {alone} (its "
                             f"{window}-token window and a step's chunk); raise kv_cache_memory/num_kv_blocks or lower "
                             f"max_num_batched_tokens")
        per_seq = min(-(-max_len // bs), -(-window // bs) + 1)  # a max_model_len sequence's blocks in the window
        full = max(blocks, -(-blocks * -(-max_len // bs) // per_seq))
        return cls(0, full, bs, full * bs, max_len, blocks // per_seq, blocks + 1, window_bytes)


def uses_window_pool(config: EngineConfig, model_config: ModelConfig) -> bool:
    """Hybrid SWA memory: on unless turned off, for a model with sliding-window layers whose window is shorter than
    its sequences can grow, with blocks allocated as tokens arrive (a reservation holds a sequence's whole length
    anyway)."""
    window = model_config.sliding_window
    longest = config.max_model_len or model_config.max_position_embeddings
    return (config.hybrid_swa_memory and config.kv_allocation == "paged" and window is not None and window < longest
            and any(w is not None for w in model_config.layer_windows()))


def one_sequence_blocks(config: EngineConfig, window: int, max_len: int) -> int:
    """The window pool's blocks one sequence of up to ``max_len`` tokens needs to progress alone: its window and a
    step's chunk."""
    chunk = min(config.max_num_batched_tokens, max_len)
    return min(-(-(window - 1 + chunk) // config.block_size) + 2, -(-max_len // config.block_size))


def window_pool_blocks(config: EngineConfig, model_config: ModelConfig, memory: int, full_bytes: int,
                       window_bytes: int) -> int:
    """Blocks of the windowed layers' pool (the null block included): ``swa_full_tokens_ratio`` tokens per
    token of the full pool, as SGLang splits it, but no more than ``max_num_seqs`` sequences' windows and a
    step's tokens can use, and no fewer than one sequence needs (a window and a step's chunk) to progress alone,
    unless the full pool holds fewer (a sequence never holds more blocks in the window pool than in the full one).
    ``full_bytes`` and ``window_bytes`` are a token's bytes in each pool."""
    bs, window = config.block_size, model_config.sliding_window
    assert window is not None
    used = config.max_num_seqs * (-(-window // bs) + 2) + -(-config.max_num_batched_tokens // bs)
    alone = one_sequence_blocks(config, window, config.max_model_len or model_config.max_position_embeddings)
    if config.num_kv_blocks:
        full = config.num_kv_blocks
    else:
        full = int(memory // (bs * (full_bytes + config.swa_full_tokens_ratio * window_bytes)))
    return min(full, max(alone, min(used, math.ceil(config.swa_full_tokens_ratio * full)))) + 1

"""How the KV memory splits between the full layers' pool and the sliding-window layers' (hybrid SWA memory)."""

from __future__ import annotations

import pytest

from iterserve.config import EngineConfig, ModelConfig, get_preset
from iterserve.config.units import parse_size
from iterserve.engine.capacity import Capacity

GEMMA3_1B = ModelConfig.from_hf_config({  # its hub config: 22 layers in a 512-token window, 4 global ones
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
    "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 256, "vocab_size": 262144, "sliding_window": 512, "sliding_window_pattern": 6, "rope_scaling": None,
    "rope_local_base_freq": 10000, "rope_theta": 1000000, "max_position_embeddings": 32768,
    "final_logit_softcapping": None, "attn_logit_softcapping": None, "query_pre_attn_scalar": 256})


@pytest.mark.parametrize(("max_num_seqs", "gain"), [(256, 1.15), (16, 5.0)])
def test_the_window_pool_leaves_the_full_layers_more_tokens_in_the_same_memory(max_num_seqs, gain):
    settings = {"kv_cache_memory": "2GiB", "max_model_len": 8192, "max_num_seqs": max_num_seqs}
    one = Capacity.of(EngineConfig(**settings, hybrid_swa_memory=False), GEMMA3_1B, 2)
    two = Capacity.of(EngineConfig(**settings), GEMMA3_1B, 2)
    assert one.window_blocks == 0 and one.kv_bytes_per_token == 26 * 2 * 256 * 2
    assert two.kv_bytes_per_token == 4 * 2 * 256 * 2 and two.window_bytes_per_token == 22 * 2 * 256 * 2
    assert two.total_tokens >= gain * one.total_tokens
    assert parse_size("2GiB") - 16 * two.kv_bytes_per_token < two.memory_bytes <= parse_size("2GiB")
    # the windowed layers' pool: 0.8 tokens per full-pool token, or every sequence's window and a step's chunk
    windows = max_num_seqs * (512 // 16 + 2) + 2048 // 16
    share = (two.window_blocks - 1) / two.num_blocks
    assert (0.8 <= share <= 0.81) if max_num_seqs == 256 else two.window_blocks - 1 == windows


def test_a_tiny_full_pool_caps_the_window_pool_and_a_tiny_ratio_keeps_room_for_one_sequence():
    tiny = Capacity.of(EngineConfig(num_kv_blocks=40, max_model_len=640), GEMMA3_1B, 2)
    assert tiny.window_blocks - 1 == 40  # a sequence never holds more window blocks than full ones
    lean = Capacity.of(EngineConfig(num_kv_blocks=4000, swa_full_tokens_ratio=0.01), GEMMA3_1B, 2)
    assert lean.window_blocks - 1 == -(-(511 + 2048) // 16) + 2  # a window and a whole step's chunk


def test_one_pool_for_models_without_mixed_windows_or_with_reserved_blocks():
    for model in (get_preset("smollm2-135m"), get_preset("mistral-7b")):  # no window, and the same one everywhere
        assert Capacity.of(EngineConfig(max_model_len=2048), model, 2).window_blocks == 0
    reserved = Capacity.of(EngineConfig(max_model_len=2048, kv_allocation="reserved"), GEMMA3_1B, 2)
    assert reserved.window_blocks == 0 and reserved.kv_bytes_per_token == 26 * 1024


def test_a_window_on_every_layer_puts_all_the_memory_in_the_window_pool():
    """Mistral 7B v0.1 (a 4,096-token window on all 32 layers) at its 32,768-token context in 2 GiB: one pool holds
    16,384 tokens, less than one such sequence; the window pool holds a window of each and fits three."""
    mistral = get_preset("mistral-7b")
    with pytest.raises(ValueError, match="max_model_len 32768 needs more KV cache"):
        Capacity.of(EngineConfig(max_model_len=32768, hybrid_swa_memory=False), mistral, 2)
    c = Capacity.of(EngineConfig(), mistral, 2)
    assert c.kv_bytes_per_token == 0 and c.window_bytes_per_token == 32 * 2 * 8 * 128 * 2
    assert c.window_blocks - 1 == parse_size("2GiB") // (16 * c.window_bytes_per_token) == 1024
    assert c.max_model_len == 32768 and c.max_full_length_seqs == 1024 // (4096 // 16 + 1) == 3
    # the full pool's blocks hold nothing: enough to number the window pool's sequences at full length
    assert c.num_blocks * 16 >= 3 * 32768 and c.kv_blocks == 1024
    assert c.memory_bytes == 1025 * 16 * c.window_bytes_per_token  # 2 GiB and the null block
    assert Capacity.of(EngineConfig(num_kv_blocks=600, max_model_len=8192), mistral, 2).window_blocks == 601
    with pytest.raises(ValueError, match="one sequence needs 386"):  # its window and a 2,048-token chunk
        Capacity.of(EngineConfig(num_kv_blocks=300), mistral, 2)


def test_the_ratio_is_checked():
    for bad in (0, 1.5, "half", True):
        with pytest.raises(ValueError, match="swa_full_tokens_ratio"):
            EngineConfig(swa_full_tokens_ratio=bad)

"""Sliding-window layers in the roofline: a decoding query reads and multiplies only its window's keys there."""

from __future__ import annotations

from iterserve.config import get_preset
from iterserve.planner.hardware import get_accelerator
from iterserve.planner.roofline import (
    attended_keys,
    attention_flops_per_token,
    decode_cost,
    kv_bytes_per_token,
    kv_capacity,
    prefill_cost,
)
from tests.engine.test_capacity import GEMMA3_1B


def test_a_gemma3_query_reads_four_whole_contexts_and_twenty_two_windows():
    assert attended_keys(GEMMA3_1B, 300) == 26 * 300  # within the window every layer sees every key
    assert attended_keys(GEMMA3_1B, 8192) == 4 * 8192 + 22 * 512
    per_layer = kv_bytes_per_token(GEMMA3_1B, "bf16") // 26
    assert per_layer == 2 * 256 * 2
    longer = decode_cost(GEMMA3_1B, 8, 8192).bytes - decode_cost(GEMMA3_1B, 8, 4096).bytes
    assert longer == 8 * 4 * 4096 * per_layer  # past the window only the global layers' reads grow
    assert attention_flops_per_token(GEMMA3_1B, 8192) == 4 * 4 * 256 * (4 * 8192 + 22 * 512)


def test_a_model_without_windows_attends_every_key_in_every_layer():
    smol = get_preset("smollm2-135m")
    assert attention_flops_per_token(smol, 1000) == 4 * smol.num_layers * smol.num_heads * smol.head_dim * 1000
    assert decode_cost(smol, 1, 1000).bytes - decode_cost(smol, 1, 999).bytes == kv_bytes_per_token(smol)


def test_prefill_pairs_stop_growing_quadratically_past_the_window():
    mistral = get_preset("mistral-7b")  # a 4,096-token window on every layer
    n, w = 8192, 4096
    pairs = w * (w + 1) // 2 + (n - w) * w
    flops = prefill_cost(mistral, n).flops - prefill_cost(mistral.replace(sliding_window=None), n).flops
    assert flops == 4 * mistral.num_layers * mistral.num_heads * mistral.head_dim * (pairs - n * (n + 1) // 2)


def test_gemma3_sequences_hold_a_window_of_blocks_in_its_local_layers():
    plan = kv_capacity(GEMMA3_1B, get_accelerator("L4"), 8192)
    blocks_per_layer = 4 * 512 + 22 * (512 // 16 + 1)  # 512 blocks in a global layer, the window's 33 in a local one
    assert plan.max_seqs == plan.kv_blocks * 26 // blocks_per_layer > 4 * plan.kv_tokens // 8192
    assert kv_capacity(GEMMA3_1B, get_accelerator("L4"), 512).max_seqs == plan.kv_tokens // 512  # within the window

"""The engine with a quantized KV cache (kv_cache_dtype fp8, fp8_e5m2, int8): greedy tokens do not depend on
the batching, the chunking, prefix caching, forks or speculation; no block leaks; the same memory holds about
twice the tokens; an unknown kind is refused with the accepted ones."""

from __future__ import annotations

import argparse

import pytest

from iterserve import LLM, SamplingParams
from iterserve.cli.flags import add_config_args
from iterserve.config import EngineConfig, get_preset
from iterserve.engine.capacity import Capacity
from iterserve.models.loader import load_model
from tests.conftest import CHAT_PROMPTS

KINDS = ["fp8", "fp8_e5m2", "int8"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def caches_of(llm: LLM) -> list:
    return llm.engine.core.executor.worker.runner.kv_caches


@pytest.fixture(scope="module")
def chat_ids(smollm) -> list[list[int]]:
    tok = smollm.tokenizer
    return [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True), add_special_tokens=False)
            for c in CHAT_PROMPTS[:4]]


@pytest.mark.slow  # three engines on the real model, per kind
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_do_not_depend_on_batching_or_chunking(smollm, chat_ids, kind):
    prompts = chat_ids
    greedy = SamplingParams(temperature=0, max_tokens=12)
    batched = LLM(loaded=smollm, kv_cache_dtype=kind, num_kv_blocks=128)
    cache = caches_of(batched)[0]
    assert cache.quantized and cache.k.element_size() == 1 and (cache.k_scale is not None) == (kind == "int8")
    together = tokens(batched.generate(prompts, greedy))
    alone = [tokens(batched.generate([p], greedy))[0] for p in prompts]
    chunked = LLM(loaded=smollm, kv_cache_dtype=kind, num_kv_blocks=128, max_num_batched_tokens=16)
    assert together == alone == tokens(chunked.generate(prompts, greedy))
    batched.engine.block_manager.check_no_leaks()
    chunked.engine.block_manager.check_no_leaks()


@pytest.fixture(scope="module")
def tiny_loaded():
    return load_model("random:smollm2-135m?num_layers=2", dtype="float32", device="cpu", seed=0)


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_hits_forks_and_speculation_keep_greedy_tokens_and_free_every_block(tiny_loaded, kind):
    shared = list(range(100, 140))  # 2.5 blocks of 16: forks copy the partial block on write
    prompts = [shared + [7, 8, 9], shared + [11, 12]]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    plain = LLM(loaded=tiny_loaded, kv_cache_dtype=kind, num_kv_blocks=64, enable_prefix_caching=False)
    expected = tokens(plain.generate(prompts, greedy))
    assert [tokens(plain.generate([p], greedy))[0] for p in prompts] == expected  # alone == in a batch
    chunked = LLM(loaded=tiny_loaded, kv_cache_dtype=kind, num_kv_blocks=64, max_num_batched_tokens=16)
    assert tokens(chunked.generate(prompts, greedy)) == expected
    cached = LLM(loaded=tiny_loaded, kv_cache_dtype=kind, num_kv_blocks=64)
    first = cached.generate(prompts[:1], greedy)
    rest = cached.generate(prompts[1:], greedy)
    assert tokens(first + rest) == expected and rest[0].num_cached_tokens == 32
    forked = cached.generate(prompts[:1], SamplingParams(n=3, temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert [c.token_ids for c in forked.outputs] == [expected[0]] * 3  # copied blocks carry their scales
    spec = LLM(loaded=tiny_loaded, kv_cache_dtype=kind, num_kv_blocks=64, speculative_config=NGRAM)
    assert tokens(spec.generate(prompts, greedy)) == expected
    for llm in (plain, chunked, cached, spec):
        llm.engine.block_manager.check_no_leaks()
        assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("kind", KINDS)
def test_preemption_with_a_quantized_cache_keeps_greedy_tokens(tiny_loaded, kind):
    prompts = [list(range(10 + i, 40 + i)) for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    roomy = LLM(loaded=tiny_loaded, kv_cache_dtype=kind, num_kv_blocks=64)
    tight = LLM(loaded=tiny_loaded, kv_cache_dtype=kind, num_kv_blocks=8, block_size=16, max_model_len=64)
    assert tokens(tight.generate(prompts, greedy)) == tokens(roomy.generate(prompts, greedy))
    assert tight.engine.num_preemptions > 0
    tight.engine.block_manager.check_no_leaks()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("preset", ["smollm2-135m", "llama-3.1-8b"])
def test_the_same_memory_holds_about_twice_the_tokens(kind, preset):
    model = get_preset(preset)
    bf16 = Capacity.of(EngineConfig(kv_cache_memory="1GiB", max_model_len=2048), model, 2)
    quantized = Capacity.of(EngineConfig(kv_cache_memory="1GiB", max_model_len=2048, kv_cache_dtype=kind), model, 2)
    assert quantized.num_blocks >= 1.9 * bf16.num_blocks
    per_value = 2 * model.num_layers * model.num_kv_heads * model.head_dim
    scales = 2 * model.num_layers * model.num_kv_heads * 2 if kind == "int8" else 0
    assert quantized.kv_bytes_per_token == per_value + scales


def test_an_unknown_kv_cache_dtype_is_refused_with_the_accepted_ones():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2, int8"):
        EngineConfig(kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(loaded=None, model="random:smollm2-135m?num_layers=1", kv_cache_dtype="q4_0")
    assert EngineConfig(kv_cache_dtype="FP8").kv_cache_dtype == "fp8"
    parser = argparse.ArgumentParser()
    add_config_args(parser, EngineConfig)
    assert parser.parse_args(["--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "fp4"])

"""The offline LLM in vLLM's shapes: a vLLM script runs with only its import changed, prompts in
every vLLM form, vLLM's constructor options honoured or accepted with a warning."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from iterserve import LLM, SamplingParams
from iterserve.outputs import Logprob

ROOT = Path(__file__).resolve().parent.parent


def test_vllm_offline_script_runs_unchanged():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(ROOT / "tests/scripts/vllm_offline.py")], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Processed prompts" in result.stderr  # tqdm's progress bar is on by default, as in vLLM
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(rows) == 6 and [r["index"] for r in rows] == [0, 1] * 3  # three prompts, n=2 each
    assert rows[0]["prompt"] == "The capital of France is" and rows[4]["prompt"] is None  # a TokensPrompt
    for r in rows:
        assert 1 <= r["num_tokens"] <= 12 and len(r["sampled"]) == r["num_tokens"]
        assert all(lp <= 0 and rank >= 1 and isinstance(text, str) for lp, rank, text in r["sampled"])
        assert all(k in (2, 3) for k in r["alternatives"])  # the sampled token plus the top 2
        assert r["cumulative_logprob"] == pytest.approx(sum(lp for lp, _, _ in r["sampled"]), abs=1e-3)
        assert len(r["prompt_logprobs"]) == r["num_prompt_tokens"] - 1
        assert all(lp <= 0 and math.isfinite(lp) for lp in r["prompt_logprobs"])


def test_vllm_offline_options_script_runs_unchanged():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(ROOT / "tests/scripts/vllm_offline_options.py")], env=env,
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "ok"


def test_prompt_shapes_give_the_same_outputs(smollm):
    llm = LLM(loaded=smollm, num_kv_blocks=64)
    text = "The capital of France is"
    ids = llm.get_tokenizer().encode(text)
    greedy = SamplingParams(temperature=0, max_tokens=5)
    shapes = [text, ids, {"prompt": text}, {"prompt_token_ids": ids}]
    one_by_one = [llm.generate(p, greedy, use_tqdm=False)[0].outputs[0].token_ids for p in shapes]
    together = [o.outputs[0].token_ids for o in llm.generate(shapes, greedy, use_tqdm=False)]
    assert one_by_one == together == [one_by_one[0]] * 4
    assert llm.generate({"prompt": text}, greedy, use_tqdm=False)[0].prompt == text
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": text, "multi_modal_data": {}}, greedy)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"text": text}, greedy)
    assert not llm.llm_engine.has_unfinished_requests()


def test_get_tokenizer_is_a_transformers_tokenizer(smollm):
    from transformers import PreTrainedTokenizerFast

    llm = LLM(loaded=smollm, num_kv_blocks=64)
    hf = llm.get_tokenizer()
    assert isinstance(hf, PreTrainedTokenizerFast) and llm.get_tokenizer() is hf
    assert llm.tokenizer is not None and hf("Hello there")["input_ids"] == llm.tokenizer.encode("Hello there")
    messages = [{"role": "user", "content": "Hi"}]
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        llm.tokenizer.apply_chat_template(messages)


def test_logprob_objects_and_cumulative_logprob(smollm):
    llm = LLM(loaded=smollm, num_kv_blocks=64)
    c = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(c.logprobs) == 4
    for token, entry in zip(c.token_ids, c.logprobs):
        assert all(isinstance(v, Logprob) for v in entry.values()) and len(entry) == 3
        assert entry[token].rank == 1  # greedy picks the most likely
        assert sorted(e.rank for e in entry.values()) == [1, 2, 3]
        assert entry[token].decoded_token == llm.get_tokenizer().decode([token])
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))
    plain = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None


def test_max_logprobs_caps_what_a_request_may_ask_for(smollm):
    """vLLM's max_logprobs option: more alternatives per token are refused, fewer are served."""
    llm = LLM(loaded=smollm, num_kv_blocks=64, max_logprobs=2)
    with pytest.raises(ValueError, match="greater than max allowed: 2"):
        llm.generate("Hello", SamplingParams(max_tokens=2, logprobs=3), use_tqdm=False)
    c = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=2, logprobs=2), use_tqdm=False)[0].outputs[0]
    assert [len(entry) for entry in c.logprobs] == [2, 2]
    with pytest.raises(ValueError, match="max_logprobs must be an integer in"):
        LLM(loaded=smollm, max_logprobs=21)


def test_vllm_options_are_mapped_warned_about_or_refused(smollm, caplog):
    with caplog.at_level(logging.WARNING, logger="iterserve.llm"):
        llm = LLM(loaded=smollm, enforce_eager=True, trust_remote_code=True, pipeline_parallel_size=1,
                  tensor_parallel_size=1, dtype="auto", max_model_len=256, max_num_seqs=8)
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert all(name in warned for name in ("enforce_eager", "trust_remote_code", "pipeline_parallel_size"))
    assert "tensor_parallel_size" not in warned  # an engine setting now (tests/distributed run it above 1)
    assert all("\n" not in r.getMessage() for r in caplog.records)
    assert llm.llm_engine.max_model_len == 256 and llm.llm_engine.config.max_num_seqs == 8
    assert llm.llm_engine is llm.engine
    with pytest.raises(ValueError, match="loaded=.*tensor_parallel_size"):  # each rank loads its own shard
        LLM(loaded=smollm, tensor_parallel_size=2)
    with pytest.raises(TypeError, match="no_such_option"):
        LLM(loaded=smollm, no_such_option=1)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(loaded=smollm, gpu_memory_utilization=1.5)


def test_gpu_memory_utilization_sizes_the_kv_cache_from_free_memory(smollm, monkeypatch):
    import iterserve.llm

    monkeypatch.setattr(iterserve.llm, "available_memory_bytes", lambda: 2 * 2**30)
    small = LLM(loaded=smollm, gpu_memory_utilization=0.01, max_model_len=256)
    large = LLM(loaded=smollm, gpu_memory_utilization=0.02, max_model_len=256)
    per_block = small.llm_engine.capacity.kv_bytes_per_token * small.llm_engine.capacity.block_size
    assert small.llm_engine.capacity.num_blocks == int(0.01 * 2 * 2**30) // per_block
    assert large.llm_engine.capacity.num_blocks == int(0.02 * 2 * 2**30) // per_block

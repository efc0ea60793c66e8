"""Tensor parallelism end to end on CPU with gloo: the engine starts its workers, greedy tokens equal the
single-process engine's in float32, a worker that dies stops the engine with an error naming it, and one that
hangs fails the step."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest

from iterserve import LLM, SamplingParams
from iterserve.errors import TensorParallelError

RANDOM_MODEL = "random:qwen3-0.6b?num_layers=2&vocab_size=8191"  # 16 heads, 8 KV heads: splits two ways
PROMPTS = [[5, 17, 300, 42], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [4000, 1]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_tp2_gives_the_tokens_of_one_process_on_a_random_preset():
    options = dict(dtype="float32", device="cpu", num_kv_blocks=32)
    single = LLM(RANDOM_MODEL, **options)
    expected = _tokens(single, PROMPTS)
    single.llm_engine.close()
    parallel = LLM(RANDOM_MODEL, tensor_parallel_size=2, **options)
    try:
        assert _tokens(parallel, PROMPTS) == expected
        assert len(parallel.llm_engine.core.executor.worker_pids) == 1
    finally:
        parallel.llm_engine.close()


@pytest.mark.slow  # four processes load SmolLM2 on two cores: about 2 minutes
def test_tp3_gives_the_tokens_of_one_process_on_smollm2(smollm):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    expected = _tokens(LLM(loaded=smollm, dtype="float32", num_kv_blocks=32), prompts)
    parallel = LLM("smollm2-135m", tensor_parallel_size=3, dtype="float32", device="cpu", num_kv_blocks=32)
    try:
        assert _tokens(parallel, prompts) == expected
    finally:
        parallel.llm_engine.close()


def test_a_killed_worker_stops_the_engine_with_an_error_naming_it():
    llm = LLM("random:qwen3-0.6b?num_layers=1&vocab_size=512", tensor_parallel_size=2, dtype="float32",
              device="cpu", num_kv_blocks=16)
    engine = llm.llm_engine
    try:
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=100, ignore_eos=True))
        engine.step()
        engine.step()  # decoding: a worker dies mid-run
        os.kill(engine.core.executor.worker_pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="worker rank 1 .* exited with code -9"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start < 30
        with pytest.raises(TensorParallelError, match="rank 1"):  # and stays failed
            engine.step()
    finally:
        engine.close()


def test_a_hung_worker_fails_the_step_instead_of_hanging_the_engine(monkeypatch):
    import iterserve.engine.executor as executor

    monkeypatch.setattr(executor, "STEP_SEND_TIMEOUT", timedelta(seconds=2))
    llm = LLM("random:qwen3-0.6b?num_layers=1&vocab_size=512", tensor_parallel_size=2, dtype="float32",
              device="cpu", num_kv_blocks=16)
    engine = llm.llm_engine
    worker = engine.core.executor.worker_pids[1]
    try:
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=100, ignore_eos=True))
        engine.step()
        os.kill(worker, signal.SIGSTOP)  # alive, its sockets open, taking no step
        with pytest.raises(TensorParallelError, match="out of step"):
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        os.kill(worker, signal.SIGKILL)
        engine.close()


def test_a_model_that_does_not_split_is_refused_before_any_worker_starts(monkeypatch):
    import iterserve.engine.executor as executor

    monkeypatch.setattr(executor.subprocess, "Popen", None)  # starting a worker would fail loudly
    with pytest.raises(ValueError, match="9 attention heads"):
        LLM("random:smollm2-135m?num_layers=1&vocab_size=512", tensor_parallel_size=2, dtype="float32", device="cpu")

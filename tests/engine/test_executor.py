"""The executor under EngineCore. Tensor parallelism end to end on CPU with gloo: the engine starts its
workers, greedy tokens equal the single-process engine's in float32, a worker that dies stops the engine with
an error naming it, and one that hangs fails the step. And an executor that runs no model plugs in."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
import torch

from iterserve import LLM, SamplingParams
from iterserve.config import EngineConfig, get_preset
from iterserve.engine.capacity import Capacity
from iterserve.engine.core import EngineCore
from iterserve.engine.executor import Executor
from iterserve.engine.messages import EngineCoreRequest
from iterserve.engine.sampler import SampleResult
from iterserve.engine.scheduler import sampling_seqs
from iterserve.errors import TensorParallelError
from iterserve.models.loader import load_model

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


class CountingExecutor(Executor):
    """No model: every sampled token is the number of steps run so far, so the core's bookkeeping shows."""

    def __init__(self, config: EngineConfig) -> None:
        self.model_config = get_preset("smollm2-135m")
        self.tokenizer, self.model_name = None, "counting"
        self.capacity = Capacity.of(config, self.model_config, 4)
        self.dtype, self.device = torch.float32, torch.device("cpu")
        self.steps: list[list[int]] = []  # the tokens each step computed, per scheduled sequence
        self.closed = False

    def execute_model(self, scheduled, block_copies, window_copies=None):
        self.steps.append([s.num_tokens for s in scheduled])
        rows = len(sampling_seqs(scheduled))
        return SampleResult([len(self.steps)] * rows, [None] * rows)

    def close(self) -> None:
        self.closed = True


def test_the_core_runs_over_any_executor():
    """EngineCore talks to its executor only: one that runs no model plugs in, and scheduling, chunked
    prefill, outputs and the KV blocks go on as with the real one."""
    config = EngineConfig(num_kv_blocks=16, max_model_len=128, max_num_batched_tokens=8)
    executor = CountingExecutor(config)
    core = EngineCore(config, executor=executor)
    core.add_request(EngineCoreRequest("a", list(range(1, 11)), SamplingParams(max_tokens=3, ignore_eos=True), 0.0))
    tokens = []
    while core.has_unfinished_requests():
        tokens += [t for o in core.step().outputs for t in o.new_token_ids]
    assert executor.steps == [[8], [2], [1], [1]]  # a 10-token prompt in chunks of 8, then two decodes
    assert tokens == [2, 3, 4]  # the first token comes with the prompt's last chunk
    core.block_manager.check_no_leaks()
    core.close()
    assert executor.closed
    tiny = load_model("random:smollm2-135m?num_layers=1&vocab_size=512", dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="not both"):
        EngineCore(config, tiny, executor=executor)

"""The server with a tensor-parallel engine: its core process is rank 0 and starts the workers; greedy text
equals the offline single-process engine's, and a worker that dies fails the engine with its rank named."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from iterserve import LLM, SamplingParams
from iterserve.config import EngineConfig, ServerConfig
from iterserve.server import build_app
from tests.server.conftest import MAX_MODEL_LEN, MODEL, ServerThread

# SmolLM2's shape and tokenizer with 8 heads and 2 KV heads, so that it splits two ways
SPLIT_MODEL = "random:smollm2-135m?num_layers=2&num_heads=8&num_kv_heads=2&head_dim=72"
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _complete(url: str, prompt: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True})


def _texts(llm: LLM) -> list[str]:
    return [o.outputs[0].text for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.slow
def test_tp2_server_gives_the_greedy_text_of_one_process_and_fails_when_a_worker_dies():
    options = dict(model=SPLIT_MODEL, dtype="float32", device="cpu", num_kv_blocks=64)
    config = EngineConfig(tensor_parallel_size=2, **options)
    with ServerThread(build_app(config, ServerConfig(served_model_name=MODEL))) as server:
        texts = [_complete(server.url, p).json()["choices"][0]["text"] for p in PROMPTS]
        core = server.engine.pids[0]
        workers = Path(f"/proc/{core}/task/{core}/children").read_text().split()
        assert len(workers) == 1  # rank 1, started by the core process
        os.kill(int(workers[0]), signal.SIGKILL)
        failed = _complete(server.url, PROMPTS[0])
        assert failed.status_code == 503
        assert "tensor-parallel worker rank 1" in failed.json()["error"]["message"]
    single = LLM(**options)
    assert texts == _texts(single)


@pytest.mark.slow  # four processes load SmolLM2 on two cores: about 2 minutes
def test_tp3_server_gives_the_greedy_text_of_one_process_on_smollm2(reference):
    config = EngineConfig(dtype="float32", num_kv_blocks=256, max_model_len=MAX_MODEL_LEN, tensor_parallel_size=3)
    with ServerThread(build_app(config, ServerConfig(served_model_name=MODEL))) as server:
        texts = [_complete(server.url, p).json()["choices"][0]["text"] for p in PROMPTS]
    assert texts == _texts(reference)

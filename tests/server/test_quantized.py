"""``iterserve serve --quantization gguf``: the engine core (a process of its own) loads the GGUF's blocks and
serves what the same quantized model gives offline, greedy and token for token."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from iterserve import LLM, SamplingParams
from iterserve.config import EngineConfig, ServerConfig
from iterserve.models.loader import load_model
from iterserve.server import build_app
from tests.server.conftest import ServerThread

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def quantized_server() -> Iterator[ServerThread]:
    config = EngineConfig(dtype="float32", quantization="gguf", num_kv_blocks=128, max_model_len=512)
    with ServerThread(build_app(config, ServerConfig(served_model_name="smollm2-q"))) as running:
        yield running


def test_served_completions_equal_the_offline_quantized_model(quantized_server):
    offline = LLM(loaded=load_model("smollm2-135m", "float32", "cpu", quantization="gguf"), num_kv_blocks=128)
    expected = [o.outputs[0].text for o in offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12),
                                                            use_tqdm=False)]
    body = {"model": "smollm2-q", "prompt": PROMPTS, "max_tokens": 12, "temperature": 0}
    r = httpx.post(f"{quantized_server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["text"] for c in choices] == expected
    assert all(text.strip() for text in expected)

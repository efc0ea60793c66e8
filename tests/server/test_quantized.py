"""``iterserve serve --quantization gguf``: the engine core (a process of its own) loads the GGUF's blocks and
serves what the same quantized model gives offline, greedy and token for token; the server says which weights
it holds in which format (/metrics, the dashboard's facts), for the quantized and the float model alike."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import httpx
import pytest

from iterserve import LLM, SamplingParams
from iterserve.config import EngineConfig, ServerConfig
from iterserve.models.loader import LoadedModel, load_model
from iterserve.quantization.model import weight_formats
from iterserve.server import build_app
from tests.server.conftest import API_KEY, ServerThread, metric_samples

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def quantized_server() -> Iterator[ServerThread]:
    config = EngineConfig(dtype="float32", quantization="gguf", num_kv_blocks=128, max_model_len=512)
    with ServerThread(build_app(config, ServerConfig(served_model_name="smollm2-q"))) as running:
        yield running


@pytest.fixture(scope="module")
def offline_quantized() -> LoadedModel:
    return load_model("smollm2-135m", "float32", "cpu", quantization="gguf")


def weight_metrics(server: ServerThread) -> dict[str, tuple[float, float]]:
    """format -> (bytes, tensors) from /metrics."""
    samples = metric_samples(server)
    return {dict(labels)["format"]: (value, samples[("iterserve:weight_tensors", labels)])
            for (name, labels), value in samples.items() if name == "iterserve:weight_bytes"}


def dashboard_weights(server: ServerThread, headers: dict[str, str]) -> list[dict[str, object]]:
    """The weights in the dashboard feed's first frame (its facts)."""
    with httpx.stream("GET", f"{server.url}/dashboard/events", headers=headers, timeout=60) as feed:
        assert feed.status_code == 200
        line = next(line for line in feed.iter_lines() if line.startswith("data: "))
    return json.loads(line.removeprefix("data: "))["facts"]["weights"]


def test_served_completions_equal_the_offline_quantized_model(quantized_server, offline_quantized):
    offline = LLM(loaded=offline_quantized, num_kv_blocks=128)
    expected = [o.outputs[0].text for o in offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12),
                                                            use_tqdm=False)]
    body = {"model": "smollm2-q", "prompt": PROMPTS, "max_tokens": 12, "temperature": 0}
    r = httpx.post(f"{quantized_server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["text"] for c in choices] == expected
    assert all(text.strip() for text in expected)


def test_quantized_server_exports_its_weight_formats(quantized_server, offline_quantized):
    """/metrics and the dashboard hold, per format, what the same model loaded in this process holds."""
    expected = {f.fmt: (float(f.bytes), float(f.tensors)) for f in weight_formats(offline_quantized.model)}
    assert set(expected) == {"Q4_1", "Q8_0", "float32"}  # the norms stay float
    assert weight_metrics(quantized_server) == expected
    assert expected["Q4_1"][0] > 0.5 * sum(b for b, _ in expected.values())
    shown = {w["format"]: (w["bytes"], w["tensors"]) for w in dashboard_weights(quantized_server, {})}
    assert shown == expected
    assert "vllm:num_requests_running" in {name for name, _ in metric_samples(quantized_server)}  # vLLM's names stay


def test_float_server_exports_float_weights(server, smollm):
    """The default (no quantization): every weight in the model's dtype, as many bytes as it has parameters x 4."""
    formats = weight_metrics(server)
    assert set(formats) == {"float32"}
    nbytes, tensors = formats["float32"]
    assert nbytes >= 4 * smollm.config.num_parameters() and tensors > 100
    shown = dashboard_weights(server, {"Authorization": f"Bearer {API_KEY}"})
    assert [(w["format"], w["bytes"]) for w in shown] == [("float32", nbytes)]


def test_loading_logs_one_line_per_weight_format(caplog):
    with caplog.at_level(logging.INFO, logger="iterserve.models.loader"):
        loaded = load_model("smollm2-135m", "float32", "cpu", quantization="gguf")
    lines = [r.getMessage() for r in caplog.records if "weights in " in r.getMessage()]
    assert len(lines) == len(weight_formats(loaded.model)) == 3
    assert any(line.startswith("smollm2-135m: weights in Q4_1: ") and " tensors, " in line for line in lines)

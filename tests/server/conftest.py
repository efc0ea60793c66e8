"""Server fixtures: the app on SmolLM2-135M (its core in a process of its own), served by uvicorn on loopback."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from iterserve import LLM
from iterserve.config import EngineConfig, ServerConfig
from iterserve.engine.core_client import EngineCoreClient
from iterserve.server import build_app

API_KEY = "test-key"
MODEL = "smollm2-test"
MAX_MODEL_LEN = 1024
TINY_MODEL = "random:smollm2-135m?num_layers=2"  # starts fast; for tests that do not compare text
STARTUP_TIMEOUT_S = 240  # the core process loads the model under a shared, busy CPU


class ServerThread:
    """uvicorn serving ``app`` from a background thread on an ephemeral 127.0.0.1 port."""

    def __init__(self, app: FastAPI) -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.engine: EngineCoreClient = app.state.engine
        self.url = ""

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "uvicorn did not stop"


def metric_samples(server: ServerThread) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics as {(sample name, sorted labels without model_name and engine): value}, summed over
    engines (data-parallel replicas)."""
    text = httpx.get(f"{server.url}/metrics").text
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine"))))
            samples[key] = samples.get(key, 0.0) + s.value
    return samples


def aborted(server: ServerThread) -> float:
    return metric_samples(server)[("vllm:request_success_total", (("finished_reason", "abort"),))]


def wait_until_idle(server: ServerThread, timeout: float = 10.0) -> float:
    """Seconds until the core reports no request and no KV block in use (so nothing leaked)."""
    start = time.monotonic()
    while True:
        m = metric_samples(server)
        busy = {k: m[(k, ())] for k in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                        "vllm:kv_cache_usage_perc")}
        if not any(busy.values()):
            return time.monotonic() - start
        assert time.monotonic() - start < timeout, f"the engine is still busy: {busy}"
        time.sleep(0.05)


@contextmanager
def speculating_server() -> Iterator[ServerThread]:
    """A tiny-model server with n-gram speculation (k=3), after one greedy 40-token completion whose
    drafts it verified (a random model repeats itself, so lookup finds drafts) and once it is idle."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    config = EngineConfig(model=TINY_MODEL, dtype="float32", num_kv_blocks=64, max_model_len=256,
                          speculative_config=spec)
    with ServerThread(build_app(config, ServerConfig(served_model_name=MODEL))) as s:
        r = httpx.post(f"{s.url}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": [5, 6, 7, 8] * 8, "max_tokens": 40, "ignore_eos": True,
                             "temperature": 0})
        assert r.status_code == 200, r.text
        wait_until_idle(s)
        yield s


@pytest.fixture(scope="session")
def trace_path(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("server") / "steps.jsonl"


@pytest.fixture(scope="session")
def engine_config(trace_path) -> EngineConfig:
    """The served engine (float32 on CPU, so greedy outputs compare exactly with offline runs)."""
    return EngineConfig(dtype="float32", num_kv_blocks=256, max_model_len=MAX_MODEL_LEN, step_trace=str(trace_path))


@pytest.fixture(scope="session")
def reference(smollm) -> LLM:
    """An offline LLM on the same weights and settings, in this process."""
    return LLM(loaded=smollm, dtype="float32", num_kv_blocks=256, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="session")
def server(engine_config) -> Iterator[ServerThread]:
    app = build_app(engine_config, ServerConfig(served_model_name=MODEL, api_key=API_KEY, max_waiting=256))
    with ServerThread(app) as running:
        yield running

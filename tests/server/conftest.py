"""Server fixtures: an engine on the session's SmolLM2-135M weights, served by uvicorn on loopback."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI

from iterserve import LLM
from iterserve.engine.llm_engine import EngineConfig, LLMEngine
from iterserve.server import build_app

API_KEY = "test-key"
MODEL = "smollm2-test"
MAX_MODEL_LEN = 1024


class ServerThread:
    """uvicorn serving ``app`` from a background thread on an ephemeral 127.0.0.1 port."""

    def __init__(self, app: FastAPI) -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.url = ""

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "uvicorn did not stop"


@pytest.fixture(scope="session")
def engine(smollm) -> LLMEngine:
    """The served engine (float32 on CPU, so greedy outputs compare exactly with offline runs)."""
    return LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=256, max_model_len=MAX_MODEL_LEN), smollm)


@pytest.fixture(scope="session")
def reference(smollm) -> LLM:
    """An offline LLM sharing the weights; only used while the server is idle."""
    return LLM(loaded=smollm, dtype="float32", num_kv_blocks=256, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="session")
def server(engine) -> Iterator[ServerThread]:
    app = build_app(engine, served_model_name=MODEL, api_key=API_KEY, max_waiting=256)
    with ServerThread(app) as running:
        yield running

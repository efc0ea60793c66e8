"""The shared steps of the routes (iterserve/server/serving.py): the abort path driven without an HTTP
server, the logprobs caps through one."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from iterserve.config import EngineConfig, ServerConfig
from iterserve.outputs import RequestOutput
from iterserve.server import build_app
from iterserve.server.serving import OpenAIServing
from tests.server.conftest import MODEL, TINY_MODEL, ServerThread


class EndlessStream:
    """A request that never finishes until it is closed (as an abort closes it)."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[RequestOutput]:
        await self.closed.wait()
        raise RuntimeError("the request was aborted")
        yield  # pragma: no cover  (makes this an async generator)

    def close(self) -> None:
        self.closed.set()


class LeavingClient:
    """An ASGI request whose client disconnects after its body."""

    def __init__(self) -> None:
        self.calls = 0

    async def receive(self) -> dict[str, Any]:
        self.calls += 1
        await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}


def test_a_client_leaving_a_non_streamed_request_leaves_no_unretrieved_exception() -> None:
    """An abort of a non-streamed request ends its gathering future quietly: asyncio's handler would
    log "exception was never retrieved" as an ERROR for each one otherwise."""
    errors: list[dict[str, Any]] = []

    async def run() -> list[RequestOutput] | None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        serving = OpenAIServing.__new__(OpenAIServing)
        streams = [EndlessStream(), EndlessStream()]
        out = await serving._final_outputs(streams, LeavingClient())  # type: ignore[arg-type]
        assert all(s.closed.is_set() for s in streams)  # both engine requests aborted
        for _ in range(5):
            await asyncio.sleep(0)
        gc.collect()
        return out

    assert asyncio.run(run()) is None
    gc.collect()
    assert errors == []


@pytest.fixture(scope="module")
def capped_server() -> Iterator[ServerThread]:
    """A tiny-model server with at most 5 alternatives per token and 1,000 logprob entries per response."""
    config = EngineConfig(model=TINY_MODEL, dtype="float32", num_kv_blocks=64, max_model_len=256, max_logprobs=5)
    with ServerThread(build_app(config, ServerConfig(served_model_name=MODEL, max_response_logprobs=1000))) as s:
        yield s


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, **fields}


@pytest.mark.parametrize(("path", "body", "param", "words"), [
    ("/v1/chat/completions", chat(top_logprobs=6, max_tokens=2), "top_logprobs", "greater than max allowed: 5"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 6, "max_tokens": 2}, "logprobs", "greater than max allowed: 5"),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 6, "max_tokens": 2}, "prompt_logprobs",
     "greater than max allowed: 5"),
    # 4 choices x 50 tokens x (5 + 1) = 1,200 entries
    ("/v1/chat/completions", chat(n=4, top_logprobs=5, max_tokens=50), "top_logprobs", "1200 logprobs (n=4 x 50"),
    ("/v1/chat/completions", chat(n=8, max_tokens=150), "logprobs", "1200 logprobs"),  # the sampled token's alone
    # max_tokens: what the context leaves
    ("/v1/chat/completions", chat(top_logprobs=5), "top_logprobs", "max_response_logprobs"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 5, "n": 2, "max_tokens": 100, "stream": True}, "logprobs",
     "more than the 1000 a response may carry (max_response_logprobs)"),
    ("/v1/completions", {"prompt": [7] * 200, "prompt_logprobs": 5, "max_tokens": 1}, "prompt_logprobs",
     "200 prompt tokens x 6"),
])
def test_logprobs_beyond_the_caps_are_refused_naming_the_limit(capped_server, path, body, param, words):
    r = httpx.post(capped_server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text[:500]
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_logprobs_within_the_caps_are_served(capped_server):
    # 4 choices x 40 tokens x 6 = 960 entries: within the 1,000
    r = httpx.post(capped_server.url + "/v1/chat/completions", timeout=120,
                   json=chat(n=4, top_logprobs=5, max_tokens=40, ignore_eos=True))
    assert r.status_code == 200, r.text[:500]
    for choice in r.json()["choices"]:
        tokens = choice["logprobs"]["content"]
        assert len(tokens) == 40 and all(len(t["top_logprobs"]) == 5 for t in tokens)

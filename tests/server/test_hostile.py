"""Requests a hostile client sends: oversized bodies, invalid Unicode, bodies that are not declared
JSON, thousands of stop strings, non-integer sampling values and prompts far too long for the
context. Each gets a 4xx with an OpenAI error body quickly, and the server keeps answering others
(the same keep-alive connection included) while it refuses them."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.server.conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
JSON = {"Content-Type": "application/json"}
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def http(url: str, **headers: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={**AUTH, **headers}, timeout=60)


def local_port(r: httpx.Response) -> int:
    """The client-side port of the connection that carried ``r``: equal ports mean a reused connection."""
    return r.extensions["network_stream"].get_extra_info("socket").getsockname()[1]


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


class HealthProbe:
    """Polls /health from another thread while the block runs; ``worst`` is the slowest answer."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as c:
            while not self._stop.is_set():
                start = time.perf_counter()
                assert c.get("/health").status_code == 200
                self.latencies.append(time.perf_counter() - start)
                time.sleep(0.02)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    @property
    def worst(self) -> float:
        assert self.latencies, "/health was never answered"
        return max(self.latencies)


def while_probing_health(url: str, action: Callable[[], httpx.Response]) -> tuple[httpx.Response, float]:
    """Run ``action`` while /health is polled; the response and /health's slowest answer."""
    with HealthProbe(url) as probe:
        time.sleep(0.1)  # the probe is answering before the action starts
        r = action()
        time.sleep(0.1)
    return r, probe.worst

# -- invalid Unicode, non-integers, malformed lists ------------------------------------------------



SURROGATE_CASES = [
    # (path, raw JSON body with a lone surrogate escape, param)
    ("/v1/completions", r'{"prompt": "\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/completions", r'{"prompt": ["abc\udfff"], "max_tokens": 2}', "prompt"),
    ("/v1/completions", r'{"prompt": "Hello", "stop": ["\ud800"], "max_tokens": 2}', "stop"),
    ("/v1/completions", r'{"prompt": "Hello", "stop": "x\udc00", "max_tokens": 2}', "stop"),
    ("/v1/completions", r'{"prompt": "Hello", "model": "\ud800"}', "model"),
    ("/v1/completions", r'{"prompt": "Hello", "logit_bias": {"\ud800": "x"}}', "logit_bias"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "hi \ud83d"}]}', "messages"),
    ("/v1/chat/completions",
     r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ude00"}]}]}', "messages"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "hi", "name": "\ud800"}]}', "messages"),
    ("/tokenize", r'{"prompt": "\ud800"}', "prompt"),
    ("/tokenize", r'{"messages": [{"role": "user", "content": "\ud800"}]}', "messages"),
]


def test_lone_surrogates_get_400_and_the_connection_stays_usable(server):
    with http(server.url, **JSON) as c:
        first = c.post("/tokenize", json={"prompt": "Hello"})
        assert first.status_code == 200
        for path, raw, param in SURROGATE_CASES:
            error = assert_error(c.post(path, content=raw.encode()), 400, param)
            assert "lone surrogate" in error["message"], error
            ok = c.post("/tokenize", json={"prompt": "Hello"})
            assert ok.status_code == 200 and local_port(ok) == local_port(first), (path, raw)
        # a surrogate pair is one valid character, not an error
        pair = c.post("/tokenize", content=rb'{"prompt": "\ud83d\ude00"}')
        assert pair.status_code == 200 and pair.json()["count"] >= 1
        assert c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2}).status_code == 200

NON_INTEGERS = [
    ("/v1/completions", {"top_k": 2.5}, "top_k"),
    ("/v1/completions", {"logprobs": 1.5}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"min_tokens": 0.5}, "min_tokens"),
    ("/v1/completions", {"seed": 1.5}, "seed"),
    ("/v1/completions", {"n": True}, "n"),
    ("/v1/completions", {"stop_token_ids": [2.5]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": [1, True, 3]}, "prompt"),
    ("/v1/chat/completions", {"top_logprobs": 1.5, "logprobs": True}, "top_logprobs"),
    ("/v1/chat/completions", {"max_completion_tokens": False}, "max_completion_tokens"),
]


@pytest.mark.parametrize("path,extra,param", NON_INTEGERS, ids=[json.dumps(e) for _, e, _ in NON_INTEGERS])
def test_non_integer_sampling_values_get_400(server, engine, path, extra, param):
    body = {"prompt": "Hello"} if path == "/v1/completions" else {"messages": CHAT}
    body |= {"max_tokens": 2} | extra
    with http(server.url, **JSON) as c:
        assert_error(c.post(path, json=body), 400, param)
        assert c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2}).status_code == 200
    assert not engine.requests
    engine.block_manager.check_no_leaks()

@pytest.mark.parametrize("body,param", [
    ({"prompt": [1, "a"] * 300_000, "max_tokens": 2}, "prompt"),
    ({"prompt": "Hello", "stop_token_ids": [1, "a"] * 300_000}, "stop_token_ids"),
    ({"prompt": "Hello", "logit_bias": {str(i): "x" for i in range(300_000)}}, "logit_bias"),
])
def test_a_list_of_bad_elements_is_refused_at_the_first(server, body, param):
    """pydantic used to report an error per element: a few MB of them held the event loop for minutes."""
    with http(server.url, **JSON) as c:
        start = time.perf_counter()
        r, worst = while_probing_health(server.url, lambda: c.post("/v1/completions", json=body))
        assert_error(r, 400, param)
        assert worst < 1.0 and time.perf_counter() - start < 5.0

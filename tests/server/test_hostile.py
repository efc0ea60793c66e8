"""Requests a hostile client sends: oversized bodies, invalid Unicode, bodies that are not declared
JSON, thousands of stop strings, non-integer sampling values and prompts far too long for the
context. Each gets a 4xx with an OpenAI error body quickly, and the server keeps answering others
(the same keep-alive connection included) while it refuses them."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from iterserve.config import EngineConfig, ServerConfig
from iterserve.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS
from iterserve.server import build_app
from tests.server.conftest import API_KEY, MAX_MODEL_LEN, MODEL, ServerThread, metric_samples, wait_until_idle
from tests.server.probes import HealthProbe

AUTH = {"Authorization": f"Bearer {API_KEY}"}
JSON = {"Content-Type": "application/json"}
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
MiB = 1024 * 1024
OPEN_SERVER_BODY_LIMIT = 4096


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


def while_probing_health(url: str, action: Callable[[], httpx.Response]) -> tuple[httpx.Response, float]:
    """Run ``action`` while /health is polled; the response and /health's slowest answer."""
    with HealthProbe(url) as probe:
        time.sleep(0.1)  # the probe is answering before the action starts
        r = action()
        time.sleep(0.1)
    assert not probe.failures, probe.failures[:3]
    return r, probe.worst

@pytest.fixture(scope="module")
def open_server() -> Iterator[ServerThread]:
    """A server without an API key (as on a developer's machine) and with a small body limit."""
    app = build_app(EngineConfig(dtype="float32", num_kv_blocks=32, max_model_len=128),
                    ServerConfig(served_model_name=MODEL, max_waiting=8, max_request_body_bytes=OPEN_SERVER_BODY_LIMIT))
    with ServerThread(app) as s:
        yield s


def prompt_tokens(server: ServerThread) -> float:
    """Prompt tokens the engine has computed: it moves only when a generation ran."""
    return metric_samples(server)[("vllm:prompt_tokens_total", ())]

# -- invalid Unicode, non-integers, malformed lists ------------------------------------------------



SURROGATE_CASES = [
    # (path, raw JSON body with a lone surrogate escape, param)
    ("/v1/completions", r'{"prompt": "\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/completions", r'{"prompt": ["abc\udfff"], "max_tokens": 2}', "prompt"),
    ("/v1/completions", r'{"prompt": "Hello", "stop": ["\ud800"], "max_tokens": 2}', "stop"),
    ("/v1/completions", r'{"prompt": "Hello", "stop": "x\udc00", "max_tokens": 2}', "stop"),
    ("/v1/completions", r'{"prompt": "Hello", "model": "\ud800"}', "model"),
    ("/v1/completions", r'{"prompt": "Hello", "user": "\ud800"}', "user"),
    ("/v1/chat/completions",
     r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "\ud800": 1}]}]}', "messages"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "hi \ud83d"}]}', "messages"),
    ("/v1/chat/completions",
     r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ude00"}]}]}', "messages"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "hi", "name": "\ud800"}]}', "messages"),
    ("/v1/responses", r'{"input": "hi \ud83d"}', "input"),
    ("/v1/responses",
     r'{"input": [{"role": "user", "content": [{"type": "input_text", "text": "\ude00"}]}]}', "input"),
    ("/v1/responses", r'{"input": "hi", "instructions": "\ud800"}', "instructions"),
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
def test_non_integer_sampling_values_get_400(server, path, extra, param):
    body = {"prompt": "Hello"} if path == "/v1/completions" else {"messages": CHAT}
    body |= {"max_tokens": 2} | extra
    with http(server.url, **JSON) as c:
        assert_error(c.post(path, json=body), 400, param)
        assert c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2}).status_code == 200
    wait_until_idle(server)  # nothing stuck, no KV block held

@pytest.mark.parametrize("body,param", [
    ({"prompt": [1, "a"] * 150_000, "max_tokens": 2}, "prompt"),
    ({"prompt": "Hello", "stop_token_ids": [1, "a"] * 150_000}, "stop_token_ids"),
    ({"prompt": "Hello", "logit_bias": {str(i): "x" for i in range(150_000)}}, "logit_bias"),
])
def test_a_list_of_bad_elements_is_refused_at_the_first(server, body, param):
    """pydantic used to report an error per element: a few MB of them held the event loop for minutes."""
    with http(server.url, **JSON) as c:
        start = time.perf_counter()
        r, worst = while_probing_health(server.url, lambda: c.post("/v1/completions", json=body))
        assert_error(r, 400, param)
        assert worst < 1.0 and time.perf_counter() - start < 5.0

# -- request size ----------------------------------------------------------------------------------


def test_16_mb_body_is_refused_with_413_while_health_answers(server):
    body = json.dumps({"prompt": "x" * (16 * MiB)}).encode()

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit must be enforced as bytes arrive
        for i in range(0, len(body), MiB):
            yield body[i:i + MiB]

    with http(server.url, **JSON) as c:
        for content in (body, chunks()):
            r, worst = while_probing_health(server.url, functools.partial(c.post, "/v1/completions", content=content))
            error = assert_error(r, 413, code="request_too_large")
            assert str(8 * MiB) in error["message"]
            assert worst < 1.0
        ok = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert ok.status_code == 200 and local_port(ok) == local_port(r)  # the connection was kept


def test_body_limit_is_exact_and_configurable(open_server):
    s = open_server
    prefix = b'{"prompt": "Hello"'
    with http(s.url, **JSON) as c:
        for size, status in ((OPEN_SERVER_BODY_LIMIT, 200), (OPEN_SERVER_BODY_LIMIT + 1, 413)):
            raw = prefix + b" " * (size - len(prefix) - 1) + b"}"  # JSON whitespace: a body that size, any prompt
            assert len(raw) == size
            r = c.post("/tokenize", content=raw)
            assert r.status_code == status, r.text

# -- content type ----------------------------------------------------------------------------------


@pytest.mark.parametrize("content_type", [None, "text/plain", "text/plain;charset=UTF-8",
                                          "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"])
def test_post_bodies_must_be_declared_json(server, content_type):
    headers = {} if content_type is None else {"Content-Type": content_type}
    raw = json.dumps({"prompt": "Hello", "max_tokens": 2}).encode()
    with http(server.url) as c:
        for path in ("/v1/completions", "/tokenize"):
            assert_error(c.post(path, content=raw, headers=headers), 415, code="unsupported_media_type")
        ok = c.post("/v1/completions", content=raw, headers={"Content-Type": "application/json; charset=utf-8"})
        assert ok.status_code == 200, ok.text


def test_cross_origin_browser_post_runs_no_generation(open_server):
    """What a page on another site can make a browser send without a CORS preflight."""
    s = open_server
    before = prompt_tokens(s)
    body = json.dumps({"prompt": "Hello", "max_tokens": 4}).encode()
    with httpx.Client(base_url=s.url, timeout=30) as c:
        for content_type in ("text/plain;charset=UTF-8", None):
            headers = {"Origin": "http://evil.example"}
            if content_type:
                headers["Content-Type"] = content_type
            r = c.post("/v1/completions", content=body, headers=headers)
            assert_error(r, 415)
            assert "access-control-allow-origin" not in r.headers
        wait_until_idle(s)
        assert prompt_tokens(s) == before
        # the same request as JSON is served, so the refusal above is the Content-Type's doing
        assert c.post("/v1/completions", content=body, headers=JSON).status_code == 200
    wait_until_idle(s)
    assert prompt_tokens(s) > before

# -- stop strings ----------------------------------------------------------------------------------


def test_ten_thousand_stop_strings_are_refused_quickly(server):
    with http(server.url, **JSON) as c:
        start = time.perf_counter()
        error = assert_error(c.post("/v1/completions", json={"prompt": "Hello", "stop": ["s" * 100] * 10_000}),
                             400, "stop")
        assert time.perf_counter() - start < 2.0 and "at most 64" in error["message"]
        # 10,000 strings of 1 KB are over the body limit before they are even parsed
        assert_error(c.post("/v1/completions", json={"prompt": "Hello", "stop": ["s" * 1024] * 10_000}), 413)
        chars = c.post("/v1/completions", json={"prompt": "Hello", "stop": ["s" * MAX_STOP_CHARS, "t"]})
        assert_error(chars, 400, "stop")
        at_limits = {"prompt": "Hello", "max_tokens": 2, "stop": ["s" * (MAX_STOP_CHARS // MAX_STOP_STRINGS)] *
                     MAX_STOP_STRINGS}
        assert c.post("/v1/completions", json=at_limits).status_code == 200
    wait_until_idle(server)

# -- prompts too long for the context --------------------------------------------------------------


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hello " * 700_000, "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * 700_000}]}, "messages"),
    ("/v1/responses", {"input": "hello " * 700_000}, "input"),
    ("/tokenize", {"prompt": "hello " * 700_000}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hello " * 700_000}]}, "messages"),
])
def test_huge_prompt_is_refused_before_tokenizing_while_health_answers(server, path, body, param):
    """4 MB of text: tokenizing it takes seconds; its length alone proves it cannot fit 1024 tokens."""
    with http(server.url, **JSON) as c:
        start = time.perf_counter()
        r, worst = while_probing_health(server.url, lambda: c.post(path, json=body))
        error = assert_error(r, 400, param, "context_length_exceeded")
        assert "characters" in error["message"]  # refused on its length, not after tokenizing
        assert worst < 1.0 and time.perf_counter() - start < 3.0


def test_tokenize_refuses_text_longer_than_the_context(server):
    just_over = "hello " * MAX_MODEL_LEN  # short enough to tokenize, too long to be a prompt
    with http(server.url, **JSON) as c:
        assert_error(c.post("/tokenize", json={"prompt": just_over}), 400, "prompt", "context_length_exceeded")
        fits = c.post("/tokenize", json={"prompt": "hello " * (MAX_MODEL_LEN // 4)})
        assert fits.status_code == 200 and fits.json()["count"] <= MAX_MODEL_LEN

def test_detokenize_refuses_more_ids_than_the_context(server):
    with http(server.url, **JSON) as c:
        error = assert_error(c.post("/detokenize", json={"tokens": [1] * (MAX_MODEL_LEN + 1)}), 400, "tokens")
        assert error["code"] == "context_length_exceeded"
        ids = server.engine.tokenizer.encode("Hello world")
        assert c.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "Hello world"}

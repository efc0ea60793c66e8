"""Requests that are valid JSON but cost the server more than their sender should be allowed to spend:
integers past 64 bits, grammars too big, too slow or impossible to run, crowds of dashboard viewers,
100,000 chat messages, forged cookies, half-sent bodies, a core that stops stepping, and one request
of many prompts. Each is answered (a 4xx naming the parameter, or served fairly) while /health and a
concurrent stream keep going (``others_served``)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from iterserve.config import EngineConfig, ServerConfig
from iterserve.server import build_app
from tests.server.conftest import (
    API_KEY,
    MODEL,
    TINY_MODEL,
    ServerThread,
    aborted,
    metric_samples,
    wait_until_idle,
)
from tests.server.probes import others_served
from tests.server.test_api import sse_events
from tests.server.test_hostile import assert_error

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = [{"role": "user", "content": "Hi"}]
BODY_TIMEOUT_S = 1.0
MAX_VIEWERS = 8
GRAMMAR_TIMEOUT_S = 0.3


def tiny_config(**kw) -> EngineConfig:
    return EngineConfig(**{"model": TINY_MODEL, "dtype": "float32", "num_kv_blocks": 512, "max_model_len": 2048,
                           **kw})


@pytest.fixture(scope="module")
def tiny() -> Iterator[ServerThread]:
    """A fast server (two random layers) with the API key and short limits."""
    app = build_app(tiny_config(), ServerConfig(
        served_model_name=MODEL, api_key=API_KEY, max_waiting=64, request_body_timeout=BODY_TIMEOUT_S,
        max_dashboard_viewers=MAX_VIEWERS))
    with ServerThread(app) as s:
        yield s


def post(server: ServerThread, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=timeout)


def prompt_tokens(server: ServerThread) -> float:
    return metric_samples(server)[("vllm:prompt_tokens_total", ())]


# -- 1. integers past 64 bits ------------------------------------------------------------------------

BIG = 2**64


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/completions", {"top_k": BIG}, "top_k"),
    ("/v1/completions", {"stop_token_ids": [BIG]}, "stop_token_ids"),
    ("/v1/chat/completions", {"min_tokens": BIG, "max_tokens": None}, "min_tokens"),
    ("/v1/chat/completions", {"top_k": 10**40, "stream": True}, "top_k"),
])
def test_integers_past_64_bits_get_400_naming_them_and_nothing_is_kept(tiny, path, extra, param):
    body = ({"prompt": list(range(1, 2000))} if path == "/v1/completions" else {"messages": CHAT}) | \
        {"max_tokens": 2} | extra
    with others_served(tiny.url, AUTH):
        for _ in range(20):
            assert_error(post(tiny, path, body), 400, param)
    wait_until_idle(tiny)
    assert tiny.engine.num_requests == 0  # nothing registered and left behind in the API process


# -- 2, 3. grammars ----------------------------------------------------------------------------------


def test_a_grammar_over_the_size_cap_gets_400_at_once(tiny):
    choices = [f"choice number {i} xyz" for i in range(50_000)]  # 1.2 MB: compiling it took 25 s
    with others_served(tiny.url, AUTH):
        error = assert_error(post(tiny, "/v1/chat/completions", {"messages": CHAT, "guided_choice": choices}),
                             400, "guided_choice")
    assert "at most" in error["message"]
    wait_until_idle(tiny)


def test_a_grammar_slower_to_compile_than_the_limit_gets_400_while_others_are_served():
    """A 10-byte regex whose first mask llguidance takes 2-3 s to compute (on a loaded 2-core machine)."""
    app = build_app(tiny_config(), ServerConfig(served_model_name=MODEL, grammar_timeout=GRAMMAR_TIMEOUT_S))
    with ServerThread(app) as s:
        assert post(s, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "guided_regex": "[ab]{2}"}).status_code \
            == 200  # the grammar compiler is built
        with others_served(s.url):
            start = time.perf_counter()
            r = post(s, "/v1/completions", {"prompt": "Hi", "max_tokens": 4, "guided_regex": "a{1000000}"})
            waited = time.perf_counter() - start
        error = assert_error(r, 400, "guided_regex", "grammar_too_complex")
        assert "did not compile within" in error["message"] and waited < GRAMMAR_TIMEOUT_S + 5
        ok = post(s, "/v1/completions", {"prompt": "Hi", "max_tokens": 8, "guided_regex": "[ab]{3}"})
        assert ok.status_code == 200 and len(ok.json()["choices"][0]["text"]) == 3  # the pool still works
        wait_until_idle(s)


@pytest.mark.parametrize("field,spec", [
    ("guided_grammar", 'start: "a"{1000000}'),
    ("guided_grammar", "start: a\na: a"),
    ("guided_json", {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
])
def test_grammars_that_validate_but_cannot_run_get_400_before_admission(tiny, field, spec):
    before = prompt_tokens(tiny)
    with others_served(tiny.url, AUTH):
        assert_error(post(tiny, "/v1/completions", {"prompt": "Hello there", "max_tokens": 4, field: spec}),
                     400, field)
    wait_until_idle(tiny)
    assert prompt_tokens(tiny) == before + 3  # the probe's prompt only: the refused one was never computed


def test_an_ambiguous_grammar_is_cut_off_with_a_400_naming_the_cause_while_others_are_served(tiny):
    """Its masks grow with every token; a grammar limit ends it long before its 600 tokens."""
    body = {"messages": CHAT, "n": 4, "max_tokens": 600, "ignore_eos": True,
            "structured_outputs": {"grammar": 'root ::= x\nx ::= x x | "a" | "b" | x "a" | "a" x\n'}}
    with others_served(tiny.url, AUTH):
        error = assert_error(post(tiny, "/v1/chat/completions", body), 400)
    assert "grammar" in error["message"] and "make it unambiguous" in error["message"], error
    wait_until_idle(tiny)


# -- 4. dashboard viewers ----------------------------------------------------------------------------

VIEWERS = 200


def test_dashboard_viewers_past_the_limit_get_429_and_serving_goes_on(tiny):
    async def crowd() -> list[int | str]:
        async with httpx.AsyncClient(base_url=tiny.url, headers=AUTH, timeout=60,
                                     limits=httpx.Limits(max_connections=None)) as c:
            async def view() -> int | str:
                async with c.stream("GET", "/dashboard/events") as r:
                    if r.status_code != 200:
                        return r.status_code
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            first = json.loads(line.removeprefix("data: "))
                            await asyncio.sleep(2)  # keep watching while the others arrive
                            return "facts" in first and 200
                return "no frame"
            return await asyncio.gather(*(view() for _ in range(VIEWERS)))

    with others_served(tiny.url, AUTH):
        answers = asyncio.run(crowd())
    assert answers.count(200) >= 1 and set(answers) == {200, 429}, answers
    assert answers.count(200) <= MAX_VIEWERS * 3  # viewers leave after 2 s, so a few more get in
    with httpx.stream("GET", f"{tiny.url}/dashboard/events", headers=AUTH, timeout=60) as r:
        assert r.status_code == 200  # the crowd has left
    wait_until_idle(tiny)


# -- 5. big but legal bodies -------------------------------------------------------------------------


@pytest.mark.parametrize("path, field", [("/v1/chat/completions", "messages"), ("/tokenize", "messages"),
                                         ("/v1/responses", "input")])
def test_100k_chat_messages_are_refused_while_others_are_served(tiny, path, field):
    messages = [{"role": "user", "content": "a message"}] * 100_000  # 3.3 MB
    with others_served(tiny.url, AUTH):
        error = assert_error(post(tiny, path, {field: messages}), 400, field)
    assert "at most 4096" in error["message"]
    wait_until_idle(tiny)


def test_a_thousand_long_messages_are_served_while_others_are_served(tiny):
    """Legal, but heavy to validate: checked off the event loop."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "x"}] * 200}] * 1000
    with others_served(tiny.url, AUTH):
        r = post(tiny, "/tokenize", {"messages": messages})
    assert_error(r, 400, "messages", "context_length_exceeded")
    wait_until_idle(tiny)


# -- 7. the dashboard cookie -------------------------------------------------------------------------


@pytest.mark.parametrize("cookie", ["²³.x", "¹²³⁴⁵⁶⁷⁸⁹⁰¹².x", "9" * 5000 + ".x", "-1.x", " 12.x"])
def test_a_forged_cookie_is_refused_without_a_traceback(tiny, cookie):
    with others_served(tiny.url, AUTH):
        for path in ("/dashboard", "/dashboard/events"):
            cookie_header = f"iterserve_dashboard={cookie}".encode("latin-1", "replace")  # as a client sends it
            r = httpx.get(f"{tiny.url}{path}", headers={"Cookie": cookie_header}, timeout=30)
            assert r.status_code == 401, r.text
            if path.endswith("events"):  # the page itself answers with its login form
                assert r.json()["error"]["type"] == "authentication_error"
    wait_until_idle(tiny)


# -- also: half-sent bodies, liveness ----------------------------------------------------------------


def test_a_half_sent_body_is_timed_out_with_408(tiny):
    host, port = tiny.url.removeprefix("http://").split(":")
    with others_served(tiny.url, AUTH):
        socks = []
        for _ in range(20):
            sock = socket.create_connection((host, int(port)))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"pro")
            socks.append(sock)
        for sock in socks:
            sock.settimeout(BODY_TIMEOUT_S + 20)
            answer = b""
            while chunk := sock.recv(65536):  # the server closes the connection after its answer
                answer += chunk
            sock.close()
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert b"request_timeout" in answer
    wait_until_idle(tiny)


@pytest.mark.slow
def test_health_reports_a_core_that_stopped_stepping():
    app = build_app(tiny_config(), ServerConfig(served_model_name=MODEL, engine_stall_timeout=2.0))
    with ServerThread(app) as s:
        body = {"prompt": [1, 2, 3], "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            pid = s.engine.pids[0]
            os.kill(pid, signal.SIGSTOP)
            try:
                deadline = time.monotonic() + 30
                while (health := httpx.get(f"{s.url}/health", timeout=10)).status_code == 200:
                    assert time.monotonic() < deadline, "/health never noticed the stopped core"
                    time.sleep(0.2)
                assert health.status_code == 503 and "no progress" in health.json()["error"]["message"]
            finally:
                os.kill(pid, signal.SIGCONT)
            events = sse_events(lines)
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert httpx.get(f"{s.url}/health", timeout=10).status_code == 200
        idle_start = time.monotonic()
        while time.monotonic() - idle_start < 3:  # an idle core sends nothing, and that is not a stall
            assert httpx.get(f"{s.url}/health", timeout=10).status_code == 200
            time.sleep(0.5)


# -- also: fair admission of many prompts ------------------------------------------------------------


def finished_requests(server: ServerThread) -> float:
    """Engine requests ended so far, whatever the reason: every one a core was sent."""
    return sum(v for (name, _), v in metric_samples(server).items() if name == "vllm:request_success_total")


def test_a_request_of_many_prompts_leaves_room_for_others(tiny):
    """80 prompts where 64 may wait: they go 16 at a time (a quarter of the queue), and others get in."""
    many = {"prompt": [[7, i + 1] for i in range(80)], "max_tokens": 8, "ignore_eos": True, "stream": True}
    with others_served(tiny.url, AUTH):
        with httpx.stream("POST", f"{tiny.url}/v1/completions", json=many, headers=AUTH, timeout=300) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            others = [post(tiny, "/v1/completions", {"prompt": [5, i], "max_tokens": 2}) for i in range(3)]
            assert [o.status_code for o in others] == [200] * 3, [o.text for o in others]
            events = sse_events(lines)
    finished = [c["index"] for e in events for c in e["choices"] if c.get("finish_reason") == "length"]
    assert sorted(finished) == list(range(80))
    wait_until_idle(tiny)


def test_a_request_of_many_prompts_that_leaves_sends_no_more_of_them(tiny):
    """The prompts not yet sent when the client disconnects are never sent; nothing is left behind."""
    sent_before, aborted_before = finished_requests(tiny), aborted(tiny)
    many = {"prompt": [[7, i + 1] for i in range(80)], "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        post(tiny, "/v1/completions", many, timeout=3)
    wait_until_idle(tiny, timeout=30)
    assert finished_requests(tiny) - sent_before == 16  # its share of the queue (64 / 4); 64 never went
    assert aborted(tiny) - aborted_before == 16
    assert tiny.engine.num_requests == 0


# -- also: prompt_logprobs ---------------------------------------------------------------------------


def test_prompt_logprobs_on_completions_are_returned(tiny):
    prompt = [1, 400, 500, 600]
    r = post(tiny, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(prompt) and entries[0] is None
    for token, entry in zip(prompt[1:], entries[1:]):
        assert str(token) in entry and 2 <= len(entry) <= 3  # the prompt's token and the top 2
        assert all(v["logprob"] <= 0 and v["rank"] >= 1 for v in entry.values())
    streamed = post(tiny, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 2,
                                              "stream": True})
    assert_error(streamed, 400, "prompt_logprobs")
    assert_error(post(tiny, "/v1/completions", {"prompt": prompt, "prompt_logprobs": 21}), 400, "prompt_logprobs")

"""The chat stream as vLLM's own clients read it: the role chunk comes with the first token, so a client
that takes its first chunk with ``choices`` as the first token (``vllm bench serve --backend
openai-chat``) measures the real time to first token."""

from __future__ import annotations

import json
import time

import openai

from tests.server.conftest import API_KEY, MODEL, ServerThread

LONG_CHAT = [{"role": "user", "content": "Summarise this. " + "The quick brown fox jumps over the lazy dog. " * 60}]


def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def traced_request(trace_path, request_id: str) -> dict:
    for line in trace_path.read_text().splitlines():
        record = json.loads(line)
        if record.get("type") == "request" and record["request_id"] == request_id:
            return record
    raise AssertionError(f"{request_id} is not in the step trace")


def test_the_role_chunk_comes_with_the_first_token(server, trace_path):
    """No chunk with ``choices`` reaches the client before the engine has sampled the first token.

    Both clocks are ``time.perf_counter`` (the system's monotonic clock), so the client's receive
    time and the core's first-token time compare across the two processes. A 600-token prompt
    takes the core long enough to prefill that a role chunk sent before the engine answers
    arrives well before the first token.
    """
    received = []
    stream = client(server).chat.completions.create(model=MODEL, messages=LONG_CHAT, max_tokens=4, temperature=0,
                                                    stream=True)
    for chunk in stream:
        received.append((time.perf_counter(), chunk))
    with_choices = [(t, c) for t, c in received if c.choices]
    first_time, first = with_choices[0]
    assert first.choices[0].delta.role == "assistant"
    assert sum(c.choices[0].delta.role == "assistant" for _, c in with_choices) == 1
    record = traced_request(trace_path, first.id)
    assert first_time >= record["first_token_time"], (
        f"the first chunk came {record['first_token_time'] - first_time:.3f} s before the first token")
    assert "".join(c.choices[0].delta.content or "" for _, c in with_choices)


def test_each_choice_gets_its_role_once(server):
    chunks = list(client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=1.0, seed=3, n=3,
        stream=True))
    roles = [ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1, 2]
    for index in range(3):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == index]
        assert mine[0].delta.role == "assistant" and all(c.delta.role is None for c in mine[1:])

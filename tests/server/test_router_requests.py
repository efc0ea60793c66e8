"""Requests as the routers (vllm-router, sglang-router) forward them: explicit nulls for unset OpenAI
fields mean the defaults, and SGLang's extra fields are logged once per name, not once per request."""

from __future__ import annotations

import logging

import httpx
import pytest

from iterserve.server.request_fields import IGNORED_FIELDS, forget_reported
from tests.server.conftest import API_KEY, MODEL, ServerThread

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "user", "content": "Name a colour."}]
# what sglang-router adds to a chat request it forwards (SGLang's protocol fields, at their defaults)
ROUTER_FIELDS = {"include_reasoning": True, "no_stop_trim": False, "separate_reasoning": True,
                 "stream_reasoning": True, "return_hidden_states": False, "rid": None, "lora_path": None,
                 "session_params": None, "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None}
SAMPLING_NULLS = {"stream": None, "n": None, "presence_penalty": None, "frequency_penalty": None,
                  "repetition_penalty": None, "top_k": None, "min_p": None, "min_tokens": None, "ignore_eos": None,
                  "stream_options": None, "seed": None, "stop": None, "temperature": None, "top_p": None}


def post(server: ServerThread, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", headers=AUTH, json=body, timeout=120)


def test_chat_completions_take_nulls_as_defaults(server):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **SAMPLING_NULLS, "logprobs": None,
            "top_logprobs": None, "parallel_tool_calls": None, "tools": None, "tool_choice": None,
            "max_completion_tokens": None, "echo": None, "add_generation_prompt": None}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["logprobs"] is None


def test_completions_take_nulls_as_defaults(server):
    body = {"model": MODEL, "prompt": "The sky is", "max_tokens": 2, **SAMPLING_NULLS, "logprobs": None,
            "echo": None, "best_of": None, "suffix": None, "prompt_logprobs": None}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1


def test_responses_take_nulls_as_defaults(server):
    body = {"model": MODEL, "input": "Name a colour.", "max_output_tokens": 2, "stream": None, "store": None,
            "background": None, "parallel_tool_calls": None, "temperature": None, "top_p": None, "tools": None,
            "tool_choice": None, "instructions": None, "text": None, "truncation": None, "reasoning": None,
            "previous_response_id": None, "include": None, "metadata": None, "user": None}
    r = post(server, "/v1/responses", body)
    assert r.status_code == 200, r.text
    assert r.json()["status"] in ("completed", "incomplete") and r.json()["output"]


@pytest.mark.parametrize("value", [2.0, True, "2"])
def test_integer_fields_still_refuse_other_types(server, value):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1, "n": value})
    assert r.status_code == 400, r.text


def test_router_fields_are_logged_once_not_per_request(server, caplog):
    forget_reported()
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1, **ROUTER_FIELDS}
    with caplog.at_level(logging.INFO, logger="iterserve.server.protocol"), \
            httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
        for _ in range(80):
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
    lines = [rec for rec in caplog.records if rec.name == "iterserve.server.protocol"]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO, [rec.getMessage() for rec in lines]
    assert all(name in lines[0].getMessage() for name in ROUTER_FIELDS)
    assert set(ROUTER_FIELDS) <= IGNORED_FIELDS

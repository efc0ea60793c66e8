"""vLLM's request fields beyond OpenAI's, sent as vLLM's users send them (the openai client's extra_body):
each has its effect, and a field the server does not know is named in a log line, as vLLM logs it."""

from __future__ import annotations

import logging

import httpx
import openai

from tests.server.conftest import API_KEY, MODEL, ServerThread

COLOUR = [{"role": "user", "content": "Name a colour."}]


def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_include_stop_str_in_output(server):
    c = client(server)
    plain = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    word = plain.choices[0].text.split()[0]
    for keep in (False, True):
        r = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0,
                                 stop=[word], extra_body={"include_stop_str_in_output": keep})
        assert r.choices[0].text.endswith(word) == keep, r.choices[0].text
    r = c.chat.completions.create(model=MODEL, messages=COLOUR, max_tokens=8, temperature=0)
    word = r.choices[0].message.content.split()[0]
    r = c.chat.completions.create(model=MODEL, messages=COLOUR, max_tokens=8, temperature=0, stop=[word],
                                  extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].message.content.endswith(word)


def test_bad_words_and_allowed_token_ids(server):
    c = client(server)
    plain = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    word = plain.choices[0].text.split()[0]
    r = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0,
                             extra_body={"bad_words": [word]})
    assert word not in r.choices[0].text.split()
    allowed = httpx.post(f"{server.url}/tokenize", headers={"Authorization": f"Bearer {API_KEY}"},
                         json={"prompt": " yes no", "add_special_tokens": False}).json()["tokens"]
    r = c.completions.create(model=MODEL, prompt="Answer:", max_tokens=6, temperature=1.0, seed=0, logprobs=0,
                             extra_body={"allowed_token_ids": allowed})
    assert set(r.choices[0].text.split()) <= {"yes", "no"} and r.choices[0].text
    try:
        c.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"allowed_token_ids": [10**9]})
        raise AssertionError("an id outside the vocabulary was accepted")
    except openai.BadRequestError as e:
        assert "allowed_token_ids" in str(e)


def test_chat_template_and_its_kwargs(server):
    template = "{{ greeting }} {% for m in messages %}{{ m['content'] }}{% endfor %}"
    r = client(server).chat.completions.create(
        model=MODEL, messages=COLOUR, max_tokens=2, temperature=0,
        extra_body={"chat_template": template, "chat_template_kwargs": {"greeting": "Hello there!"}})
    expected = httpx.post(f"{server.url}/tokenize", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"prompt": "Hello there! Name a colour.", "add_special_tokens": False}).json()
    assert r.usage.prompt_tokens == expected["count"]


def test_continue_final_message_with_echo(server):
    start = "My favourite colour is"
    messages = [*COLOUR, {"role": "assistant", "content": start}]
    options = {"add_generation_prompt": False, "continue_final_message": True, "echo": True}
    r = client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                               extra_body=options)
    whole = r.choices[0].message.content
    assert whole.startswith(start) and len(whole) > len(start)
    stream = client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                    stream=True, extra_body=options)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == whole
    try:
        client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                               extra_body={"continue_final_message": True})
        raise AssertionError("continue_final_message with add_generation_prompt was accepted")
    except openai.BadRequestError as e:
        assert "continue_final_message" in str(e)


def test_tokenize_returns_token_strings(server):
    body = httpx.post(f"{server.url}/tokenize", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert len(body["token_strs"]) == body["count"] and "world" in "".join(body["token_strs"]).replace("Ġ", " ")


def test_unknown_fields_are_named_in_a_log_line(server, caplog):
    with caplog.at_level(logging.WARNING, logger="iterserve.server.protocol"):
        r = client(server).chat.completions.create(model=MODEL, messages=COLOUR, max_tokens=2,
                                                   extra_body={"no_such_option": 1})
    assert r.choices[0].message.content is not None
    assert any("no_such_option" in rec.getMessage() and "ignored" in rec.getMessage() for rec in caplog.records)

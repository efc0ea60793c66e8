"""Structured output and tool calls through the HTTP server with the official openai client:
json_schema responses that validate, vLLM's guided_* extensions, named and required tool calls
(streamed and not), tool messages in the conversation, and bad constraints refused with a 400."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, MODEL, ServerThread, wait_until_idle

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "likes_cats": {"type": "boolean"},
    },
    "required": ["name", "age", "likes_cats"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris?"}]


def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def is_person(value: object) -> bool:
    """PERSON's constraints, checked by hand."""
    return (isinstance(value, dict) and set(value) == {"name", "age", "likes_cats"}
            and isinstance(value["name"], str) and len(value["name"]) <= 16
            and type(value["age"]) is int and 0 <= value["age"] <= 120
            and isinstance(value["likes_cats"], bool))


def is_weather_call(arguments: str) -> bool:
    value = json.loads(arguments)
    return (set(value) == {"city", "unit"} and isinstance(value["city"], str) and len(value["city"]) <= 24
            and value["unit"] in ("celsius", "fahrenheit"))


def test_json_schema_responses_validate_for_20_seeded_prompts(server):
    names = ["Ada", "Bob", "Chen", "Dana", "Eve", "Femi", "Gus", "Hana", "Ivan", "Jo"]

    async def one(c: openai.AsyncOpenAI, i: int) -> tuple[str, str]:
        r = await c.chat.completions.create(
            model=MODEL, temperature=1.0, seed=i, max_tokens=160,
            messages=[{"role": "user", "content": f"Describe a person called {names[i % 10]} as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                    "strict": True}},
        )
        return r.choices[0].message.content, r.choices[0].finish_reason

    async def burst() -> list[tuple[str, str]]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                                      timeout=300) as c:
            return await asyncio.gather(*(one(c, i) for i in range(20)))

    results = asyncio.run(burst())
    for text, finish_reason in results:
        assert finish_reason == "stop", text
        assert is_person(json.loads(text)), text
    assert len({text for text, _ in results}) > 1  # temperature 1 really sampled
    wait_until_idle(server)


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_with_a_json_schema_each_validate(server, stream):
    body = dict(model=MODEL, temperature=1.0, seed=11, max_tokens=160, n=3,
                messages=[{"role": "user", "content": "Describe a person called Ada as JSON."}],
                response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    if stream:
        texts = ["", "", ""]
        for chunk in client(server).chat.completions.create(**body, stream=True):
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
    else:
        texts = [c.message.content for c in client(server).chat.completions.create(**body).choices]
    assert len(texts) == 3 and all(is_person(json.loads(text)) for text in texts), texts
    assert len(set(texts)) > 1
    wait_until_idle(server)


def test_json_object_and_guided_extensions(server):
    c = client(server)
    r = c.chat.completions.create(model=MODEL, messages=ASK_WEATHER, temperature=1.0, seed=3, max_tokens=200,
                                  response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # a free-form object may run out of tokens; what there is must still be the start of one
        assert r.choices[0].message.content.startswith("{")
    colors = ["red", "green", "light blue"]
    for seed in range(3):
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Pick a color."}],
                                      temperature=1.0, seed=seed, max_tokens=10, extra_body={"guided_choice": colors})
        assert r.choices[0].message.content in colors
    pattern = r"[A-Z]{2}-[0-9]{4}"
    r = c.completions.create(model=MODEL, prompt="A licence plate:", temperature=1.0, seed=1, max_tokens=20,
                             extra_body={"guided_regex": pattern})
    assert re.fullmatch(pattern, r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = c.completions.create(model=MODEL, prompt="Yes or no?", temperature=1.0, seed=2, max_tokens=5,
                             extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].text in ("yes", "no")


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
])
def test_bad_constraints_get_a_400_naming_the_parameter(server, body, param):
    r = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": MODEL, "messages": ASK_WEATHER, "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_named_tool_call(server):
    r = client(server).chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, TIME], temperature=1.0, seed=5, max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert is_weather_call(call.function.arguments)


def test_named_tool_call_streamed(server):
    chunks = list(client(server).chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], temperature=1.0, seed=6, max_tokens=80, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    ))
    deltas = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
    first, rest = deltas[0], deltas[1:]
    assert first.id.startswith("call_") and first.type == "function" and first.function.name == "get_weather"
    assert first.function.arguments == ""
    assert rest and all(d.id is None and d.function.name is None and d.index == 0 for d in rest)
    assert is_weather_call("".join(d.function.arguments for d in rest))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(ch.choices[0].delta.content for ch in chunks)


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_calls(server, stream):
    kw = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, TIME], tool_choice="required", temperature=1.0,
              seed=7, max_tokens=160, parallel_tool_calls=False)
    if stream:
        deltas = [d for ch in client(server).chat.completions.create(stream=True, **kw)
                  for d in (ch.choices[0].delta.tool_calls or [])]
        head, pieces = deltas[0], deltas[1:]
        assert head.id.startswith("call_") and head.function.arguments == ""
        assert len(pieces) > 1 and all(d.id is None and d.function.name is None and d.index == 0 for d in pieces)
        calls = [(head.function.name, "".join(d.function.arguments for d in pieces))]
    else:
        r = client(server).chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "tool_calls"
        calls = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
    [(name, arguments)] = calls
    if name == "get_weather":
        assert is_weather_call(arguments)
    else:
        assert name == "get_time" and set(json.loads(arguments)) == {"zone"}


def test_auto_tool_call_streamed_in_pieces(server):
    """"auto" reads a Hermes block as it is written (a regex makes this model write one): the call's head
    once its name is complete, then its arguments in pieces, as vLLM streams them."""
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>'
    chunks = list(client(server).chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], temperature=0, max_tokens=60, stream=True,
        extra_body={"guided_regex": "Sure\\. " + re.escape(call)}))
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    deltas = [d for ch in chunks if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
    head, pieces = deltas[0], deltas[1:]
    assert content == "Sure. "
    assert head.id.startswith("call_") and head.function.name == "get_weather" and head.function.arguments == ""
    assert len(pieces) > 1 and all(d.id is None and d.index == 0 for d in pieces)
    assert json.loads("".join(d.function.arguments for d in pieces)) == {"city": "Paris", "unit": "celsius"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_answers_in_text_and_tool_turns_are_accepted(server):
    """SmolLM2's template has no tool format: "auto" gives plain content, and a conversation holding
    an assistant tool call and the tool's answer is rendered (the call as Hermes text)."""
    c = client(server)
    r = c.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], temperature=0, max_tokens=8)
    assert r.choices[0].message.tool_calls in (None, []) and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    conversation = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18}'},
    ]
    tokens = httpx.post(f"{server.url}/tokenize", headers={"Authorization": f"Bearer {API_KEY}"},
                        json={"model": MODEL, "messages": conversation}, timeout=60)
    assert tokens.status_code == 200, tokens.text
    prompt = httpx.post(f"{server.url}/detokenize", headers={"Authorization": f"Bearer {API_KEY}"},
                        json={"model": MODEL, "tokens": tokens.json()["tokens"]}, timeout=60).json()["prompt"]
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"' in prompt
    assert 'tool\n{"temperature": 18}\nassistant' in prompt  # the tool's answer, as its own turn
    r = c.chat.completions.create(model=MODEL, messages=conversation, tools=[WEATHER], temperature=0, max_tokens=8)
    assert r.choices[0].message.content


# A tool as clients write it most often: no additionalProperties, so a grammar compiled as written lets
# the model add keys until max_tokens runs out.
OPEN_WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"]}}}


@pytest.mark.parametrize("seed", range(3))
def test_required_tool_call_with_an_open_schema_ends_as_a_call(server, seed):
    r = client(server).chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[OPEN_WEATHER], tool_choice="required", temperature=1.0,
        seed=seed, max_tokens=120)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
    [call] = r.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert "city" in arguments and set(arguments) <= {"city", "unit"}


def test_open_response_schema_keeps_to_its_properties(server):
    schema = {k: v for k, v in PERSON.items() if k != "additionalProperties"}
    for seed in range(3):
        r = client(server).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}], temperature=1.0,
            seed=seed, max_tokens=120,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
        assert r.choices[0].finish_reason == "stop"
        assert is_person(json.loads(r.choices[0].message.content))


def test_a_forced_call_cut_off_by_max_tokens_still_parses(server):
    r = client(server).chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], temperature=1.0, seed=1, max_tokens=6,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    [call] = choice.message.tool_calls
    assert isinstance(json.loads(call.function.arguments), dict)
    r = client(server).chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required", temperature=1.0, seed=1,
        max_tokens=8)
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)


def test_vllm_gbnf_example(server):
    """vLLM's documented GBNF example, sent as its docs send it."""
    from tests.engine.test_grammar import SIMPLIFIED_SQL_GRAMMAR

    r = client(server).chat.completions.create(
        model=MODEL, temperature=0, max_tokens=40,
        messages=[{"role": "user", "content": "Generate an SQL query to show the 'username' and 'email' from the "
                                              "'users' table."}],
        extra_body={"structured_outputs": {"grammar": SIMPLIFIED_SQL_GRAMMAR}})
    assert re.fullmatch(r"SELECT col_[12]  from table_[12]  where col_[12] = [12] ", r.choices[0].message.content)
    r = client(server).completions.create(model=MODEL, prompt="SQL:", max_tokens=40, temperature=0,
                                          extra_body={"guided_grammar": SIMPLIFIED_SQL_GRAMMAR})
    assert r.choices[0].text.startswith("SELECT col_")

"""``POST /v1/responses`` on SmolLM2-135M with the official openai client: text equal to the chat
endpoint's greedy answer, the semantic stream events (their deltas adding up to the same text),
structured output through ``responses.parse``, function calls (made, and sent back as input items),
``max_output_tokens`` ending incomplete, refused options, and an aborted stream freeing its blocks."""

from __future__ import annotations

import json
import logging

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import API_KEY, MODEL, ServerThread, aborted, metric_samples, wait_until_idle

AUTH = {"Authorization": f"Bearer {API_KEY}"}
QUESTION = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                          "required": ["city"], "additionalProperties": False}}


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)


def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def post(server: ServerThread, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/responses", headers=AUTH, json={"model": MODEL, **body}, timeout=120)


def test_text_equals_the_chat_answer(server):
    c = client(server)
    chat = c.chat.completions.create(model=MODEL, temperature=0, max_completion_tokens=20,
                                     messages=[{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": QUESTION}])
    r = c.responses.create(model=MODEL, instructions="Be brief.", input=QUESTION, temperature=0,
                           max_output_tokens=20, metadata={"run": "1"}, store=False)
    assert r.output_text and r.output_text == chat.choices[0].message.content
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL and r.metadata == {"run": "1"}
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [(p.type, p.annotations) for p in message.content] == [("output_text", [])]
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    u = r.usage
    assert (u.input_tokens, u.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.output_tokens_details.reasoning_tokens == 0
    # the same conversation as message items with content parts
    items = c.responses.create(model=MODEL, temperature=0, max_output_tokens=20, input=[
        {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"role": "user", "content": QUESTION}])
    assert items.output_text == r.output_text


def test_stream_events_add_up_to_the_greedy_text(server):
    c = client(server)
    whole = c.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=24)
    events = list(c.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=24, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    item_id = events[2].item.id
    assert len(deltas) > 1 and all((d.item_id, d.output_index, d.content_index) == (item_id, 0, 0) for d in deltas)
    text = "".join(d.delta for d in deltas)
    assert text == whole.output_text and events[-4].text == text
    final = events[-1].response
    assert final.output_text == text and final.id == events[0].response.id and final.output[0].id == item_id
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_parse_gives_json_that_validates(server):
    r = client(server).responses.parse(model=MODEL, input="Describe a person called Ada.", temperature=0,
                                       max_output_tokens=60, text_format=Person)
    assert r.status == "completed"
    assert isinstance(r.output_parsed, Person) and Person.model_validate_json(r.output_text) == r.output_parsed
    body = post(server, {"input": "Give me a JSON object.", "max_output_tokens": 30, "temperature": 0,
                         "text": {"format": {"type": "json_object"}}}).json()
    assert body["output"][0]["content"][0]["text"].startswith("{") and body["text"]["format"]["type"] == "json_object"


def test_required_tool_gives_a_function_call_and_its_output_goes_back(server):
    c = client(server)
    r = c.responses.create(model=MODEL, input="What is the weather like in Paris?", tools=[WEATHER],
                           tool_choice="required", temperature=0, max_output_tokens=60)
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert set(json.loads(call.arguments)) == {"city"} and r.status == "completed" and r.output_text == ""
    follow = c.responses.create(model=MODEL, tools=[WEATHER], temperature=0, max_output_tokens=20, input=[
        {"role": "user", "content": "What is the weather like in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    assert follow.output_text and follow.usage.input_tokens > r.usage.input_tokens

    events = list(c.responses.create(model=MODEL, input="What is the weather like in Paris?", tools=[WEATHER],
                                     tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                     max_output_tokens=60, stream=True))
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.arguments == ""
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert len(pieces) > 1 and "".join(pieces) == done.arguments and done.item_id == added.item.id
    assert set(json.loads(done.arguments)) == {"city"} and events[-1].response.output[0].arguments == done.arguments


def test_max_output_tokens_ends_incomplete(server):
    r = client(server).responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete" and r.output_text
    events = list(client(server).responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=3,
                                                  stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == r.output_text


@pytest.mark.parametrize("body, param", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "function", "parameters": {}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"$ref": "#/$defs/missing"}}],
      "tool_choice": "required"}, "tools"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"$ref": "#/$defs/missing"}}}}, "text"),
    ({"text": {"format": {"type": "yaml"}}}, "text"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x" * 20_000}, "input"),
])
def test_refused_fields_get_a_400_naming_them(server, body, param):
    r = post(server, {"input": QUESTION, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"], r.text


def test_unknown_fields_are_dropped_and_named_in_a_log_line(server, caplog):
    with caplog.at_level(logging.WARNING, logger="iterserve.server.protocol"):
        r = client(server).responses.create(model=MODEL, input=QUESTION, max_output_tokens=2,
                                            extra_body={"no_such_field_2": 1})
    assert r.output_text
    assert any("no_such_field_2" in rec.getMessage() and "ignored" in rec.getMessage() for rec in caplog.records)


def test_stream_disconnect_aborts_and_frees_blocks(server):
    before = aborted(server)
    body = {"model": MODEL, "input": "Tell me a long story.", "max_output_tokens": 800, "stream": True}
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c, \
            c.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        kinds = [json.loads(next(lines).removeprefix("data: "))["type"] for _ in range(6)]
        assert kinds.count("response.output_text.delta") >= 1
        assert metric_samples(server)[("vllm:num_requests_running", ())] == 1
    assert wait_until_idle(server, timeout=5.0) < 5.0
    assert aborted(server) == before + 1

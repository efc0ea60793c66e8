"""A Responses request as the chat request that answers it, without a model: input items as messages,
flat function tools and tool_choice in their chat shapes, text.format as an output constraint."""

from __future__ import annotations

import json

import pytest

from iterserve.server.errors import APIError
from iterserve.server.protocol_responses import ResponsesRequest

TOOL = {"type": "function", "name": "add", "description": "Add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}


def test_items_become_chat_messages_and_calls_join_their_assistant_turn():
    body = ResponsesRequest(instructions="Be brief.", tools=[TOOL], tool_choice={"type": "function", "name": "add"},
                            max_output_tokens=7, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Add 1"}, {"type": "input_text", "text": "and 2"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Adding."}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1, "b": 2}'},
        {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a": 0, "b": 0}'},
        {"type": "function_call_output", "call_id": "c1", "output": "3"},
        {"type": "function_call", "call_id": "c3", "name": "add", "arguments": "{}"}])
    chat = body.chat_request()
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert [(m["role"], m.get("content")) for m in messages] == [
        ("system", "Be brief."), ("user", "Add 1\nand 2"), ("assistant", "Adding."), ("tool", "3"), ("assistant", None)]
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"] and messages[3]["tool_call_id"] == "c1"
    assert json.loads(messages[2]["tool_calls"][0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert [c["id"] for c in messages[4]["tool_calls"]] == ["c3"]
    assert chat.tools[0].function.model_dump() == {"name": "add", "description": "Add two numbers",
                                                   "parameters": TOOL["parameters"], "strict": None}
    assert chat.tool_choice == {"type": "function", "function": {"name": "add"}}
    assert chat.requested_max_tokens == 7
    assert ResponsesRequest(input="hi").chat_request().messages[0].model_dump(exclude_none=True) == {
        "role": "user", "content": "hi"}


def test_text_format_becomes_an_output_constraint():
    schema = {"type": "object", "properties": {"x": {"type": "string"}}}
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    assert json.loads(ResponsesRequest(input="x", text={"format": fmt}).format_constraint().json) == schema
    assert ResponsesRequest(input="x", text={"format": {"type": "json_object"}}).format_constraint().json_object
    assert ResponsesRequest(input="x", text={"format": {"type": "text"}}).format_constraint() is None
    assert ResponsesRequest(input="x").format_constraint() is None


@pytest.mark.parametrize("body, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
])
def test_options_that_need_storage_or_features_we_lack_are_refused(body, param):
    with pytest.raises(APIError) as e:
        ResponsesRequest(input="x", **body).check_supported()
    assert e.value.status_code == 400 and e.value.param == param
    ResponsesRequest(input="x", store=True, reasoning={"effort": None}, truncation="disabled").check_supported()

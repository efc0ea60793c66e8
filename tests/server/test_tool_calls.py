"""The tool-call plan and parsers without a model: Hermes blocks, streamed deltas, the grammars
tool_choice compiles to, and assistant tool calls written out for templates without a tool format."""

from __future__ import annotations

import json

import pytest

from iterserve.server.errors import APIError
from iterserve.server.protocol import ChatCompletionRequest
from iterserve.server.tool_calls import ToolCallPlan, ToolCallStream, parse_hermes, render_tool_calls_as_text

TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


def plan(**kw) -> ToolCallPlan:
    return ToolCallPlan.of(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw))


def test_hermes_blocks_become_calls_and_the_text_before_them_content():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n' \
           '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'
    content, calls = parse_hermes(text)
    assert content == "Let me add."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]
    assert len({c.id for c in calls}) == 2
    assert parse_hermes("no calls here") == ("no calls here", [])
    broken = "x <tool_call>{not json}</tool_call>"
    assert parse_hermes(broken) == (broken, [])  # nothing the model wrote is lost


def test_plans():
    assert plan().mode == "none" and plan(tools=[TOOL], tool_choice="none").mode == "none"
    assert plan(tools=[TOOL]).mode == "auto" and plan(tools=[TOOL]).constraint is None
    named = plan(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "add"}})
    assert named.mode == "named" and json.loads(named.constraint.json) == TOOL["function"]["parameters"]
    required = plan(tools=[TOOL], tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(required.constraint.json)
    assert schema["type"] == "array" and schema["maxItems"] == 1
    content, calls = required.parse('[{"name": "add", "parameters": {"a": 1, "b": 2}}]')
    assert content is None and calls[0].function.name == "add"
    assert json.loads(calls[0].function.arguments) == {"a": 1, "b": 2}
    with pytest.raises(APIError) as e:
        plan(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "sub"}})
    assert e.value.param == "tool_choice"


def test_auto_stream_holds_back_only_what_may_start_a_call():
    stream = ToolCallStream(plan(tools=[TOOL]))
    sent = [stream.feed(piece) for piece in ["Sure", ", <tool", "_call>{\"name\": \"add\", ", '"arguments": {}}']]
    assert [content for content, _ in sent] == ["Sure", ", ", "", ""]
    calls = [d for _, deltas in sent for d in deltas]
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == [(0, "add", ""), (0, None, "{}")]
    assert stream.finish() == ("", []) and stream.has_calls

    plain = ToolCallStream(plan(tools=[TOOL]))
    assert plain.feed("a <") == ("a ", []) and plain.feed("b") == ("<b", []) and plain.feed(" <t") == (" ", [])
    assert plain.finish() == ("<t", []) and not plain.has_calls


def test_named_stream_sends_the_head_then_argument_pieces():
    stream = ToolCallStream(plan(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "add"}}))
    _, first = stream.feed('{"a"')
    head, piece = first
    assert head.id and head.type == "function" and head.function.name == "add" and head.function.arguments == ""
    assert piece.id is None and piece.function.arguments == '{"a"'
    content, [again] = stream.feed(": 1}")
    assert content == "" and again.model_dump() == {"index": 0, "function": {"arguments": ": 1}"}}
    assert head.model_dump() == {"index": 0, "id": head.id, "type": "function",
                                 "function": {"name": "add", "arguments": ""}}
    assert piece.model_dump() == {"index": 0, "function": {"arguments": '{"a"'}}


def streamed(stream: ToolCallStream, text: str, size: int = 3) -> tuple[str, list]:
    """Feed ``text`` in pieces of ``size`` characters, then finish: the content and every delta sent."""
    sent = [stream.feed(text[i:i + size]) for i in range(0, len(text), size)] + [stream.finish()]
    return "".join(c for c, _ in sent), [d for _, deltas in sent for d in deltas]


def calls_of(deltas: list) -> list[tuple[str, str]]:
    """(name, arguments) per call index, as a client adds the deltas up."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.id is not None:
            assert d.index not in calls and d.function.arguments == ""  # the head comes first, once
            calls[d.index] = [d.function.name, ""]
        else:
            assert d.function.name is None
            calls[d.index][1] += d.function.arguments
    return [(name, arguments) for name, arguments in calls.values()]


def test_required_stream_sends_each_calls_head_then_argument_pieces():
    text = '[{"name": "add", "parameters": {"a": 1, "b": {"c": "}\\" ,"}}}, {"name": "add", "parameters": {"a": 2}}]'
    content, deltas = streamed(ToolCallStream(plan(tools=[TOOL], tool_choice="required")), text)
    assert content == ""
    assert calls_of(deltas) == [("add", '{"a": 1, "b": {"c": "}\\" ,"}}'), ("add", '{"a": 2}')]
    assert sum(d.index == 0 and d.id is None for d in deltas) > 3  # pieces, as they were generated
    assert deltas[0].id and deltas[1].id is None  # the arguments begin right after the head
    # cut off after the name: a head and, at the end, the empty arguments the whole-text parser gives
    stream = ToolCallStream(plan(tools=[TOOL], tool_choice="required"))
    assert calls_of(streamed(stream, '[{"name": "add", "param')[1]) == [("add", "{}")] and stream.has_calls
    # cut off before a name: nothing is a call, the text is the content
    stream = ToolCallStream(plan(tools=[TOOL], tool_choice="required"))
    assert streamed(stream, '[{"na') == ('[{"na', []) and not stream.has_calls


def test_auto_stream_sends_hermes_calls_in_pieces():
    text = ('Adding.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>{"arguments": "{\\"a\\": 3}", "name": "add"}</tool_call>')
    content, deltas = streamed(ToolCallStream(plan(tools=[TOOL])), text)
    assert content == "Adding.\n"
    assert calls_of(deltas) == [("add", '{"a": 1, "b": 2}'), ("add", '{"a": 3}')]  # a string is sent unquoted
    assert sum(d.index == 0 and d.id is None for d in deltas) > 3
    assert [d.index for d in deltas if d.id] == [0, 1]
    broken = "x <tool_call>{not json}</tool_call>"
    stream = ToolCallStream(plan(tools=[TOOL]))
    assert streamed(stream, broken) == (broken, []) and not stream.has_calls  # nothing the model wrote is lost


def test_tool_calls_are_written_out_for_templates_without_a_tool_format():
    messages = [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                      "function": {"name": "add", "arguments": '{"a": 1}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    rendered = render_tool_calls_as_text(messages, "{{ message['content'] }}")
    call = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    assert rendered[0] == {"role": "assistant", "content": call}
    assert rendered[1] == messages[1]
    assert render_tool_calls_as_text(messages, "{% if message.tool_calls %}") is messages

"""Tool calls for chat completions: a grammar where the call is forced, a parser where it is not.

``tool_choice`` naming a function constrains the output to a JSON object valid for that function's
``parameters`` schema, and ``"required"`` to a JSON array of ``{"name", "parameters"}`` objects, one
of the tools each (as vLLM does), so both work for any model. ``"auto"`` leaves the model free and
reads the Hermes format (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, Qwen2/Qwen3 and
others) out of its text; a model whose chat template has no tool format just answers in text.

Streaming follows OpenAI and vLLM: a call's first delta carries its id, type, name and empty arguments,
later deltas append argument text as it is generated. A named call's text is its arguments; for
"required" and "auto" a :class:`CallScanner` reads the JSON as it grows, sends a call's head once its
name is complete and then the raw text of its arguments value piece by piece.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import jiter

from iterserve.sampling_params import StructuredOutputsParams
from iterserve.server.errors import bad_request
from iterserve.server.protocol import ChatCompletionRequest, FunctionCall, ToolCall, structured_outputs_from
from iterserve.server.response_bodies import DeltaFunctionCall, DeltaToolCall

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(re.escape(HERMES_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(HERMES_CLOSE) + r"|$)", re.DOTALL)
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _tool_call(name: str, arguments: Any) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=_call_id(), function=FunctionCall(name=name, arguments=text))


@dataclass
class ToolCallPlan:
    """How one chat request treats its tools: mode none, auto, required or named (``function``)."""

    mode: str
    function: str | None = None
    constraint: StructuredOutputsParams | None = None

    @classmethod
    def of(cls, body: ChatCompletionRequest) -> ToolCallPlan:
        """The plan for ``body``; a 400 for a tool_choice that names no given tool."""
        choice = body.tool_choice
        if not body.tools or choice == "none":
            return cls("none")
        schemas = {t.function.name: t.function.parameters or ANY_OBJECT for t in body.tools}
        if choice is None or choice == "auto":
            return cls("auto")
        if choice == "required":
            calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                      "required": ["name", "parameters"], "additionalProperties": False}
                     for name, schema in schemas.items()]
            array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not body.parallel_tool_calls:
                array["maxItems"] = 1
            return cls("required", constraint=structured_outputs_from("tools", {"json": array}))
        function = choice.get("function") if isinstance(choice, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request("tool_choice must be 'none', 'auto', 'required' or "
                              "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        if name not in schemas:
            raise bad_request(f"tool_choice names the function {name!r}, which is not among the tools", "tool_choice")
        return cls("named", name, structured_outputs_from("tools", {"json": schemas[name]}))

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The message's content and tool calls from the whole generated text."""
        if self.mode == "none":
            return text, []
        if self.mode == "named":
            assert self.function is not None
            return None, [_tool_call(self.function, text if _is_json(text) else complete_json(text) or {})]
        if self.mode == "required":
            calls = complete_json(text)
            named = [c for c in calls if isinstance(c.get("name"), str)] if isinstance(calls, list) else []
            if not named:  # cut off before the first call had a name
                return text, []
            return None, [_tool_call(c["name"], c.get("parameters", {})) for c in named]
        return parse_hermes(text)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def complete_json(text: str) -> Any:
    """The JSON value ``text`` holds, or, when it was cut off (by max_tokens or a stop string), the value
    its complete part makes (an open string kept as far as it goes); None when nothing parses. A
    forced tool call's grammar makes the text a prefix of valid JSON, so the call always parses."""
    try:
        return jiter.from_json(text.encode(), partial_mode="trailing-strings")
    except ValueError:
        return None


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """Content before the first ``<tool_call>`` and the calls in the blocks; a block that is not a
    JSON object with a name stays in the content, so nothing the model wrote is lost."""
    start = text.find(HERMES_OPEN)
    if start < 0:
        return text, []
    calls = []
    for match in _HERMES_CALL.finditer(text, start):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        calls.append(_tool_call(call["name"], call.get("arguments", call.get("parameters", {}))))
    content = text[:start].strip()
    return content or None, calls


@dataclass
class _ScannedCall:
    """A call the scanner found: its name once complete, where its arguments value starts and ends."""

    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None  # None while the value is still being generated
    head_sent: bool = False
    sent: int = 0  # characters of the arguments value already sent

    def piece(self, text: str, finished: bool = False) -> str:
        """The arguments text not sent yet; at the end, ``{}`` for a call that never got any (as the
        whole-text parser gives). Arguments written as a JSON string go out unquoted, once complete."""
        if self.args_start is None:
            if finished and self.sent == 0:
                self.sent = 2
                return "{}"
            return ""
        raw = text[self.args_start:self.args_end if self.args_end is not None else len(text)]
        if text[self.args_start] == '"':
            if self.args_end is None or self.sent:
                return ""
            self.sent = len(raw)
            value = _loads(raw)
            return value if isinstance(value, str) else raw
        piece, self.sent = raw[self.sent:], len(raw)
        return piece


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


@dataclass
class CallScanner:
    """Reads call objects out of JSON text as it grows: a "required" array's items (``depth`` 2) or a
    Hermes block's object (``depth`` 1). It finds each call's name and the span of the raw text of its
    arguments value, so that the arguments can be sent while they are being generated. It stops at the
    end of the outermost value (the text after it is not its business)."""

    depth: int
    arg_keys: tuple[str, ...]
    calls: list[_ScannedCall] = field(default_factory=list)
    pos: int = 0  # characters of the text scanned
    level: int = 0  # nesting of objects and arrays at ``pos``
    started: bool = False
    in_string: bool = False
    escape: bool = False
    string_start: int = 0
    key: str | None = None  # the call's key whose value is being read
    expect: str = ""  # at the calls' level: "key", "value" (after a colon), or "" (in or after a value)

    @property
    def done(self) -> bool:
        return self.started and self.level == 0

    def scan(self, text: str) -> None:
        while self.pos < len(text) and not self.done:
            self._char(text, self.pos)
            self.pos += 1

    def _char(self, text: str, i: int) -> None:
        c = text[i]
        call = self.calls[-1] if self.calls else None
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
                if self.level == self.depth and call is not None:
                    self._string(call, _loads(text[self.string_start:i + 1]), i + 1)
            return
        if c.isspace():
            return
        if self.level == self.depth and call is not None and self.expect == "value":
            self.expect = ""
            if self.key in self.arg_keys and call.args_start is None:
                call.args_start = i
        if c == '"':
            self.in_string, self.string_start = True, i
        elif c in "{[":
            if c == "{" and self.level == self.depth - 1:
                self.calls.append(_ScannedCall())
                self.expect, self.key = "key", None
            self.level += 1
            self.started = True
        elif c in "}]":
            self.level -= 1
            if call is not None and self.level == self.depth - 1:  # the call closed: a number or literal ends
                self._value_end(call, i)
            elif call is not None and self.level == self.depth and self.key in self.arg_keys:
                if call.args_start is not None and call.args_end is None:
                    call.args_end = i + 1  # the arguments object closed
        elif self.level == self.depth and call is not None:
            if c == ":":
                self.expect = "value"
            elif c == ",":
                self._value_end(call, i)
                self.expect, self.key = "key", None

    def _string(self, call: _ScannedCall, value: Any, end: int) -> None:
        if self.expect == "key":
            self.key, self.expect = (value if isinstance(value, str) else None), ""
        elif self.key == "name" and isinstance(value, str) and call.name is None:
            call.name = value
        elif self.key in self.arg_keys and call.args_end is None:
            call.args_end = end

    def _value_end(self, call: _ScannedCall, i: int) -> None:
        if self.key in self.arg_keys and call.args_start is not None and call.args_end is None:
            call.args_end = i

    def deltas(self, text: str, base: int, finished: bool = False) -> list[DeltaToolCall]:
        """The deltas for what was found since the last call: a head once a call's name is complete,
        then its argument pieces; ``base`` is the index of the scanner's first call."""
        out = []
        for k, call in enumerate(self.calls):
            if call.name is None:
                continue
            if not call.head_sent:
                call.head_sent = True
                out.append(DeltaToolCall(index=base + k, id=_call_id(), type="function",
                                         function=DeltaFunctionCall(name=call.name, arguments="")))
            piece = call.piece(text, finished)
            if piece:
                out.append(DeltaToolCall(index=base + k, function=DeltaFunctionCall(arguments=piece)))
        return out

    @property
    def num_sent(self) -> int:
        return sum(call.head_sent for call in self.calls)


@dataclass
class ToolCallStream:
    """Turns a streamed completion's text deltas into content deltas and tool-call deltas."""

    plan: ToolCallPlan
    text: str = ""
    _sent_head: bool = False
    _held: str = ""  # auto mode: text that may be the start of a tool call, then the tool-call blocks
    _in_call: bool = False
    _num_calls: int = 0
    # required: one scanner over the array; auto: one per Hermes block, with where its JSON starts in _held
    _scanners: list[tuple[int, CallScanner]] = field(default_factory=list)

    def feed(self, delta: str) -> tuple[str, list[DeltaToolCall]]:
        """(content to send now, tool-call deltas to send now) for the next piece of text."""
        self.text += delta
        mode = self.plan.mode
        if mode == "none":
            return delta, []
        if mode == "named":
            calls = []
            if not self._sent_head:
                self._sent_head = True
                calls.append(DeltaToolCall(index=0, id=_call_id(), type="function",
                                           function=DeltaFunctionCall(name=self.plan.function, arguments="")))
            if delta:
                calls.append(DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta)))
            return "", calls
        if mode == "required":
            if not self._scanners:
                self._scanners.append((0, CallScanner(2, ("parameters",))))
            return "", self._scan(self.text)
        if self._in_call:
            self._held += delta
            return "", self._scan(self._held)
        # auto: pass text through until a tool call may be starting, then hold the rest
        held = self._held + delta
        start = held.find(HERMES_OPEN)
        if start >= 0:
            self._in_call = True
            self._held = held[start:]
            return held[:start], self._scan(self._held)
        keep = next((k for k in range(min(len(held), len(HERMES_OPEN) - 1), 0, -1)
                     if HERMES_OPEN.startswith(held[-k:])), 0)
        self._held = held[len(held) - keep:] if keep else ""
        return held[:len(held) - keep], []

    def _scan(self, text: str, finished: bool = False) -> list[DeltaToolCall]:
        """Scan the calls' text so far; in auto mode, move on to the next Hermes block once one closes."""
        deltas: list[DeltaToolCall] = []
        while True:
            if not self._scanners:
                if not text.startswith(HERMES_OPEN):
                    return deltas
                self._scanners.append((len(HERMES_OPEN), CallScanner(1, ("arguments", "parameters"))))
            offset, scanner = self._scanners[-1]
            block = text[offset:]
            scanner.scan(block)
            base = sum(s.num_sent for _, s in self._scanners[:-1])
            deltas += scanner.deltas(block, base, finished)
            after = text.find(HERMES_OPEN, offset + scanner.pos)
            if self.plan.mode != "auto" or not scanner.done or after < 0:
                return deltas
            self._scanners.append((after + len(HERMES_OPEN), CallScanner(1, ("arguments", "parameters"))))

    @property
    def _num_streamed(self) -> int:
        return sum(s.num_sent for _, s in self._scanners)

    def finish(self) -> tuple[str, list[DeltaToolCall]]:
        """What is left once the text is complete: held content, the rest of the streamed calls, or,
        where no call could be streamed, the calls the whole text holds (or the text as content)."""
        if self.plan.mode in ("none", "named"):
            return "", []
        if self.plan.mode == "auto" and not self._in_call:
            held, self._held = self._held, ""
            return held, []
        text = self._held if self.plan.mode == "auto" else self.text
        if self._num_streamed:
            self._num_calls = self._num_streamed
            return "", self._scan(text, finished=True)
        content, calls = (parse_hermes(text) if self.plan.mode == "auto" else self.plan.parse(text))
        self._num_calls = len(calls)
        deltas = [DeltaToolCall(index=i, id=c.id, type="function",
                                function=DeltaFunctionCall(name=c.function.name, arguments=c.function.arguments))
                  for i, c in enumerate(calls)]
        return content or "", deltas

    @property
    def has_calls(self) -> bool:
        return self.plan.mode == "named" or self._num_calls > 0 or self._num_streamed > 0


def render_tool_calls_as_text(messages: list[dict[str, Any]], chat_template: str | None) -> list[dict[str, Any]]:
    """Messages a template without a tool format can render: an assistant turn's ``tool_calls`` are
    written into its content in the Hermes format (the one "auto" reads back), so the conversation
    keeps them. Templates that mention ``tool_calls`` get the messages unchanged."""
    if chat_template is None or "tool_calls" in chat_template:
        return messages
    out = []
    for message in messages:
        calls, content = message.get("tool_calls"), message.get("content")
        if calls and (content is None or isinstance(content, str)):
            blocks = [f"{HERMES_OPEN}{json.dumps({'name': c['function']['name'], 'arguments': _arguments(c)})}"
                      f"{HERMES_CLOSE}" for c in calls]
            content = "\n".join(filter(None, [content, *blocks]))
            message = {k: v for k, v in message.items() if k != "tool_calls"} | {"content": content}
        out.append(message)
    return out


def _arguments(call: dict[str, Any]) -> Any:
    text = call["function"]["arguments"]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text

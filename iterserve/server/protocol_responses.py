"""The Responses API's request (``POST /v1/responses``) and its translation into a chat completion request.

The server answers a Responses request through the chat path: ``input`` (a string, or message,
``function_call`` and ``function_call_output`` items) and ``instructions`` become chat messages, the
flat function tools and ``tool_choice`` become their chat shapes, and ``text.format`` becomes an output
constraint. Nothing is stored, so what needs a stored response (``previous_response_id``,
``conversation``, ``background``) is refused with a 400 naming the field, as are built-in tools and
reasoning, which this server has not got.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationError

from iterserve.sampling_params import StructuredOutputsParams
from iterserve.server.errors import bad_request
from iterserve.server.protocol import (
    MAX_MESSAGES,
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    FunctionCall,
    Int,
    ListOf,
    RequestBody,
    ToolCall,
    structured_outputs_from,
)

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
ToolChoice = Literal["none", "auto", "required"] | dict[str, Any] | None
Items = Annotated[ListOf[dict[str, Any]], Field(min_length=1, max_length=MAX_MESSAGES)]
# Validated as the one shape the value has, so that an error (a list too long) is that shape's, not the string's.
Input = Annotated[
    Annotated[str, Tag("text")] | Annotated[Items, Tag("items")],
    Discriminator(lambda v: "text" if isinstance(v, str) else "items" if isinstance(v, list) else None,
                  custom_error_type="input_type", custom_error_message="must be a string or a list of input items"),
]


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: Input
    instructions: str | None = None
    max_output_tokens: Annotated[Int, Field(ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: ListOf[dict[str, Any]] | None = None
    tool_choice: ToolChoice = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool = True  # accepted either way; nothing is stored
    # known options this server cannot honour: refused when used
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool = False
    reasoning: dict[str, Any] | None = None
    include: ListOf[str] | None = None
    top_logprobs: Int | None = None
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: Int | None = None
    prompt: dict[str, Any] | None = None

    def check_supported(self) -> None:
        """Refuse options we do not implement, naming the field."""
        unstored = "nothing is stored on this server; send the whole conversation in input"
        refusals = [
            ("previous_response_id", self.previous_response_id is not None,
             f"previous_response_id is not supported: {unstored}"),
            ("conversation", self.conversation is not None, f"conversation is not supported: {unstored}"),
            ("background", self.background, "background responses are not supported: nothing is stored to poll"),
            ("reasoning", any(v not in (None, "none") for v in (self.reasoning or {}).values()),
             "reasoning is not supported by this server"),
            ("include", bool(self.include), "include is not supported: no extra output data is available"),
            ("top_logprobs", bool(self.top_logprobs), "top_logprobs is not supported on /v1/responses"),
            ("truncation", self.truncation == "auto", "truncation 'auto' is not supported; input is never cut"),
            ("max_tool_calls", self.max_tool_calls is not None, "max_tool_calls is not supported"),
            ("prompt", self.prompt is not None, "prompt templates are not supported: nothing is stored"),
        ]
        for param, refused, message in refusals:
            if refused:
                raise bad_request(message, param)

    @property
    def text_format(self) -> dict[str, Any]:
        fmt = (self.text or {}).get("format")
        return fmt if isinstance(fmt, dict) else {"type": "text"}

    def format_constraint(self) -> StructuredOutputsParams | None:
        """The output constraint ``text.format`` asks for; a 400 naming ``text`` when it is malformed."""
        text = self.text or {}
        if text.get("verbosity") not in (None, "medium"):
            raise bad_request("text.verbosity is not supported", "text")
        fmt = text.get("format")
        if fmt is not None and not isinstance(fmt, dict):
            raise bad_request("text.format must be an object", "text")
        kind = self.text_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return structured_outputs_from("text", {"json_object": True})
        if kind != "json_schema":
            raise bad_request(f"text.format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                              "text")
        schema = self.text_format.get("schema")
        if not isinstance(schema, dict):
            raise bad_request("text.format json_schema needs a 'schema' object", "text")
        return structured_outputs_from("text", {"json": schema})

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion request that answers this one (its output constraint apart)."""
        messages = [ChatMessage(role="system", content=self.instructions)] if self.instructions is not None else []
        if isinstance(self.input, str):
            messages.append(ChatMessage(role="user", content=self.input))
        else:
            for index, item in enumerate(self.input):
                _add_item(messages, item, index)
        return ChatCompletionRequest(messages=messages, max_completion_tokens=self.max_output_tokens,
                                     temperature=self.temperature, top_p=self.top_p, tools=self._chat_tools(),
                                     tool_choice=self._chat_tool_choice(), parallel_tool_calls=self.parallel_tool_calls,
                                     stream=self.stream, user=self.user)

    def _chat_tools(self) -> list[ChatTool] | None:
        if self.tools is None:
            return None
        tools = []
        for i, tool in enumerate(self.tools):
            kind = tool.get("type")
            if kind != "function":
                raise bad_request(f"tools[{i}]: tool type {kind!r} is not supported; only function tools are "
                                  "(built-in tools such as web_search need OpenAI's servers)", "tools")
            try:
                tools.append(ChatTool.model_validate({"function": {
                    k: tool.get(k) for k in ("name", "description", "parameters", "strict")}}))
            except ValidationError as e:
                error = e.errors(include_url=False)[0]
                where = ".".join(map(str, error["loc"][1:]))  # past the chat shape's "function"
                raise bad_request(f"tools[{i}].{where}: {error['msg']}", "tools") from None
        return tools

    def _chat_tool_choice(self) -> ToolChoice:
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            return choice
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}; "
                              f"got type {choice.get('type')!r}", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}


def _add_item(messages: list[ChatMessage], item: dict[str, Any], index: int) -> None:
    """Append input item ``index`` to the chat ``messages``: a function call joins the assistant turn
    before it (the turn that made it), so a turn's text and calls render as one message."""
    kind = item.get("type", "message")
    where = f"input[{index}]"
    if kind == "message":
        role = item.get("role")
        if role not in MESSAGE_ROLES:
            raise bad_request(f"{where}: role must be one of {', '.join(MESSAGE_ROLES)}; got {role!r}", "input")
        messages.append(ChatMessage(role=role, content=_text(item.get("content"), f"{where}.content")))
    elif kind == "function_call":
        name, call_id, arguments = item.get("name"), item.get("call_id"), item.get("arguments")
        if not (isinstance(name, str) and isinstance(call_id, str) and isinstance(arguments, str)):
            raise bad_request(f"{where}: a function_call item needs string name, call_id and arguments", "input")
        call = ToolCall(id=call_id, function=FunctionCall(name=name, arguments=arguments))
        last = messages[-1] if messages else None
        if last is not None and last.role == "assistant":
            last.tool_calls = [*(last.tool_calls or []), call]
        else:
            messages.append(ChatMessage(role="assistant", tool_calls=[call]))
    elif kind == "function_call_output":
        call_id = item.get("call_id")
        if not isinstance(call_id, str):
            raise bad_request(f"{where}: a function_call_output item needs a string call_id", "input")
        messages.append(ChatMessage(role="tool", tool_call_id=call_id, content=_text(item.get("output"),
                                                                                      f"{where}.output")))
    else:
        raise bad_request(f"{where}: item type {kind!r} is not supported; send message, function_call or "
                          "function_call_output items (nothing is stored to refer to)", "input")


def _text(content: Any, where: str) -> str:
    """A message's text: a string, or its text parts joined by newlines (as chat content parts are)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text parts", "input")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{i}]: only text parts ({', '.join(TEXT_PARTS)}) are supported; "
                              f"got {kind!r}", "input")
        texts.append(part["text"])
    return "\n".join(texts)

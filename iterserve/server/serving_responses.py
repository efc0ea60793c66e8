"""``POST /v1/responses``: OpenAI's Responses API, answered through the chat path.

The request becomes a chat completion request (:mod:`.protocol_responses`), so templates, tool calls
(forced by a grammar or parsed from the text) and structured output work as they do for chat. The
answer's ``output`` holds a ``message`` item with the text and a ``function_call`` item per call.
Streaming sends OpenAI's semantic events (``response.created``, ``response.output_text.delta``, ...),
each with an ``event:`` line and a ``sequence_number``. Nothing is stored.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from iterserve.engine.request_stream import RequestStream
from iterserve.errors import EngineDeadError, RequestFailedError
from iterserve.outputs import RequestOutput
from iterserve.sampling_params import grammar_checks_deferred
from iterserve.server.errors import engine_error
from iterserve.server.protocol import ToolCall
from iterserve.server.protocol_responses import ResponsesRequest
from iterserve.server.request_body import validated
from iterserve.server.response_bodies import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponseUsage,
)
from iterserve.server.serving import usage_of
from iterserve.server.serving_chat import ChatServing
from iterserve.server.streaming import sse
from iterserve.server.tool_calls import ToolCallPlan, ToolCallStream

Status = Literal["completed", "incomplete"]


def _status(out: RequestOutput) -> Status:
    return "incomplete" if out.outputs[0].finish_reason == "length" else "completed"


def _usage(out: RequestOutput) -> ResponseUsage:
    usage = usage_of(out)
    return ResponseUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                         total_tokens=usage.total_tokens,
                         input_tokens_details=InputTokensDetails(
                             cached_tokens=usage.prompt_tokens_details.cached_tokens))


def _finished(head: ResponseObject, out: RequestOutput, output: list[OutputItem]) -> ResponseObject:
    status = _status(out)
    return head.model_copy(update={
        "status": status, "output": output, "usage": _usage(out),
        "incomplete_details": IncompleteDetails() if status == "incomplete" else None})


@dataclass
class OutputStream:
    """A response's output items built from text and tool-call deltas, with the stream events that
    build them: an item is added, filled by deltas and done before the next one is added, as OpenAI's
    stream does. A response without text or calls gets an empty message, so ``output`` is never empty."""

    output: list[OutputItem] = field(default_factory=list)
    sequence_number: int = 0
    _message: OutputMessage | None = None  # the message item being written
    _calls: dict[int, FunctionCallItem] = field(default_factory=dict)  # by the tool-call delta's index

    def event(self, kind: str, **fields: Any) -> str:
        """One event of the stream, numbered."""
        body = {"type": kind, "sequence_number": self.sequence_number,
                **{k: v.model_dump() if isinstance(v, BaseModel) else v for k, v in fields.items()}}
        self.sequence_number += 1
        return sse(body, kind)

    def add(self, text: str, calls: list[DeltaToolCall]) -> list[str]:
        """The events for the next piece of text and the tool-call deltas after it."""
        events: list[str] = []
        if text:
            message = self._message or self._open_message(events)
            message.content[0].text += text
            events.append(self.event("response.output_text.delta", item_id=message.id,
                                     output_index=self.output.index(message), content_index=0, delta=text,
                                     logprobs=[]))
        for delta in calls:
            if delta.id is not None:  # a new call: the item before it is complete
                events += self._close("completed")
                item = FunctionCallItem(id=f"fc_{uuid.uuid4().hex}", call_id=delta.id, name=delta.function.name or "",
                                        arguments="", status="in_progress")
                self._calls[delta.index] = item
                self.output.append(item)
                events.append(self.event("response.output_item.added", output_index=len(self.output) - 1,
                                         item=item))
            item = self._calls[delta.index]
            if delta.function.arguments:
                item.arguments += delta.function.arguments
                events.append(self.event("response.function_call_arguments.delta", item_id=item.id,
                                         output_index=self.output.index(item), delta=delta.function.arguments))
        return events

    def finish(self, status: Status) -> list[str]:
        """The events that end the items still open (with ``status``)."""
        events: list[str] = []
        if not self.output:
            self._open_message(events)
        return events + self._close(status)

    def _open_message(self, events: list[str]) -> OutputMessage:
        events += self._close("completed")
        message = OutputMessage(id=f"msg_{uuid.uuid4().hex}", status="in_progress", content=[])
        self.output.append(message)
        index = len(self.output) - 1
        events.append(self.event("response.output_item.added", output_index=index, item=message))
        message.content.append(OutputText(text=""))
        events.append(self.event("response.content_part.added", item_id=message.id, output_index=index,
                                 content_index=0, part=message.content[0]))
        self._message = message
        return message

    def _close(self, status: Status) -> list[str]:
        events = []
        if (message := self._message) is not None:
            self._message = None
            message.status = status
            index, part = self.output.index(message), message.content[0]
            events += [self.event("response.output_text.done", item_id=message.id, output_index=index,
                                  content_index=0, text=part.text, logprobs=[]),
                       self.event("response.content_part.done", item_id=message.id, output_index=index,
                                  content_index=0, part=part),
                       self.event("response.output_item.done", output_index=index, item=message)]
        for item in self._calls.values():
            if item.status == "in_progress":
                item.status = status
                index = self.output.index(item)
                events += [self.event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                                      arguments=item.arguments),
                           self.event("response.output_item.done", output_index=index, item=item)]
        return events


def output_of(content: str | None, calls: list[ToolCall], status: Status) -> list[OutputItem]:
    """The output items of a whole answer: the same items a stream of it builds."""
    items = OutputStream()
    items.add(content or "", [DeltaToolCall(index=i, id=c.id, type="function", function=DeltaFunctionCall(
        name=c.function.name, arguments=c.function.arguments)) for i, c in enumerate(calls)])
    items.finish(status)
    return items.output


class ResponsesServing(ChatServing):
    """The Responses route, over the chat route's steps."""

    async def responses(self, body: Annotated[ResponsesRequest, validated(ResponsesRequest)],
                        request: Request) -> Response:
        lora = self._check_model(body.model)
        body.check_supported()
        chat = body.chat_request()
        chat.check_supported()
        with grammar_checks_deferred():  # checked by the grammar pool, off the event loop
            constraint = body.format_constraint()
        # A grammar that fails is the text format's when one is set, else the forced tool call's.
        plan, params, prompt_ids = await self._prepare(chat, constraint, "text" if constraint else None,
                                                       prompt_param="input")
        head = ResponseObject(
            id=f"resp_{uuid.uuid4().hex}", created_at=int(time.time()), status="in_progress",
            model=self._response_model(lora),
            instructions=body.instructions, max_output_tokens=body.max_output_tokens, metadata=body.metadata or {},
            parallel_tool_calls=body.parallel_tool_calls, temperature=body.temperature, top_p=body.top_p,
            text={"format": body.text_format}, tool_choice=body.tool_choice or "auto", tools=body.tools or [],
            user=body.user)
        stream = await self._submit(head.id, prompt_ids, params, body.stream, prompt_param="input", lora=lora)
        if body.stream:
            return self._streaming(self._response_events(stream, plan, head), [stream])
        finals = await self._final_outputs([stream], request)
        if finals is None:
            return Response(status_code=499)
        final = finals[0]
        content, calls = plan.parse(final.outputs[0].text)
        return JSONResponse(_finished(head, final, output_of(content, calls, _status(final))).model_dump())

    async def _response_events(self, stream: RequestStream, plan: ToolCallPlan,
                               head: ResponseObject) -> AsyncIterator[str]:
        items = OutputStream()
        yield items.event("response.created", response=head)
        yield items.event("response.in_progress", response=head)
        tools = ToolCallStream(plan)
        final = None
        try:
            async for out in stream:
                final = out
                c = out.outputs[0]
                text, calls = tools.feed(c.delta_text)
                if c.finished:
                    rest, more = tools.finish()
                    text, calls = text + rest, calls + more
                for event in items.add(text, calls):
                    yield event
            assert final is not None
            for event in items.finish(_status(final)):
                yield event
            done = _finished(head, final, items.output)
            yield items.event(f"response.{done.status}", response=done)
        except (EngineDeadError, RequestFailedError) as e:
            error = engine_error(e)
            yield items.event("error", code=error.code, message=error.message, param=error.param)
        finally:
            stream.close()

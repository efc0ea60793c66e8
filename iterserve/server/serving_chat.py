"""``POST /v1/chat/completions``: a conversation rendered by the chat template, tool calls (forced by a
grammar or parsed from the text), chat logprobs, streamed or whole."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Request
from fastapi.responses import Response

from iterserve.engine.request_stream import RequestStream
from iterserve.errors import EngineDeadError, RequestFailedError
from iterserve.outputs import Logprob, RequestOutput
from iterserve.sampling_params import SamplingParams, StructuredOutputsParams, grammar_checks_deferred
from iterserve.server.errors import bad_request, engine_error
from iterserve.server.protocol import ChatCompletionRequest
from iterserve.server.request_body import validated
from iterserve.server.response_bodies import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from iterserve.server.serving import LogprobPairs, OpenAIServing, best_logprobs, finite, new_logprobs, usage_of
from iterserve.server.streaming import sse
from iterserve.server.tool_calls import ToolCallPlan, ToolCallStream


class ChatServing(OpenAIServing):
    """The chat completions route."""

    def _chat_logprobs(self, pairs: LogprobPairs, n: int) -> ChatLogprobs:
        def top_logprob(token: int, logprob: Logprob) -> TopLogprob:
            text = self._token_text(token)
            return TopLogprob(token=text, logprob=finite(logprob.logprob), bytes=list(text.encode()))

        content = []
        for token, entry in pairs:
            assert entry is not None
            sampled = top_logprob(token, entry[token])
            alternatives = [top_logprob(*kv) for kv in best_logprobs(entry, n)]
            content.append(TokenLogprob(**sampled.model_dump(), top_logprobs=alternatives))
        return ChatLogprobs(content=content)

    async def _prepare(self, body: ChatCompletionRequest, constraint: StructuredOutputsParams | None,
                       constraint_param: str | None, prompt_param: str = "messages",
                       ) -> tuple[ToolCallPlan, SamplingParams, list[int]]:
        """The chat path after the body's own checks: its tool plan, its sampling params with the output
        constraint (``constraint`` or the forced tool call's, its grammar proven to run) and the rendered
        prompt's ids. The ``*_param`` names are the fields errors blame (the Responses API names them
        differently)."""
        with grammar_checks_deferred():  # checked by the grammar pool, off the event loop
            tool_plan = ToolCallPlan.of(body)
        if constraint is not None and tool_plan.constraint is not None:
            raise bad_request("a tool_choice that forces a call cannot be combined with another output constraint",
                              "tool_choice")
        params = body.sampling_params(body.requested_max_tokens, body.requested_logprobs,
                                      structured_outputs=constraint or tool_plan.constraint)
        await self._check_grammar(params.structured_outputs, constraint_param or "tools")
        tools = None
        if tool_plan.mode != "none" and body.tools:
            tools = [t.model_dump(exclude_none=True) for t in body.tools]
        prompt_ids = await self._encode_chat(body.messages, self.engine.max_model_len - 1, tools,
                                             body.template_options(), prompt_param)
        return tool_plan, params, prompt_ids

    async def chat_completions(self, body: Annotated[ChatCompletionRequest, validated(ChatCompletionRequest)],
                                request: Request) -> Response:
        constraint = self._accept(body)
        tool_plan, params, prompt_ids = await self._prepare(body, constraint, body.structured_outputs_field)
        request_id, lora = f"chatcmpl-{uuid.uuid4().hex}", self._check_model(body.model)
        stream = await self._submit(request_id, prompt_ids, params, bool(body.stream), prompt_param="messages",
                                    logprobs_param="top_logprobs" if body.top_logprobs else "logprobs", lora=lora)
        model = self._response_model(lora)
        if body.stream:
            return self._streaming(self._chat_events(stream, model, body, tool_plan), [stream])
        finals = await self._final_outputs([stream], request)
        if finals is None:
            return Response(status_code=499)
        # built and serialized off the event loop: a response of many logprobs takes seconds
        return Response(await asyncio.to_thread(self._chat_body, finals[0], body, tool_plan, request_id, model),
                        media_type="application/json")

    def _chat_body(self, final: RequestOutput, body: ChatCompletionRequest, tool_plan: ToolCallPlan,
                   request_id: str, model: str) -> bytes:
        choices = []
        for c in final.outputs:
            logprobs = None
            if body.logprobs:
                logprobs = self._chat_logprobs(list(zip(c.token_ids, c.logprobs or [])), body.top_logprobs or 0)
            content, tool_calls = tool_plan.parse(c.text)
            if body.echoed:
                content = body.echoed + (content or "")
            finish_reason = "tool_calls" if tool_calls and c.finish_reason == "stop" else c.finish_reason
            choices.append(ChatChoice(index=c.index, message=AssistantMessage(content=content, tool_calls=tool_calls),
                                      logprobs=logprobs, finish_reason=finish_reason, stop_reason=c.stop_reason))
        return ChatCompletionResponse(id=request_id, model=model, choices=choices,
                                      usage=usage_of(final)).model_dump_json().encode()

    async def _chat_events(self, stream: RequestStream, model: str, body: ChatCompletionRequest,
                           plan: ToolCallPlan) -> AsyncIterator[str]:
        created = int(time.time())
        parsers: dict[int, ToolCallStream] = {}  # one tool-call parser per choice

        def chunk(choices: list[ChatStreamChoice], usage: Usage | None = None) -> str:
            return sse(ChatCompletionChunk(id=stream.request_id, created=created, model=model,
                                            choices=choices, usage=usage))

        final = None
        try:
            async for out in stream:
                final = out
                for c in out.outputs:
                    if c.index not in parsers:
                        # the role comes with the choice's first token, as vLLM sends it: clients that time
                        # the first chunk with choices (vLLM's benchmark) then measure the real TTFT
                        parsers[c.index] = ToolCallStream(plan)
                        yield chunk([ChatStreamChoice(index=c.index, delta=DeltaMessage(role="assistant",
                                                                                        content=body.echoed))])
                    tools = parsers[c.index]
                    logprobs = self._chat_logprobs(new_logprobs(c), body.top_logprobs or 0) if body.logprobs else None
                    content, calls = tools.feed(c.delta_text)
                    finish_reason = c.finish_reason
                    if c.finished:
                        rest, more = tools.finish()
                        content, calls = content + rest, calls + more
                        if tools.has_calls and finish_reason == "stop":
                            finish_reason = "tool_calls"
                    if not content and not calls and not c.finished and not (logprobs and logprobs.content):
                        continue
                    delta = DeltaMessage(content=content or None, tool_calls=calls or None)
                    yield chunk([ChatStreamChoice(index=c.index, delta=delta, logprobs=logprobs,
                                                  finish_reason=finish_reason, stop_reason=c.stop_reason)])
            if body.include_usage and final is not None:
                yield chunk([], usage_of(final))
        except (EngineDeadError, RequestFailedError) as e:
            yield sse(engine_error(e).body())
        finally:
            stream.close()
        yield "data: [DONE]\n\n"

"""OpenAI-compatible HTTP API over one engine (one or more core replicas): completions, chat, models,
tokenize, health, metrics.

Handlers validate on the event loop, tokenize and render chat templates in worker threads (the
tokenizer is only read, never reconfigured, and releases the GIL while encoding), and hand token
ids to :class:`EngineCoreClient`, whose core process owns the model; text, stop strings and
streaming happen here. Every refusal is an OpenAI-style ``{"error": {...}}`` body with a 4xx
status; only genuine faults give a 5xx.

Hostile input is refused before it costs much: bodies over a size limit are cut off as they
arrive (413), POST bodies must be declared JSON (415), invalid Unicode and malformed lists are
refused when the body is parsed (stopping at the first bad element), and a prompt too long for
the context is refused before it is tokenized when its length alone proves it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import signal
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from iterserve import __version__
from iterserve.config import EngineConfig, ServerConfig
from iterserve.engine.core_client import EngineCoreClient, RequestStream
from iterserve.engine.validation import check_prompt_ids
from iterserve.errors import EngineDeadError, QueueFullError, RequestError, RequestFailedError
from iterserve.outputs import CompletionOutput, Logprob, RequestOutput
from iterserve.sampling_params import SamplingParams
from iterserve.server.auth import bearer_matches
from iterserve.server.dashboard import add_dashboard, checks_own_key
from iterserve.server.metrics import ServerMetrics
from iterserve.server.protocol import (
    APIError,
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenizeRequest,
    TokenizeResponse,
    TokenLogprob,
    TopLogprob,
    Usage,
    bad_request,
)
from iterserve.server.tool_calls import ToolCallPlan, ToolCallStream, render_tool_calls_as_text
from iterserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
PUBLIC_PATHS = frozenset({"/health", "/metrics", "/version"})
MIN_LOGPROB = -9999.0  # stands in for -inf, which JSON cannot carry

TokenLogprobs = list[tuple[int, dict[int, Logprob] | None]]  # (token, its logprobs entry) per token
MAX_PROMPTS = 256  # prompts in one /v1/completions request (each is a request of its own in the engine)


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status_code, headers=error.headers)


def _sse(payload: BaseModel | dict[str, Any]) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def _top(entry: dict[int, Logprob], n: int) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda kv: kv[1].logprob, reverse=True)[:n]


def _new_logprobs(c: CompletionOutput) -> TokenLogprobs:
    """The (token, logprobs) pairs of the tokens this step added."""
    k = len(c.delta_token_ids)
    if not k or not c.logprobs:
        return []
    return list(zip(c.token_ids[-k:], c.logprobs[-k:]))


def _usage(out: RequestOutput) -> Usage:
    prompt, completion = len(out.prompt_token_ids), out.metrics.num_output_tokens
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens))


def _total_usage(outs: list[RequestOutput]) -> Usage:
    """The usage of a request that ran as several engine requests (a list of prompts)."""
    usages = [_usage(o) for o in outs]
    prompt, completion = sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several streams as they come, each with its stream's position."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
            await queue.put((i, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            i, item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body has been read, so nothing else arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _APIKeyMiddleware:
    """Bearer-key check on everything but the probes and the dashboard's page, feed and scripts (which
    take the key or a session cookie themselves); plain ASGI, so streaming is untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and path not in PUBLIC_PATHS and not checks_own_key(path):
            if not bearer_matches(Headers(scope=scope).get("authorization", ""), self._key):
                error = APIError(401, "invalid or missing API key; send 'Authorization: Bearer <key>'",
                                 type="authentication_error", code="invalid_api_key",
                                 headers={"WWW-Authenticate": "Bearer"})
                await _error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _JSONBodyMiddleware:
    """POST bodies must be declared ``application/json`` (415 otherwise).

    A web page can make a visitor's browser send a cross-origin POST without asking first only with
    no Content-Type or a form or text/plain one; refusing those keeps other sites from running
    generations on a server the visitor can reach (a JSON POST needs a CORS preflight, which this
    server does not grant).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            content_type = Headers(scope=scope).get("content-type")
            if content_type is None or content_type.partition(";")[0].strip().lower() != "application/json":
                got = "no Content-Type" if content_type is None else f"Content-Type {content_type!r}"
                error = APIError(415, f"the body must be JSON sent with 'Content-Type: application/json'; got {got}",
                                 code="unsupported_media_type")
                await _error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _BodyTooLarge(Exception):
    """Raised into the app when the body it is reading goes over the limit; the 413 is already sent."""


class _BodySizeLimitMiddleware:
    """Refuse request bodies over ``max_bytes`` with a 413, without reading the rest.

    A declared Content-Length over the limit is refused before the app runs. Otherwise the bytes
    are counted as the app receives them; at the limit the 413 is sent and the app's read fails,
    and whatever the app answers then is dropped. The server discards the unread remainder, so
    the connection stays usable.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _error(self) -> JSONResponse:
        return _error_response(APIError(413, f"the request body is larger than the limit of {self.max_bytes} bytes",
                                        code="request_too_large"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._error()(scope, receive, send)
            return
        received = 0
        response_started = refused = False

        async def counting_receive() -> Message:
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    if not response_started:
                        await self._error()(scope, receive, send)
                        refused = True
                    raise _BodyTooLarge
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal response_started
            if refused:
                return
            response_started = response_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except _BodyTooLarge:
            if not refused:
                raise


class OpenAIServing:
    """The route handlers, bound to one engine."""

    def __init__(self, engine: EngineCoreClient, metrics: ServerMetrics, model_name: str) -> None:
        self.engine = engine
        self.metrics = metrics
        self.model_name = model_name

    # -- shared steps -------------------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def _tokenizer(self) -> Tokenizer:
        if self.engine.tokenizer is None:
            raise bad_request(f"model {self.model_name!r} has no tokenizer; send the prompt as token ids")
        return self.engine.tokenizer

    def _refuse_unfittable(self, tokenizer: Tokenizer, text: str, max_tokens: int, param: str) -> None:
        """Refuse text that must make more than ``max_tokens`` tokens, judged without tokenizing it
        (tokenizing megabytes takes seconds, and such a prompt cannot fit anyway)."""
        at_least = tokenizer.min_num_tokens(text)
        if at_least > max_tokens:
            raise bad_request(f"the prompt has {len(text)} characters, which make at least {at_least} tokens: "
                              f"more than max_model_len ({self.engine.max_model_len}) allows", param,
                              "context_length_exceeded")

    async def _encode(self, text: str, param: str, max_tokens: int, add_special_tokens: bool = True) -> list[int]:
        """Token ids for ``text`` if it can be at most ``max_tokens`` long, found in a worker thread so
        that the server keeps answering meanwhile."""
        tokenizer = self._tokenizer()

        def encode() -> list[int]:
            self._refuse_unfittable(tokenizer, text, max_tokens, param)
            return tokenizer.encode(text, add_special_tokens)

        return await asyncio.to_thread(encode)

    async def _encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                           max_tokens: int, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a conversation rendered by the chat template, both done in a worker thread.

        The length check applies to the rendered prompt: a template may leave some content out.
        """
        tokenizer = self._tokenizer()
        template = tokenizer.chat_templates.get("tool_use", tokenizer.chat_template)
        messages = render_tool_calls_as_text(messages, template)

        def render_and_encode() -> list[int]:
            try:
                prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                       tools=tools)
            except ValueError as e:
                raise bad_request(str(e), "messages") from e
            assert isinstance(prompt, str)
            self._refuse_unfittable(tokenizer, prompt, max_tokens, "messages")
            return tokenizer.encode(prompt, add_special_tokens=False)

        return await asyncio.to_thread(render_and_encode)

    async def _submit(self, request_id: str, prompt: list[int], params: SamplingParams, stream: bool,
                      prompt_param: str = "prompt") -> RequestStream:
        """Send the request to the engine: deltas when streaming, one final output otherwise. The
        engine validates the prompt against its context; ``prompt_param`` is the field that carried it."""
        try:
            return self.engine.add_request(request_id, prompt, params, time.perf_counter(), stream)
        except QueueFullError as e:
            raise APIError(429, f"the server is at capacity: {e}; retry later", type="rate_limit_error",
                           code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)}) from e
        except RequestError as e:
            raise _request_error(e, prompt_param) from e
        except ValueError as e:
            raise bad_request(str(e)) from e

    async def _final_outputs(self, streams: list[RequestStream], request: Request) -> list[RequestOutput] | None:
        """Every stream's finished output, or None when the client disconnected first (all are aborted)."""

        async def last(stream: RequestStream) -> RequestOutput:
            final = None
            async for output in stream:
                final = output
            assert final is not None
            return final

        results = asyncio.ensure_future(asyncio.gather(*map(last, streams)))
        disconnect = asyncio.ensure_future(_wait_for_disconnect(request))
        waiting: list[asyncio.Future[Any]] = [results, disconnect]
        try:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect.cancel()
            if not results.done():
                results.cancel()
            for stream in streams:
                stream.close()
        return list(results.result()) if results in done else None

    def _token_text(self, token_id: int) -> str:
        tokenizer = self.engine.tokenizer
        return tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer else f"token_id:{token_id}"

    def _completion_logprobs(self, pairs: TokenLogprobs, n: int, offset: int) -> CompletionLogprobs:
        """OpenAI's legacy format; ``offset`` is where the first token's text starts. A token without
        an entry (an echoed prompt's first) gets nulls, as OpenAI sends."""
        lp = CompletionLogprobs()
        for token, entry in pairs:
            text = self._token_text(token)
            lp.tokens.append(text)
            lp.text_offset.append(offset)
            offset += len(text)
            if entry is None:
                lp.token_logprobs.append(None)
                lp.top_logprobs.append(None)
                continue
            lp.token_logprobs.append(_finite(entry[token].logprob))
            top = _top(entry, n) if n else [(token, entry[token])]
            lp.top_logprobs.append({self._token_text(t): _finite(v.logprob) for t, v in top})
        return lp

    def _chat_logprobs(self, pairs: TokenLogprobs, n: int) -> ChatLogprobs:
        def top_logprob(token: int, logprob: Logprob) -> TopLogprob:
            text = self._token_text(token)
            return TopLogprob(token=text, logprob=_finite(logprob.logprob), bytes=list(text.encode()))

        content = []
        for token, entry in pairs:
            assert entry is not None
            sampled = top_logprob(token, entry[token])
            alternatives = [top_logprob(*kv) for kv in _top(entry, n)]
            content.append(TokenLogprob(**sampled.model_dump(), top_logprobs=alternatives))
        return ChatLogprobs(content=content)

    def _streaming(self, events: AsyncIterator[str], streams: list[RequestStream]) -> StreamingResponse:
        # The background task aborts the requests when the client left before the generator ran.
        def close() -> None:
            for stream in streams:
                stream.close()

        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                                 background=BackgroundTask(close))

    async def _submit_all(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                          stream: bool) -> list[RequestStream]:
        """One engine request per prompt; if one is refused, those already sent are aborted."""
        if len(prompts) == 1:
            return [await self._submit(request_id, prompts[0], params, stream)]
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                streams.append(await self._submit(f"{request_id}-{i}", prompt, params, stream))
        except BaseException:
            for s in streams:
                s.close()
            raise
        return streams

    # -- completions --------------------------------------------------------------------------

    async def _completion_prompts(self, prompt: str | list[int] | list[str] | list[list[int]],
                                  echo: bool) -> list[tuple[list[int], str]]:
        """Token ids of each prompt (one, or a list of them), and its text when echoed."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) > MAX_PROMPTS:
                raise bad_request(f"got {len(prompt)} prompts; at most {MAX_PROMPTS} are allowed per request",
                                  "prompt")
            prompts: list[Any] = list(prompt)
        else:
            prompts = [prompt]
        out = []
        tokenizer = self.engine.tokenizer
        for p in prompts:
            if isinstance(p, str):
                out.append((await self._encode(p, "prompt", self.engine.max_model_len - 1), p))
                continue
            try:  # before the ids are decoded for echo
                check_prompt_ids(p, self.engine.model_config.vocab_size, self.engine.max_model_len)
            except RequestError as e:
                raise _request_error(e) from e
            out.append((list(p), tokenizer.decode(p, skip_special_tokens=False) if echo and tokenizer else ""))
        return out

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        body.check_supported()
        params = body.completion_params(body.structured_outputs_params())
        prompts = await self._completion_prompts(body.prompt, body.echo)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self._submit_all(request_id, [ids for ids, _ in prompts], params, bool(body.stream))
        echoes = [text if body.echo else "" for _, text in prompts]
        if body.stream:
            return self._streaming(self._completion_events(request_id, streams, body, echoes), streams)
        finals = await self._final_outputs(streams, request)
        if finals is None:
            return Response(status_code=499)
        choices = []
        for i, (final, echo) in enumerate(zip(finals, echoes)):
            for c in final.outputs:
                logprobs = None
                if body.logprobs is not None:
                    logprobs = self._completion_logprobs(self._echo_logprobs(final, echo) + list(
                        zip(c.token_ids, c.logprobs or [])), body.logprobs, 0)
                choices.append(CompletionChoice(index=i * body.n + c.index, text=echo + c.text, logprobs=logprobs,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        return JSONResponse(CompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                               usage=_total_usage(finals)).model_dump())

    @staticmethod
    def _echo_logprobs(out: RequestOutput, echo: str) -> TokenLogprobs:
        """The echoed prompt's (token, logprobs) pairs; the first token has none."""
        if not echo or out.prompt_logprobs is None:
            return []
        return list(zip(out.prompt_token_ids, out.prompt_logprobs))

    async def _completion_events(self, request_id: str, streams: list[RequestStream], body: CompletionRequest,
                                 echoes: list[str]) -> AsyncIterator[str]:
        created = int(time.time())
        offsets: dict[int, int] = {}  # choice index -> text offset of its next token
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for i, out in _merged(streams):
                finals[i] = out
                for c in out.outputs:
                    index = i * body.n + c.index
                    echo = echoes[i] if index not in offsets else ""
                    pairs = self._echo_logprobs(out, echo) + _new_logprobs(c)
                    offsets.setdefault(index, 0)
                    text = echo + c.delta_text
                    logprobs = None
                    if body.logprobs is not None:
                        logprobs = self._completion_logprobs(pairs, body.logprobs, offsets[index])
                        offsets[index] += sum(map(len, logprobs.tokens))
                    if not text and not c.finished and not (logprobs and logprobs.tokens):
                        continue
                    choice = CompletionChoice(index=index, text=text, logprobs=logprobs,
                                              finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                    yield _sse(CompletionResponse(id=request_id, created=created, model=self.model_name,
                                                  choices=[choice]))
            if body.include_usage and all(f is not None for f in finals):
                yield _sse(CompletionResponse(id=request_id, created=created, model=self.model_name,
                                              choices=[], usage=_total_usage(finals)))  # type: ignore[arg-type]
        except (EngineDeadError, RequestFailedError) as e:
            yield _sse(_engine_error(e).body())
        finally:
            for stream in streams:
                stream.close()
        yield "data: [DONE]\n\n"

    # -- chat ---------------------------------------------------------------------------------

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        body.check_supported()
        max_tokens = body.requested_max_tokens
        tool_plan = ToolCallPlan.of(body)
        constraint = body.structured_outputs_params()
        if constraint is not None and tool_plan.constraint is not None:
            raise bad_request("a tool_choice that forces a call cannot be combined with another output constraint",
                              "tool_choice")
        params = body.sampling_params(max_tokens, body.requested_logprobs,
                                      structured_outputs=constraint or tool_plan.constraint)
        tools = None
        if tool_plan.mode != "none" and body.tools:
            tools = [t.model_dump(exclude_none=True) for t in body.tools]
        prompt_ids = await self._encode_chat(body.message_dicts(), body.add_generation_prompt,
                                             self.engine.max_model_len - 1, tools)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await self._submit(request_id, prompt_ids, params, bool(body.stream), prompt_param="messages")
        if body.stream:
            return self._streaming(self._chat_events(stream, body, tool_plan), [stream])
        finals = await self._final_outputs([stream], request)
        if finals is None:
            return Response(status_code=499)
        final = finals[0]
        choices = []
        for c in final.outputs:
            logprobs = None
            if body.logprobs:
                logprobs = self._chat_logprobs(list(zip(c.token_ids, c.logprobs or [])), body.top_logprobs or 0)
            content, tool_calls = tool_plan.parse(c.text)
            finish_reason = "tool_calls" if tool_calls and c.finish_reason == "stop" else c.finish_reason
            choices.append(ChatChoice(index=c.index, message=AssistantMessage(content=content, tool_calls=tool_calls),
                                      logprobs=logprobs, finish_reason=finish_reason, stop_reason=c.stop_reason))
        return JSONResponse(ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                                   usage=_usage(final)).model_dump())

    async def _chat_events(self, stream: RequestStream, body: ChatCompletionRequest,
                           plan: ToolCallPlan) -> AsyncIterator[str]:
        created = int(time.time())
        parsers: dict[int, ToolCallStream] = {}  # one tool-call parser per choice

        def chunk(choices: list[ChatStreamChoice], usage: Usage | None = None) -> str:
            return _sse(ChatCompletionChunk(id=stream.request_id, created=created, model=self.model_name,
                                            choices=choices, usage=usage))

        final = None
        try:
            for index in range(body.n):
                yield chunk([ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
            async for out in stream:
                final = out
                for c in out.outputs:
                    tools = parsers.setdefault(c.index, ToolCallStream(plan))
                    logprobs = self._chat_logprobs(_new_logprobs(c), body.top_logprobs or 0) if body.logprobs else None
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
                yield chunk([], _usage(final))
        except (EngineDeadError, RequestFailedError) as e:
            yield _sse(_engine_error(e).body())
        finally:
            stream.close()
        yield "data: [DONE]\n\n"

    # -- everything else ----------------------------------------------------------------------

    def _model_card(self) -> ModelCard:
        return ModelCard(id=self.model_name, root=self.engine.config.model, max_model_len=self.engine.max_model_len)

    async def models(self) -> ModelList:
        return ModelList(data=[self._model_card()])

    async def model(self, model_id: str) -> ModelCard:
        self._check_model(model_id)
        return self._model_card()

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        """Token ids of a prompt or conversation of up to max_model_len tokens (longer text is refused,
        so that this endpoint cannot be made to tokenize arbitrarily much)."""
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("send exactly one of 'prompt' and 'messages'", "prompt")
        limit = self.engine.max_model_len
        if body.messages is not None:
            param = "messages"
            ids = await self._encode_chat([m.model_dump(exclude_none=True) for m in body.messages],
                                          body.add_generation_prompt, limit)
        else:
            param = "prompt"
            ids = await self._encode(body.prompt or "", param, limit, body.add_special_tokens)
        if len(ids) > limit:
            raise bad_request(f"the text has {len(ids)} tokens, more than max_model_len ({limit})", param,
                              "context_length_exceeded")
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=limit)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        """The text of up to max_model_len token ids, decoded in a worker thread."""
        self._check_model(body.model)
        tokenizer = self._tokenizer()
        limit = self.engine.max_model_len
        if len(body.tokens) > limit:
            raise bad_request(f"got {len(body.tokens)} token ids, more than max_model_len ({limit})", "tokens",
                              "context_length_exceeded")
        vocab = tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise bad_request(f"token ids must be in [0, {vocab})", "tokens")
        return DetokenizeResponse(prompt=await asyncio.to_thread(tokenizer.decode, body.tokens))

    async def health(self) -> Response:
        if not self.engine.is_running:
            reason = str(self.engine.error) if self.engine.error else "the engine is not running"
            return _error_response(APIError(503, reason, type="server_error"))
        return JSONResponse({"status": "ok"})

    async def version(self) -> dict[str, str]:
        return {"version": __version__}

    async def prometheus(self) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


# -- errors -----------------------------------------------------------------------------------------


def _request_error(error: RequestError, prompt_param: str = "prompt") -> APIError:
    """A request the engine refused, as a 400 naming the field (the prompt under the name the client used)."""
    param = prompt_param if error.param == "prompt" else error.param
    return bad_request(str(error), param, error.code)


def _engine_error(error: EngineDeadError | RequestFailedError) -> APIError:
    """503 while the engine is gone or stopping; 500 for a failed step (its traceback is only logged)."""
    if isinstance(error, RequestFailedError):
        return APIError(500, str(error), type="server_error", code="engine_error")
    return APIError(503, str(error), type="server_error", code="engine_unavailable")


async def _on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return _error_response(exc)


async def _on_engine_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, (EngineDeadError, RequestFailedError))
    return _error_response(_engine_error(exc))


def _printable(text: str) -> str:
    """``text`` with any lone surrogate escaped, so that an error message can always be sent as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


async def _on_validation_error(request: Request, exc: Exception) -> Response:
    """FastAPI's 422 becomes OpenAI's 400, naming the offending parameter."""
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    if not errors:
        return _error_response(bad_request("invalid request body"))
    # A union field reports one error per member type; one raised by our own validators says what is wrong.
    first = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error")
        return _error_response(bad_request(f"the body is not valid JSON: {reason}" if reason else
                                           "the body is not valid JSON"))
    # pydantic tags a union member's errors with the member's type, e.g. "list[int]": not a field name
    loc = [_printable(str(part)) for part in first.get("loc", ()) if part != "body" and "[" not in str(part)]
    if not loc and first.get("type") in ("missing", "model_attributes_type"):
        return _error_response(bad_request("the request body must be a JSON object"))
    where = ".".join(loc)
    reason = (first.get("ctx") or {}).get("error") if first.get("type") == "value_error" else None
    message = _printable(str(reason or first.get("msg")))
    return _error_response(bad_request(f"{where}: {message}" if where else message, loc[0] if loc else None))


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    message = f"no route for {request.method} {request.url.path}" if exc.status_code == 404 else str(exc.detail)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    headers = dict(exc.headers) if exc.headers is not None else None
    return _error_response(APIError(exc.status_code, message, type=kind, headers=headers))


async def _on_internal_error(request: Request, exc: Exception) -> Response:
    logger.exception("internal error on %s %s", request.method, request.url.path, exc_info=exc)
    return _error_response(APIError(500, f"internal server error: {type(exc).__name__}", type="server_error"))


# -- app and server ---------------------------------------------------------------------------------


def build_app(config: EngineConfig, server: ServerConfig | None = None) -> FastAPI:
    """An app serving ``config``'s model; its lifespan starts and stops the engine core process.

    ``app.state.engine`` is the :class:`EngineCoreClient` (set its ``on_dead`` to hear of a dead core).
    Request bodies over ``server.max_request_body_bytes`` are refused with a 413.
    """
    server = server or ServerConfig()
    served_model_name, api_key = server.model_name(config), server.api_key
    engine = EngineCoreClient(config, max_waiting=server.max_waiting, log_level=server.log_level,
                              data_parallel_size=server.data_parallel_size)
    spec = config.speculative_config
    metrics = ServerMetrics(served_model_name, engine.capacity.max_model_len, server.data_parallel_size,
                            spec.num_speculative_tokens if spec else 0)
    engine.observer = metrics
    serving = OpenAIServing(engine, metrics, served_model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        logger.info("engine core started; serving %r", served_model_name)
        try:
            yield
        finally:
            await engine.stop()
            logger.info("engine core stopped")

    app = FastAPI(title="iterserve", version=__version__, lifespan=lifespan)
    app.state.engine = engine
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(EngineDeadError, _on_engine_error)
    app.add_exception_handler(RequestFailedError, _on_engine_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_internal_error)
    # the last added runs first: the key is checked, then the Content-Type, then the body size
    app.add_middleware(_BodySizeLimitMiddleware, max_bytes=server.max_request_body_bytes)
    app.add_middleware(_JSONBodyMiddleware)
    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)

    app.post("/v1/completions", response_model=None)(serving.completions)
    app.post("/v1/chat/completions", response_model=None)(serving.chat_completions)
    app.get("/v1/models")(serving.models)
    app.get("/v1/models/{model_id:path}")(serving.model)
    app.post("/tokenize")(serving.tokenize)
    app.post("/detokenize")(serving.detokenize)
    app.get("/health", response_model=None)(serving.health)
    app.get("/version")(serving.version)
    app.get("/metrics", response_model=None)(serving.prometheus)
    add_dashboard(app, engine, served_model_name, api_key)
    return app


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _GracefulServer(uvicorn.Server):
    """uvicorn, but SIGINT/SIGTERM first drains: new requests get 503, running ones get
    ``shutdown_timeout`` seconds, the rest end with an error; then the server stops. A second
    signal stops at once."""

    def __init__(self, config: uvicorn.Config, engine: EngineCoreClient, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._draining or self._loop is None:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        logger.info("shutting down: finishing running requests (up to %.1f s)", self.shutdown_timeout)
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        await self.engine.drain(self.shutdown_timeout)
        self.should_exit = True


def run_server(config: EngineConfig, server: ServerConfig) -> int:
    """``iterserve serve``: serve until SIGINT/SIGTERM (exit 0 after draining) or until the engine core
    dies (exit 1, so a supervisor restarts the server)."""
    name = server.model_name(config)
    app = build_app(config, server)
    engine: EngineCoreClient = app.state.engine
    cap = engine.capacity
    replicas = f" in each of {server.data_parallel_size} replicas" if server.data_parallel_size > 1 else ""
    logger.info("KV cache: %d blocks x %d tokens = %d tokens, max_model_len %d (%d full-length sequences)%s",
                cap.num_blocks, cap.block_size, cap.total_tokens, cap.max_model_len, cap.max_full_length_seqs,
                replicas)
    logger.info("OpenAI-compatible API for %r at %s/v1", name, _url(server.host, server.port))
    uv = _GracefulServer(uvicorn.Config(
        app, host=server.host, port=server.port, log_level=server.log_level.lower(),
        timeout_graceful_shutdown=math.ceil(server.shutdown_timeout) + 1,
    ), engine, server.shutdown_timeout)

    def engine_died() -> None:
        uv.should_exit = True

    engine.on_dead = engine_died
    # uvicorn re-raises a signal it handled once it has shut down; a no-op handler turns that into a
    # normal return, so a requested stop exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: None)
    uv.run()
    if not uv.started:
        return 1  # the engine core did not start; the log says why
    if engine.error is not None:
        logger.error("exiting because the engine core died: %s", engine.error)
        return 1
    return 0

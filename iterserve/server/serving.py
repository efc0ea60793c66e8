"""The OpenAI routes' logic, bound to one engine: completions, chat completions, models, tokenize and
detokenize, health, version and metrics.

Handlers validate on the event loop, tokenize and render chat templates in worker threads (the
tokenizer is only read, never reconfigured, and releases the GIL while encoding), and hand token
ids to :class:`EngineCoreClient`, whose core process owns the model; text, stop strings and
streaming happen here. A prompt too long for the context is refused before it is tokenized when its
length alone proves it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from iterserve import __version__
from iterserve.engine.core_client import EngineCoreClient, RequestStream
from iterserve.engine.validation import check_prompt_ids
from iterserve.errors import EngineDeadError, QueueFullError, RequestError, RequestFailedError
from iterserve.outputs import CompletionOutput, Logprob, RequestOutput
from iterserve.sampling_params import SamplingParams, grammar_checks_deferred
from iterserve.server.errors import APIError, bad_request, engine_error, error_response, request_error
from iterserve.server.grammars import GrammarChecker
from iterserve.server.metrics import ServerMetrics
from iterserve.server.protocol import (
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
    PromptLogprob,
    PromptTokensDetails,
    TokenizeRequest,
    TokenizeResponse,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from iterserve.server.streaming import merged, sse, wait_for_disconnect
from iterserve.server.tool_calls import ToolCallPlan, ToolCallStream, render_tool_calls_as_text
from iterserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
MIN_LOGPROB = -9999.0  # stands in for -inf, which JSON cannot carry

LogprobPairs = list[tuple[int, dict[int, Logprob] | None]]  # (token, its logprobs entry) per token
MAX_PROMPTS = 256  # prompts in one /v1/completions request (each is a request of its own in the engine)


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def _top(entry: dict[int, Logprob], n: int) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda kv: kv[1].logprob, reverse=True)[:n]


def _new_logprobs(c: CompletionOutput) -> LogprobPairs:
    """The (token, logprobs) pairs of the tokens this step added."""
    k = len(c.delta_token_ids)
    if not k or not c.logprobs:
        return []
    return list(zip(c.token_ids[-k:], c.logprobs[-k:]))


def _prompt_logprobs(out: RequestOutput, n: int | None) -> list[dict[int, PromptLogprob] | None] | None:
    """vLLM's ``prompt_logprobs`` of a choice: the prompt token's entry and its top ``n``, per prompt token."""
    if n is None or out.prompt_logprobs is None:
        return None
    return [None if entry is None else {
        t: PromptLogprob(logprob=_finite(v.logprob), rank=v.rank, decoded_token=v.decoded_token)
        for t, v in entry.items() if t == token or v.rank is not None and v.rank <= n}
        for token, entry in zip(out.prompt_token_ids, out.prompt_logprobs)]


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


class OpenAIServing:
    """The route handlers, bound to one engine."""

    def __init__(self, engine: EngineCoreClient, metrics: ServerMetrics, model_name: str,
                 grammars: GrammarChecker) -> None:
        self.engine = engine
        self.metrics = metrics
        self.model_name = model_name
        self.grammars = grammars

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
            raise request_error(e, prompt_param) from e
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
        disconnect = asyncio.ensure_future(wait_for_disconnect(request))
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

    def _completion_logprobs(self, pairs: LogprobPairs, n: int, offset: int) -> CompletionLogprobs:
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

    def _chat_logprobs(self, pairs: LogprobPairs, n: int) -> ChatLogprobs:
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
                raise request_error(e) from e
            out.append((list(p), tokenizer.decode(p, skip_special_tokens=False) if echo and tokenizer else ""))
        return out

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        body.check_supported()
        with grammar_checks_deferred():  # checked by the grammar pool, off the event loop
            constraint = body.structured_outputs_params()
        params = body.completion_params(constraint)
        await self.grammars.check(constraint, body.structured_outputs_field or "structured_outputs")
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
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                                prompt_logprobs=_prompt_logprobs(final, body.prompt_logprobs)))
        return JSONResponse(CompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                               usage=_total_usage(finals)).model_dump())

    @staticmethod
    def _echo_logprobs(out: RequestOutput, echo: str) -> LogprobPairs:
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
            async for i, out in merged(streams):
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
                    yield sse(CompletionResponse(id=request_id, created=created, model=self.model_name,
                                                  choices=[choice]))
            if body.include_usage and all(f is not None for f in finals):
                yield sse(CompletionResponse(id=request_id, created=created, model=self.model_name,
                                              choices=[], usage=_total_usage(finals)))  # type: ignore[arg-type]
        except (EngineDeadError, RequestFailedError) as e:
            yield sse(engine_error(e).body())
        finally:
            for stream in streams:
                stream.close()
        yield "data: [DONE]\n\n"

    # -- chat ---------------------------------------------------------------------------------

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        body.check_supported()
        max_tokens = body.requested_max_tokens
        with grammar_checks_deferred():  # checked by the grammar pool, off the event loop
            tool_plan = ToolCallPlan.of(body)
            constraint = body.structured_outputs_params()
        if constraint is not None and tool_plan.constraint is not None:
            raise bad_request("a tool_choice that forces a call cannot be combined with another output constraint",
                              "tool_choice")
        params = body.sampling_params(max_tokens, body.requested_logprobs,
                                      structured_outputs=constraint or tool_plan.constraint)
        await self.grammars.check(params.structured_outputs, body.structured_outputs_field or "tools")
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
            return sse(ChatCompletionChunk(id=stream.request_id, created=created, model=self.model_name,
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
            yield sse(engine_error(e).body())
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
        if (problem := self.engine.health_problem()) is not None:
            return error_response(APIError(503, problem, type="server_error"))
        return JSONResponse({"status": "ok"})

    async def version(self) -> dict[str, str]:
        return {"version": __version__}

    async def prometheus(self) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


# -- errors -----------------------------------------------------------------------------------------

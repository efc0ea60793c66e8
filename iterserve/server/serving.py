"""The OpenAI routes' shared steps, bound to one engine: the model check, tokenizing and rendering chat
templates, submitting to the engine, waiting for final outputs, streaming responses, and the usage
and logprob helpers. Each endpoint's handlers subclass :class:`OpenAIServing` in a module of its own
(``serving_completions``, ``serving_chat``, ``serving_responses``, ``serving_tokenize``,
``serving_info``).

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
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from iterserve.config import ServerConfig
from iterserve.engine.core_client import EngineCoreClient
from iterserve.engine.request_stream import RequestStream
from iterserve.errors import QueueFullError, RequestError
from iterserve.lora.request import LoRARequest
from iterserve.outputs import CompletionOutput, Logprob, RequestOutput
from iterserve.sampling_params import SamplingParams, StructuredOutputsParams, grammar_checks_deferred
from iterserve.server.admission import Outputs, PacedStream, share_of
from iterserve.server.errors import APIError, bad_request, request_error
from iterserve.server.grammars import GrammarChecker
from iterserve.server.metrics import ServerMetrics
from iterserve.server.protocol import ChatMessage, SamplingRequest
from iterserve.server.response_bodies import PromptTokensDetails, Usage
from iterserve.server.streaming import wait_for_disconnect
from iterserve.server.tool_calls import render_tool_calls_as_text
from iterserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
MIN_LOGPROB = -9999.0  # stands in for -inf, which JSON cannot carry

LogprobPairs = list[tuple[int, dict[int, Logprob] | None]]  # (token, its logprobs entry) per token
DEFAULT_MAX_RESPONSE_LOGPROBS = ServerConfig.max_response_logprobs


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def best_logprobs(entry: dict[int, Logprob], n: int) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda kv: kv[1].logprob, reverse=True)[:n]


def new_logprobs(c: CompletionOutput) -> LogprobPairs:
    """The (token, logprobs) pairs of the tokens this step added."""
    k = len(c.delta_token_ids)
    if not k or not c.logprobs:
        return []
    return list(zip(c.token_ids[-k:], c.logprobs[-k:]))


def logprobs_work(params: SamplingParams, prompt_len: int, max_tokens: int) -> tuple[int, str]:
    """How many logprob entries a request may return (each sampled or prompt token's own, and its top
    alternatives), and the sum that makes it, for an error message."""
    total, parts = 0, []
    if params.logprobs is not None:
        total += params.n * max_tokens * (params.logprobs + 1)
        parts.append(f"n={params.n} x {max_tokens} tokens x {params.logprobs + 1} per token")
    if params.prompt_logprobs is not None:
        total += prompt_len * (params.prompt_logprobs + 1)
        parts.append(f"{prompt_len} prompt tokens x {params.prompt_logprobs + 1}")
    return total, " + ".join(parts)


def usage_of(out: RequestOutput) -> Usage:
    prompt, completion = len(out.prompt_token_ids), out.metrics.num_output_tokens
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens))


def total_usage_of(outs: list[RequestOutput]) -> Usage:
    """The usage of a request that ran as several engine requests (a list of prompts)."""
    usages = [usage_of(o) for o in outs]
    prompt, completion = sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class OpenAIServing:
    """The steps every route shares, bound to one engine; each endpoint's handlers subclass it."""

    def __init__(self, engine: EngineCoreClient, metrics: ServerMetrics, model_name: str,
                 grammars: GrammarChecker | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.model_name = model_name
        self.grammars = grammars  # what proves a request's grammar runnable (the routes that take one)
        self.chat_template: str | None = None  # the server's --chat-template, used where a request gives none
        self.max_response_logprobs = DEFAULT_MAX_RESPONSE_LOGPROBS  # the server's --max-response-logprobs
        self.loras: dict[str, LoRARequest] = {}  # the server's --lora-modules, by the name a request's model gives

    # -- shared steps -------------------------------------------------------------------------

    async def _check_grammar(self, spec: StructuredOutputsParams | None, param: str) -> None:
        """Return once ``spec``'s grammar is proven to run (off the event loop); a 400 naming ``param``
        when it is not."""
        if spec is None:
            return
        if self.grammars is None:
            raise RuntimeError(f"{type(self).__name__} was built without a grammar checker")
        await self.grammars.check(spec, param)

    def _accept(self, body: SamplingRequest) -> StructuredOutputsParams | None:
        """Refuse a request for another model or with a field we do not serve; then its structured-output
        constraint, whose grammar the grammar pool checks later, off the event loop."""
        self._check_model(body.model)
        body.check_supported()
        with grammar_checks_deferred():
            return body.structured_outputs_params()

    def _check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's ``model`` names (None: the base model); a 404 for a model not served."""
        if model is None or model == self.model_name:
            return None
        if model in self.loras:
            return self.loras[model]
        adapters = f" and LoRA adapters {', '.join(map(repr, self.loras))}" if self.loras else ""
        raise APIError(404, f"The model `{model}` does not exist. This server serves {self.model_name!r}{adapters}.",
                       param="model", code="model_not_found")

    def _response_model(self, lora: LoRARequest | None) -> str:
        """The ``model`` a response names: the adapter the request asked for (as vLLM answers), else the base."""
        return self.model_name if lora is None else lora.lora_name

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

    async def _encode_chat(self, chat: list[ChatMessage], max_tokens: int, tools: list[dict[str, Any]] | None = None,
                           options: dict[str, Any] | None = None, param: str = "messages") -> list[int]:
        """Token ids of a conversation rendered by the chat template, all done in a worker thread (the
        messages turned into dicts too: thousands take a second); ``options`` go to
        :meth:`Tokenizer.apply_chat_template` (a request's own template runs in the same sandbox as the
        model's). The length check applies to the rendered prompt: a template may leave some content out.
        Errors name ``param``, the field that carried the conversation.
        """
        tokenizer = self._tokenizer()
        options = dict(options or {})
        if options.get("chat_template") is None:
            options["chat_template"] = self.chat_template
        template = tokenizer.chat_templates.get("tool_use", tokenizer.chat_template)

        def render_and_encode() -> list[int]:
            messages = render_tool_calls_as_text([m.model_dump(exclude_none=True) for m in chat], template)
            try:
                prompt = tokenizer.apply_chat_template(messages, tools=tools, **options)
            except ValueError as e:
                raise bad_request(str(e), param) from e
            assert isinstance(prompt, str)
            self._refuse_unfittable(tokenizer, prompt, max_tokens, param)
            return tokenizer.encode(prompt, add_special_tokens=False)

        return await asyncio.to_thread(render_and_encode)

    async def _submit(self, request_id: str, prompt: list[int], params: SamplingParams, stream: bool,
                      prompt_param: str = "prompt", logprobs_param: str = "logprobs",
                      lora: LoRARequest | None = None) -> RequestStream:
        """Send the request to the engine: deltas when streaming, one final output otherwise. The
        engine validates the prompt against its context; ``prompt_param`` is the field that carried it,
        ``logprobs_param`` the one that asked for logprobs."""
        try:
            self._check_logprobs_work(prompt, params, logprobs_param)
            return self.engine.add_request(request_id, prompt, params, time.perf_counter(), stream, lora=lora)
        except QueueFullError as e:
            raise APIError(429, f"the server is at capacity: {e}; retry later", type="rate_limit_error",
                           code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)}) from e
        except RequestError as e:
            raise request_error(e, prompt_param, logprobs_param) from e
        except ValueError as e:
            raise bad_request(str(e)) from e

    def _check_logprobs_work(self, prompt: list[int], params: SamplingParams, param: str = "logprobs") -> None:
        """Refuse a request whose logprobs could make a response of more than ``max_response_logprobs``
        entries (building and sending one takes the API process seconds), naming the limit."""
        if params.logprobs is None and params.prompt_logprobs is None:
            return
        max_tokens = self.engine.check_request(prompt, params)  # a prompt that does not fit is told so first
        total, terms = logprobs_work(params, len(prompt), max_tokens)
        if total > self.max_response_logprobs:
            raise bad_request(f"this request could return {total} logprobs ({terms}), more than the "
                              f"{self.max_response_logprobs} a response may carry (max_response_logprobs); ask for "
                              "fewer choices, tokens or top alternatives",
                              param if params.logprobs is not None else "prompt_logprobs")

    async def _final_outputs(self, streams: Sequence[Outputs], request: Request) -> list[RequestOutput] | None:
        """Every stream's finished output, or None when the client disconnected first (all are aborted)."""

        async def last(stream: Outputs) -> RequestOutput:
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
            # A cancelled gather holds the CancelledError as its exception: retrieve it, or asyncio logs an ERROR.
            results.add_done_callback(lambda f: f.cancelled() or f.exception())
            for stream in streams:
                stream.close()
        return list(results.result()) if results in done else None

    def _token_text(self, token_id: int) -> str:
        tokenizer = self.engine.tokenizer
        return tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer else f"token_id:{token_id}"

    def _streaming(self, events: AsyncIterator[str], streams: Sequence[Outputs]) -> StreamingResponse:
        # The background task aborts the requests when the client left before the generator ran.
        def close() -> None:
            for stream in streams:
                stream.close()

        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                                 background=BackgroundTask(close))

    async def _submit_all(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                          stream: bool, lora: LoRARequest | None = None) -> list[Outputs]:
        """One engine request per prompt. The first is admitted as any request is (429 when the queue is
        full); the others follow a share at a time (:mod:`.admission`), each checked now so that a bad
        one is a 400 before any is sent."""
        if len(prompts) == 1:
            return [await self._submit(request_id, prompts[0], params, stream, lora=lora)]
        for prompt in prompts[1:]:
            try:
                self._check_logprobs_work(prompt, params)
                self.engine.check_request(prompt, params)
            except RequestError as e:
                raise request_error(e) from e
        places = asyncio.Semaphore(share_of(self.engine.max_waiting))
        await places.acquire()  # free: the share is at least one

        def sender(i: int) -> Callable[[], RequestStream]:
            return lambda: self.engine.add_request(f"{request_id}-{i}", prompts[i], params, time.perf_counter(),
                                                   stream, admitted=True, lora=lora)

        try:
            first = await self._submit(f"{request_id}-0", prompts[0], params, stream, lora=lora)
        except BaseException:
            places.release()
            raise
        rest = [PacedStream(sender(i), places) for i in range(1, len(prompts))]
        return [PacedStream(sender(0), places, first), *rest]

"""``POST /v1/completions``: one prompt or a list of them (each an engine request of its own), echo, legacy
logprobs, streamed or whole."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import Request
from fastapi.responses import Response

from iterserve.engine.validation import check_prompt_ids
from iterserve.errors import EngineDeadError, RequestError, RequestFailedError
from iterserve.outputs import RequestOutput
from iterserve.server.admission import Outputs
from iterserve.server.errors import bad_request, engine_error, request_error
from iterserve.server.protocol import CompletionRequest
from iterserve.server.request_body import validated
from iterserve.server.response_bodies import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    PromptLogprob,
)
from iterserve.server.serving import (
    LogprobPairs,
    OpenAIServing,
    best_logprobs,
    finite,
    new_logprobs,
    total_usage_of,
)
from iterserve.server.streaming import merged, sse

MAX_PROMPTS = 256  # prompts in one /v1/completions request (each is a request of its own in the engine)


def _prompt_logprobs(out: RequestOutput, n: int | None) -> list[dict[int, PromptLogprob] | None] | None:
    """vLLM's ``prompt_logprobs`` of a choice: the prompt token's entry and its top ``n``, per prompt token."""
    if n is None or out.prompt_logprobs is None:
        return None
    return [None if entry is None else {
        t: PromptLogprob(logprob=finite(v.logprob), rank=v.rank, decoded_token=v.decoded_token)
        for t, v in entry.items() if t == token or v.rank is not None and v.rank <= n}
        for token, entry in zip(out.prompt_token_ids, out.prompt_logprobs)]


class CompletionServing(OpenAIServing):
    """The completions route."""

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
            lp.token_logprobs.append(finite(entry[token].logprob))
            top = best_logprobs(entry, n) if n else [(token, entry[token])]
            lp.top_logprobs.append({self._token_text(t): finite(v.logprob) for t, v in top})
        return lp

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

    async def completions(self, body: Annotated[CompletionRequest, validated(CompletionRequest)],
                           request: Request) -> Response:
        constraint = self._accept(body)
        params = body.completion_params(constraint)
        await self._check_grammar(constraint, body.structured_outputs_field or "structured_outputs")
        prompts = await self._completion_prompts(body.prompt, body.echo)
        request_id, lora = f"cmpl-{uuid.uuid4().hex}", self._check_model(body.model)
        streams = await self._submit_all(request_id, [ids for ids, _ in prompts], params, bool(body.stream), lora)
        echoes = [text if body.echo else "" for _, text in prompts]
        model = self._response_model(lora)
        if body.stream:
            return self._streaming(self._completion_events(request_id, model, streams, body, echoes), streams)
        finals = await self._final_outputs(streams, request)
        if finals is None:
            return Response(status_code=499)
        # built and serialized off the event loop: a response of many logprobs takes seconds
        return Response(await asyncio.to_thread(self._completion_body, finals, echoes, body, request_id, model),
                        media_type="application/json")

    def _completion_body(self, finals: list[RequestOutput], echoes: list[str], body: CompletionRequest,
                         request_id: str, model: str) -> bytes:
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
        return CompletionResponse(id=request_id, model=model, choices=choices,
                                  usage=total_usage_of(finals)).model_dump_json().encode()

    @staticmethod
    def _echo_logprobs(out: RequestOutput, echo: str) -> LogprobPairs:
        """The echoed prompt's (token, logprobs) pairs; the first token has none."""
        if not echo or out.prompt_logprobs is None:
            return []
        return list(zip(out.prompt_token_ids, out.prompt_logprobs))

    async def _completion_events(self, request_id: str, model: str, streams: list[Outputs], body: CompletionRequest,
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
                    pairs = self._echo_logprobs(out, echo) + new_logprobs(c)
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
                    yield sse(CompletionResponse(id=request_id, created=created, model=model, choices=[choice]))
            if body.include_usage and all(f is not None for f in finals):
                yield sse(CompletionResponse(id=request_id, created=created, model=model,
                                              choices=[], usage=total_usage_of(finals)))  # type: ignore[arg-type]
        except (EngineDeadError, RequestFailedError) as e:
            yield sse(engine_error(e).body())
        finally:
            for stream in streams:
                stream.close()
        yield "data: [DONE]\n\n"

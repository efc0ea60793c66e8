"""``POST /tokenize`` and ``POST /detokenize``: vLLM's tokenizer endpoints, bounded by max_model_len."""

from __future__ import annotations

import asyncio
from typing import Annotated

from iterserve.server.errors import bad_request
from iterserve.server.protocol import DetokenizeRequest, TokenizeRequest
from iterserve.server.request_body import validated
from iterserve.server.response_bodies import DetokenizeResponse, TokenizeResponse
from iterserve.server.serving import OpenAIServing


class TokenizeServing(OpenAIServing):
    """The tokenize and detokenize routes."""

    async def tokenize(self, body: Annotated[TokenizeRequest, validated(TokenizeRequest)]) -> TokenizeResponse:
        """Token ids of a prompt or conversation of up to max_model_len tokens (longer text is refused,
        so that this endpoint cannot be made to tokenize arbitrarily much)."""
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("send exactly one of 'prompt' and 'messages'", "prompt")
        limit = self.engine.max_model_len
        if body.messages is not None:
            param = "messages"
            ids = await self._encode_chat(body.messages, limit,
                                          options={"add_generation_prompt": body.add_generation_prompt})
        else:
            param = "prompt"
            ids = await self._encode(body.prompt or "", param, limit, body.add_special_tokens)
        if len(ids) > limit:
            raise bad_request(f"the text has {len(ids)} tokens, more than max_model_len ({limit})", param,
                              "context_length_exceeded")
        strs = [self._tokenizer().id_to_token(t) or "" for t in ids] if body.return_token_strs else None
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=limit, token_strs=strs)

    async def detokenize(self, body: Annotated[DetokenizeRequest, validated(DetokenizeRequest)]) -> DetokenizeResponse:
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

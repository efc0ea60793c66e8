"""The checks of a tokenized request, in one place: the engine core runs them before it queues a request,
and the server's client (and its prompt-length precheck) before it sends one."""

from __future__ import annotations

from iterserve.config.runtime import MAX_LOGPROBS
from iterserve.errors import RequestError, SamplingParamsError
from iterserve.sampling_params import SamplingParams


def check_prompt_ids(token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """A prompt's ids: not empty, leaving room for one generated token, each in the vocabulary
    (the length first: it is cheap, and a huge list is refused before it is walked)."""
    n = len(token_ids)
    if not n:
        raise RequestError("prompt is empty", "prompt")
    if n >= max_model_len:
        raise RequestError(f"prompt has {n} tokens but max_model_len is {max_model_len}: no room for a generated "
                           "token", "prompt", "context_length_exceeded")
    bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"prompt token ids must be integers in [0, {vocab_size}); got {bad[:5]}", "prompt")


def check_logprobs(params: SamplingParams, max_logprobs: int) -> None:
    """Refuse more top alternatives per token than the engine's ``max_logprobs`` (vLLM's check and words)."""
    for name, asked in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
        if asked is not None and asked > max_logprobs:
            kind = "sample" if name == "logprobs" else "prompt"
            raise SamplingParamsError(name, f"Requested {kind} logprobs of {asked}, which is greater than max "
                                            f"allowed: {max_logprobs} (max_logprobs)")


def check_prompt(token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                 max_num_seqs: int | None = None, max_logprobs: int = MAX_LOGPROBS) -> int:
    """Validate a tokenized request (the one home of these checks, for the server too); returns its
    max_tokens resolved against max_model_len. Raises :class:`RequestError`."""
    check_prompt_ids(token_ids, vocab_size, max_model_len)
    check_logprobs(params, max_logprobs)
    for name, ids in (("logit_bias", params.logit_bias or {}), ("allowed_token_ids", params.allowed_token_ids or [])):
        outside = [t for t in ids if t >= vocab_size]
        if outside:
            raise SamplingParamsError(name, f"{name} token ids must be in [0, {vocab_size}); got {outside[:5]}")
    if max_num_seqs is not None and params.num_seqs > max_num_seqs:
        raise SamplingParamsError("n", f"n/best_of ({params.num_seqs}) exceeds max_num_seqs ({max_num_seqs}): "
                                       "the sequences could never run together")
    n = len(token_ids)
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - n
    if n + max_tokens > max_model_len:
        raise RequestError(
            f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds "
            f"max_model_len ({max_model_len})", "max_tokens", "context_length_exceeded",
        )
    return max_tokens

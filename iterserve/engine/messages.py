"""The typed messages between the API side and the engine core, small enough to send every step.

In: a request as token ids plus its sampling parameters, aborts, shutdown. Out: per step, one delta
per request that advanced (only the new tokens) and the scheduler's counters. No text travels here:
tokenizing and detokenizing happen on the API side. The same structs are used in-process by the
offline engine and serialized with msgspec's MessagePack when the core runs in its own process.
"""

from __future__ import annotations

import msgspec

from iterserve.engine.sequence import TokenLogprobs
from iterserve.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


EngineCoreInput = EngineCoreRequest | AbortRequests | Shutdown


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's progress in one step: only what is new."""

    request_id: str
    new_token_ids: list[int]
    timestamp: float  # when the step's tokens were sampled (time.perf_counter, shared across processes)
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # stop, length or error (aborts are not reported back)
    stop_reason: int | None = None  # the stop token id that ended it
    first_scheduled_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    index: int = 0  # which of the request's n (or best_of) sequences advanced
    cumulative_logprob: float | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with the request's first token
    final_token_is_text: bool = False  # a "stop" at the end of a grammar: the last token is output, not a stop token


class SchedulerStats(msgspec.Struct, array_like=True):
    """The core's state after a step, and its counters since start (for metrics and admission)."""

    num_running: int
    num_waiting: int
    num_requests_received: int  # every ADD the core has taken, so the client knows which are still in flight
    kv_cache_usage: float
    num_steps: int
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    step_tokens: int  # tokens computed in the last step (0 when no step ran)


class EngineCoreOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats


class EngineReady(msgspec.Struct, tag="ready"):
    """Sent once the core process has loaded the model and is taking requests."""

    pid: int


class EngineFailed(msgspec.Struct, tag="failed"):
    """The core process could not start or its loop broke; the details are in its log."""

    message: str


EngineCoreEvent = EngineCoreOutputs | EngineReady | EngineFailed

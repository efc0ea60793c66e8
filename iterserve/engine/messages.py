"""The typed messages between the API side and the engine core, small enough to send every step.

In: a request as token ids plus its sampling parameters, aborts, shutdown, and whether a dashboard
watches the KV pool. Out: per step, one delta per request that advanced (only the new tokens), the
scheduler's counters, the step's record (:class:`StepStats`, the step trace's schema) and, while a
dashboard watches, now and then a snapshot of every KV block's state. No text travels here:
tokenizing and detokenizing happen on the API side. The same structs are used in-process by the
offline engine and serialized with msgspec's MessagePack when the core runs in its own process.
Last, the two interfaces the API side reports what these messages carry to: the server's metrics and the
dashboard.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from iterserve.lora.request import LoRARequest
from iterserve.outputs import RequestOutput, TokenLogprobs
from iterserve.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    lora: LoRARequest | None = None  # the LoRA adapter the request runs under (None: the base model)


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]
    # single sequences of n > 1 requests (request id, index), ended by a stop string; the rest go on
    sequences: list[tuple[str, int]] = msgspec.field(default_factory=list)


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class WatchKV(msgspec.Struct, tag="watch_kv"):
    """Start (a dashboard opened) or stop (the last one closed) sending KV block snapshots."""

    on: bool


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache"):
    """Empty the prefix cache before the next step (requests sent after it find nothing cached)."""


EngineCoreInput = EngineCoreRequest | AbortRequests | Shutdown | WatchKV | ResetPrefixCache


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
    error: str | None = None  # with finish_reason "error" when the request caused it (its grammar's budget)


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
    # speculative decoding since start, as vLLM counts it (engine/spec_decode/stats.py)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []
    kv_events_dropped: int = 0  # KV-cache events the publisher's full queue dropped since start
    running_loras: list[str] = []  # the LoRA adapters of the running requests, by name (with enable_lora)
    waiting_loras: list[str] = []  # and of the waiting ones


class BatchRow(msgspec.Struct, array_like=True):
    """One sequence of a step's batch: a row of the step trace and of the dashboard's running batch."""

    request_id: str
    phase: str  # "prefill" or "decode", as the sequence was scheduled
    num_tokens: int  # computed in this step
    num_computed_tokens: int  # held in the KV cache after the step
    num_output_tokens: int  # generated so far


class StepStats(msgspec.Struct, tag_field="type", tag="step"):
    """What one step did: a line of the JSON-lines step trace (``{"type": "step", ...}``, read by
    ``bench throughput --timeline`` and the simulator's calibration) and the dashboard's feed."""

    step: int
    start: float  # time.perf_counter when the step began
    duration: float
    num_running: int
    num_waiting: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_prefill_seqs: int
    num_decode_seqs: int
    kv_blocks_used: int
    prefix_hit_tokens: int
    num_preemptions: int
    total_context: int  # KV tokens the scheduled sequences hold after the step (what attention read)
    seqs: list[BatchRow] = []
    # speculative decoding: sequences that verified drafts, draft tokens (inside the decode tokens), accepted ones
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


# KV block states in a KVSnapshot, one byte per block.
KV_FREE = 0  # holds nothing worth keeping
KV_CACHED = 1  # free, but its prefix can still be hit by the prefix cache until it is handed out again
KV_SHARED = 2  # held by more than one sequence (a prefix-cache hit, or the n > 1 siblings of one request)
KV_HELD = 3  # held by one running sequence that the snapshot's step did not schedule
KV_FIRST_ROW = 4  # KV_FIRST_ROW + i: held by row i of the step's batch alone (255 for every row from 251 on)


class KVSnapshot(msgspec.Struct, array_like=True):
    """Every KV block's state after step ``step`` (block i is byte i), for a dashboard's grid."""

    step: int
    blocks: bytes


class EngineCoreOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    step: StepStats | None = None  # the step's record, when the core keeps them (a server's core always does)
    kv: KVSnapshot | None = None  # while a dashboard watches, at a bounded rate


class LoadedWeights(msgspec.Struct, array_like=True):
    """The core's weights held in one storage format (``Q4_1``, ``int8``, ``float32``...): tensors, parameters and
    bytes, shared tensors once (under tensor parallelism, the core's own rank 0 shard)."""

    format: str
    tensors: int
    parameters: int
    bytes: int


class EngineReady(msgspec.Struct, tag="ready"):
    """Sent once the core process has loaded the model and is taking requests, saying what it holds."""

    pid: int
    weights: list[LoadedWeights] = msgspec.field(default_factory=list)


class EngineFailed(msgspec.Struct, tag="failed"):
    """The core process could not start or its loop broke; the details are in its log."""

    message: str


EngineCoreEvent = EngineCoreOutputs | EngineReady | EngineFailed


class EngineObserver(Protocol):
    """Where the client reports what it sees (the server's Prometheus metrics); ``engine`` is the replica."""

    def record_stats(self, engine: int, stats: SchedulerStats, num_waiting: int) -> None: ...

    def record_admitted(self, engine: int, max_tokens: int) -> None: ...

    def record_finished(self, engine: int, output: RequestOutput) -> None: ...

    def record_finish_reason(self, engine: int, reason: str) -> None: ...

    def record_weights(self, engine: int, weights: list[LoadedWeights]) -> None: ...

    def record_restart(self, engine: int) -> None: ...


class StepObserver(Protocol):
    """Where the client reports each step's record, KV snapshots and finished requests (the dashboard)."""

    def record_step(self, step: StepStats | None, kv: KVSnapshot | None, stats: SchedulerStats) -> None: ...

    def record_finished(self, output: RequestOutput) -> None: ...

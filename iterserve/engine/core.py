"""EngineCore: the busy loop's pieces, with no text and no HTTP.

``add_request`` takes token ids and SamplingParams; ``step`` schedules, runs one forward pass and
lets the scheduler apply the samples, then returns one small delta per request that advanced plus
the scheduler's counters. A step that raises fails only the requests it scheduled (finish reason
"error", blocks freed, traceback logged); the core carries on with the others.

The offline engine calls it on the caller's thread; the server runs it on the main thread of its
own process (:mod:`iterserve.engine.core_client`), so all torch work stays on one thread team.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import IO

import msgspec
import torch

from iterserve.config import EngineConfig, ModelConfig, parse_dtype
from iterserve.config.units import parse_size
from iterserve.distributed.executor import Executor
from iterserve.engine.block_manager import BlockManager
from iterserve.engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    KVSnapshot,
    SchedulerStats,
    StepStats,
)
from iterserve.engine.model_runner import ModelRunner
from iterserve.engine.scheduler import Scheduler, SchedulerOutput
from iterserve.engine.sequence import Sequence
from iterserve.engine.structured_output import GrammarCompiler, GrammarMatcher
from iterserve.errors import RequestError, TensorParallelError
from iterserve.models.loader import LoadedModel, load_model, load_model_info
from iterserve.outputs import RequestMetrics
from iterserve.sampling_params import SamplingParams, SamplingParamsError
from iterserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Test hook: a step that schedules a request whose prompt contains this token id raises before the
# forward pass, as a fault in the model would. Read once when the core is built.
FAULT_TOKEN_ENV = "ITERSERVE_TEST_FAULT_TOKEN"

# While a dashboard watches, a KV block snapshot is taken at most this often, and less often when
# taking one is slow (it walks every block): its cost stays under KV_SNAPSHOT_BUDGET of the core's time.
KV_SNAPSHOT_MIN_INTERVAL_S = 0.1
KV_SNAPSHOT_BUDGET = 0.005


@dataclass(frozen=True)
class Capacity:
    """What the KV pool holds; a pure function of the config and the model's shape."""

    kv_bytes_per_token: int
    num_blocks: int
    block_size: int
    total_tokens: int
    max_model_len: int
    max_full_length_seqs: int

    @classmethod
    def of(cls, config: EngineConfig, model_config: ModelConfig, dtype_bytes: int | None = None) -> Capacity:
        """Raises ValueError when the pool cannot hold one block or one max_model_len sequence.

        Under tensor parallelism the pool is one rank's: ``kv_cache_memory`` is per rank, and a rank's
        token holds only its KV heads, so the same memory holds more tokens.
        """
        bs = config.block_size
        shard = model_config.tensor_parallel_shard(config.tensor_parallel_size)
        per_token = shard.kv_bytes_per_token(dtype_bytes or parse_dtype(config.dtype).itemsize)
        num_blocks = config.num_kv_blocks or parse_size(config.kv_cache_memory) // (bs * per_token)
        if num_blocks < 1:
            raise ValueError(f"KV cache memory {config.kv_cache_memory!r} does not hold a single block of {bs} tokens")
        capacity = num_blocks * bs
        max_len = config.max_model_len or min(model_config.max_position_embeddings, capacity)
        if max_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_len} exceeds the model's maximum context ({model_config.max_position_embeddings})"
            )
        if max_len > capacity:
            raise ValueError(
                f"max_model_len {max_len} needs more KV cache than the pool holds ({capacity} tokens in "
                f"{num_blocks} blocks); raise kv_cache_memory/num_kv_blocks or lower max_model_len"
            )
        return cls(per_token, num_blocks, bs, capacity, max_len, capacity // max_len)


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


def check_prompt(token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                 max_num_seqs: int | None = None) -> int:
    """Validate a tokenized request (the one home of these checks, for the server too); returns its
    max_tokens resolved against max_model_len. Raises :class:`RequestError`."""
    check_prompt_ids(token_ids, vocab_size, max_model_len)
    outside = [t for t in params.logit_bias or {} if t >= vocab_size]
    if outside:
        raise SamplingParamsError("logit_bias", f"logit_bias token ids must be in [0, {vocab_size}); got {outside[:5]}")
    if params.structured_outputs is not None and params.num_seqs > 1:
        raise SamplingParamsError("n", "n or best_of above 1 cannot be combined with structured output yet")
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


def stop_token_ids(params: SamplingParams, model_config: ModelConfig, tokenizer: Tokenizer | None) -> frozenset[int]:
    """The tokens that end a request: its stop_token_ids, plus the model's EOS unless ignore_eos."""
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        if tokenizer is not None:
            ids |= tokenizer.eos_token_ids
        eos = model_config.eos_token_id
        ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return frozenset(ids)


class EngineCore:
    """With ``tensor_parallel_size`` > 1 this is rank 0: it starts (or, under torchrun, joins) the workers
    and holds the first shard of the model."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.executor: Executor | None = None
        if config.tensor_parallel_size > 1:
            if loaded is not None:
                raise ValueError("loaded= shares one process's whole model; it cannot be combined with "
                                 "tensor_parallel_size > 1, where each rank loads its shard")
            # a model that does not split is refused here, before any worker starts to find out alone
            load_model_info(config.model)[0].tensor_parallel_shard(config.tensor_parallel_size)
            self.executor = Executor.start(config)
        try:
            self.loaded = loaded or load_model(config.model, config.dtype, self.executor.device if self.executor
                                               else config.device, config.seed,
                                               parallel=self.executor.parallel if self.executor else None)
            self.model_config = self.loaded.config
            model = self.loaded.model
            self.capacity = Capacity.of(config, self.model_config, model.dtype.itemsize)
            self.max_model_len = self.capacity.max_model_len
            bs, num_blocks = config.block_size, self.capacity.num_blocks
            self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching)
            self.scheduler = Scheduler(config.scheduler_config(self.max_model_len), self.block_manager)
            self.runner = ModelRunner(model, num_blocks, bs, config.seed, self.executor)
            if self.executor is not None:
                self.executor.ready()
        except BaseException:
            if self.executor is not None:
                self.executor.abort()
            raise
        self.requests: dict[str, Sequence] = {}
        self._grammar_compiler: GrammarCompiler | None = None
        self.num_requests_received = 0
        self.num_steps = 0
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.peak_running = 0
        self._last_step_tokens = 0
        self.step_history: deque[StepStats] = deque(maxlen=config.step_history)
        self.emit_steps = False  # attach each step's StepStats to its outputs (the server's core does)
        self.watch_kv = False  # a dashboard watches: kv_snapshot() hands out snapshots
        self._next_kv_snapshot = 0.0
        self._last_batch: list[Sequence] = []  # the last step's sequences, in row order
        self._trace: IO[str] | None = open(config.step_trace, "w") if config.step_trace else None
        fault = os.environ.get(FAULT_TOKEN_ENV)
        self._fault_token = int(fault) if fault else None
        c = self.capacity
        logger.info(
            "KV cache: %d bytes/token (%s), %d blocks x %d tokens = %d tokens; %d sequences of max_model_len=%d fit",
            c.kv_bytes_per_token, str(model.dtype).removeprefix("torch."), c.num_blocks, bs, c.total_tokens,
            c.max_full_length_seqs, c.max_model_len,
        )

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a tokenized request; raises ValueError (and queues nothing) for bad input."""
        self.num_requests_received += 1
        rid, params = request.request_id, request.params
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        ids = request.prompt_token_ids
        max_tokens = check_prompt(ids, params, self.model_config.vocab_size, self.max_model_len,
                                  self.config.max_num_seqs)
        stop_ids = stop_token_ids(params, self.model_config, self.loaded.tokenizer)
        group = [
            Sequence(
                request_id=rid, prompt=None, prompt_token_ids=list(ids), params=params, max_tokens=max_tokens,
                metrics=RequestMetrics(arrival_time=request.arrival_time, num_prompt_tokens=len(ids)),
                stop_ids=stop_ids, index=index, generator=self._generator(params.seed, index),
                grammar=self._grammar_for(params),
            )
            for index in range(params.num_seqs)
        ]
        seq = group[0]
        seq.forks, seq.group = group[1:], group
        self.requests[rid] = seq
        self.scheduler.add(seq)

    def _generator(self, seed: int | None, index: int) -> torch.Generator | None:
        """A seeded request's own generator; sequence ``index`` of an n > 1 request gets one derived
        from (seed, index), so each is reproducible and they differ."""
        if seed is None:
            return None
        derived = seed if index == 0 else hash((seed, index)) % 2**63  # ints and tuples hash stably
        return torch.Generator(self.runner.device).manual_seed(derived % 2**64)

    def _grammar_for(self, params: SamplingParams) -> GrammarMatcher | None:
        """A fresh matcher for a constrained request (check_prompt allows one sequence per such request)."""
        return None if params.structured_outputs is None else self._grammars().matcher(params.structured_outputs)

    def _grammars(self) -> GrammarCompiler:
        """The compiler for this model's vocabulary, built at the first constrained request (1.3-1.9 s
        for SmolLM2's 49k vocabulary, holding the GIL) so that engines that never see one do not pay."""
        if self._grammar_compiler is None:
            if self.loaded.tokenizer is None:
                raise ValueError(f"model {self.loaded.name!r} has no tokenizer, which structured output needs")
            self._grammar_compiler = GrammarCompiler(self.loaded.tokenizer, self.model_config.vocab_size)
        return self._grammar_compiler

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks; False if it is unknown or done."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        for member in seq.group:
            if not member.is_finished:
                self.scheduler.finish(member, "abort")
                member.metrics.finished_time = time.perf_counter()
        self._trace_request(seq)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- the step -------------------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        """Schedule, run one forward pass, apply the samples; the deltas of requests that advanced."""
        start = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            self._last_step_tokens = 0
            return EngineCoreOutputs([], self.stats())
        for s in sched.scheduled:
            if s.seq.metrics.first_scheduled_time is None:
                s.seq.metrics.first_scheduled_time = start
                s.seq.metrics.num_cached_tokens = s.seq.num_cached_tokens
        try:
            self._inject_fault(sched)
            _, result = self.runner.execute(sched.scheduled, sched.block_copies)
            update = self.scheduler.update_from_output(sched, result)
        except TensorParallelError:
            raise  # a lost rank is fatal: failing this step's requests and going on would fail every step
        except Exception:  # noqa: BLE001 - a fault fails this step's requests, never the core
            logger.exception("step %d failed; failing its %d requests", self.num_steps + 1, len(sched.scheduled))
            outputs = self._fail(sched, time.perf_counter())
            record = self._record(sched, start, time.perf_counter() - start)
            return EngineCoreOutputs(outputs, self.stats(), record if self.emit_steps else None)
        now = time.perf_counter()
        outputs = []
        for seq in update.sampled:
            outputs.append(self._delta(seq, now))
            if seq.is_finished:
                self._retire(seq, now)
        record = self._record(sched, start, now - start)
        return EngineCoreOutputs(outputs, self.stats(), record if self.emit_steps else None)

    def _delta(self, seq: Sequence, now: float) -> EngineCoreOutput:
        m = seq.metrics
        m.token_times.append(now)
        m.num_output_tokens += 1
        if m.first_token_time is None:
            m.first_token_time = now
        self.num_generation_tokens += 1
        first = m.num_output_tokens == 1
        return EngineCoreOutput(
            request_id=seq.request_id, new_token_ids=[seq.output_token_ids[-1]], timestamp=now, index=seq.index,
            new_logprobs=[seq.output_logprobs[-1]] if seq.params.logprobs is not None else None,
            cumulative_logprob=seq.cumulative_logprob if seq.params.needs_logprobs else None,
            prompt_logprobs=seq.prompt_logprobs if first and seq.index == 0 and seq.prompt_logprobs else None,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason if isinstance(seq.stop_reason, int) else None,
            first_scheduled_time=m.first_scheduled_time if first else None,
            num_cached_tokens=seq.num_cached_tokens, num_preemptions=m.num_preemptions,
            final_token_is_text=seq.finish_reason == "stop" and seq.output_token_ids[-1] not in seq.stop_ids,
        )

    def _inject_fault(self, sched: SchedulerOutput) -> None:
        if self._fault_token is not None and any(self._fault_token in s.seq.prompt_token_ids for s in sched.scheduled):
            raise RuntimeError(f"injected fault: a scheduled prompt holds token {self._fault_token}")

    def _fail(self, sched: SchedulerOutput, now: float) -> list[EngineCoreOutput]:
        """Fail every request this step scheduled, all of its sequences."""
        outputs = []
        parents = {s.seq.request_id: self.requests.get(s.seq.request_id) for s in sched.scheduled}
        for parent in parents.values():
            if parent is None:
                continue
            for seq in parent.group:
                if seq.is_finished:
                    continue
                self.scheduler.finish(seq, "error")
                self._retire(seq, now)
                outputs.append(EngineCoreOutput(seq.request_id, [], now, index=seq.index, finish_reason="error",
                                                first_scheduled_time=seq.metrics.first_scheduled_time))
        return outputs

    def _retire(self, seq: Sequence, now: float) -> None:
        """A finished sequence; the request leaves once all its sequences have."""
        seq.metrics.finished_time = now
        parent = self.requests.get(seq.request_id)
        if parent is not None and all(member.is_finished for member in parent.group):
            del self.requests[seq.request_id]
            self._trace_request(parent)

    # -- statistics -----------------------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=self.num_running, num_waiting=self.num_waiting,
            num_requests_received=self.num_requests_received, kv_cache_usage=self.block_manager.usage,
            num_steps=self.num_steps, num_preemptions=self.num_preemptions, num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens, prefix_hit_tokens=self.prefix_hit_tokens,
            prefix_query_tokens=self.prefix_query_tokens, step_tokens=self._last_step_tokens,
        )

    def _record(self, sched: SchedulerOutput, start: float, duration: float) -> StepStats | None:
        """Count the step; its StepStats when someone keeps them (history, trace or the server)."""
        self.num_steps += 1
        self.num_preemptions += len(sched.preempted)
        self.prefix_hit_tokens += sched.prefix_hit_tokens
        self.prefix_query_tokens += sched.prefix_query_tokens
        prefill = [s for s in sched.scheduled if s.is_prefill]
        self.num_prompt_tokens += sum(s.num_tokens for s in prefill)
        self.peak_running = max(self.peak_running, len(sched.scheduled))
        self._last_step_tokens = sched.num_tokens
        self._last_batch = [s.seq for s in sched.scheduled]
        if not self.step_history.maxlen and self._trace is None and not self.emit_steps:
            return None
        stats = StepStats(
            step=self.num_steps, start=start, duration=duration,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_prefill_tokens=sum(s.num_tokens for s in prefill),
            num_decode_tokens=sum(s.num_tokens for s in sched.scheduled if not s.is_prefill),
            num_prefill_seqs=len(prefill), num_decode_seqs=len(sched.scheduled) - len(prefill),
            kv_blocks_used=self.block_manager.num_used_blocks, prefix_hit_tokens=sched.prefix_hit_tokens,
            num_preemptions=len(sched.preempted),
            total_context=sum(s.seq.num_computed_tokens for s in sched.scheduled),
            seqs=sched.batch_rows(),
        )
        if self.step_history.maxlen:
            self.step_history.append(stats)
        if self._trace is not None:
            self._trace.write(msgspec.json.encode(stats).decode() + "\n")
            self._trace.flush()  # readable while the engine runs (a server's trace is read live)
        return stats

    def kv_snapshot(self, force: bool = False) -> KVSnapshot | None:
        """Every KV block's state after the last step, rows numbered as in its StepStats; None unless
        a dashboard watches and one is due (``force``: due now, e.g. when the engine falls idle)."""
        start = time.perf_counter()
        if not self.watch_kv or (start < self._next_kv_snapshot and not force):
            return None
        snapshot = KVSnapshot(self.num_steps, self.block_manager.block_states(self._last_batch))
        took = time.perf_counter() - start
        self._next_kv_snapshot = start + max(KV_SNAPSHOT_MIN_INTERVAL_S, took / KV_SNAPSHOT_BUDGET)
        return snapshot

    def _trace_request(self, seq: Sequence) -> None:
        if self._trace is not None:
            record = {"type": "request", "request_id": seq.request_id, "finish_reason": seq.finish_reason}
            self._trace.write(json.dumps({**record, **seq.metrics.as_dict()}) + "\n")
            self._trace.flush()

    def close(self) -> None:
        if self._trace is not None:
            self._trace.close()
            self._trace = None
        if self.executor is not None:
            self.executor.close()

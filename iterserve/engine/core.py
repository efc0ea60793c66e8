"""EngineCore, with no text and no HTTP.

``add_request`` takes token ids and SamplingParams; ``step`` schedules, runs one forward pass and
lets the scheduler apply the samples, then returns one small delta per request that advanced plus
the scheduler's counters. A step that raises fails only the requests it scheduled (finish reason
"error", blocks freed, traceback logged); the core carries on with the others.

The offline engine calls it on the caller's thread; the server runs it on the main thread of its
own process (:mod:`iterserve.engine.core_proc`), so all torch work stays on one thread team. The model
runs under an :class:`~iterserve.engine.executor.Executor`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import IO

import msgspec
import torch

from iterserve.config import EngineConfig, ModelConfig
from iterserve.engine.block_manager import BlockManager
from iterserve.engine.executor import Executor, start_executor
from iterserve.engine.kv_events import start_publisher
from iterserve.engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    KVSnapshot,
    SchedulerStats,
    StepStats,
)
from iterserve.engine.scheduler import Scheduler, SchedulerOutput
from iterserve.engine.sequence import Sequence
from iterserve.engine.spec_decode.proposer import Proposer, Speculator
from iterserve.engine.spec_decode.stats import SpecDecodeStats
from iterserve.engine.structured_output import GrammarMatcher, GrammarPool
from iterserve.engine.validation import check_prompt
from iterserve.engine.window_blocks import WindowBlocks
from iterserve.errors import SamplingParamsError, TensorParallelError
from iterserve.models.loader import LoadedModel
from iterserve.outputs import RequestMetrics
from iterserve.sampling_params import SamplingParams
from iterserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Test hook: a step that schedules a request whose prompt contains this token id raises before the
# forward pass, as a fault in the model would. Read once when the core is built.
FAULT_TOKEN_ENV = "ITERSERVE_TEST_FAULT_TOKEN"

# While a dashboard watches, a KV block snapshot is taken at most this often, and less often when
# taking one is slow (it walks every block): its cost stays under KV_SNAPSHOT_BUDGET of the core's time.
KV_SNAPSHOT_MIN_INTERVAL_S = 0.1
KV_SNAPSHOT_BUDGET = 0.005

COMPILE_WAIT_S = 0.05  # an otherwise idle step waits this long for a grammar to compile


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
    """The scheduler, the block manager and every request's state, over an :class:`Executor` that runs the
    model: in this process, or over tensor-parallel workers with this process as rank 0. ``executor``
    plugs in another (built for ``config``); by default :func:`start_executor` picks one.

    ``clock`` stamps every time the core records (first scheduled, each token, finish, the step trace):
    ``time.perf_counter`` by default, which the API process's arrival stamps share; a simulator passes
    its virtual clock, which its executor advances by each step's modelled time. ``proposer`` drafts the
    speculative tokens in place of the one ``config.speculative_config`` names (a simulator's)."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 executor: Executor | None = None, clock: Callable[[], float] = time.perf_counter,
                 proposer: Proposer | None = None) -> None:
        if executor is not None and loaded is not None:
            raise ValueError("give the engine core a loaded model or an executor, not both")
        self.config = config
        self.clock = clock
        self.executor = executor or start_executor(config, loaded)
        try:
            self.model_config = self.executor.model_config
            self.tokenizer = self.executor.tokenizer
            self.model_name = self.executor.model_name
            self.capacity = self.executor.capacity
            self.max_model_len = self.capacity.max_model_len
            bs, num_blocks, window_blocks = config.block_size, self.capacity.num_blocks, self.capacity.window_blocks
            window = WindowBlocks(window_blocks, bs, self.model_config.sliding_window or 0) if window_blocks else None
            self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching, window)
            self.scheduler = Scheduler(config.scheduler_config(self.max_model_len), self.block_manager, clock)
            spec = config.speculative_config
            self.speculator = (Speculator.build(spec, self.block_manager, self.executor, self.max_model_len,
                                                proposer) if spec is not None else None)
            self.kv_events = start_publisher(config.kv_events_config)  # binds its socket: an error stops the start
            if self.kv_events is not None:
                self.block_manager.record_events()
        except BaseException:
            self.executor.abort()
            raise
        self.requests: dict[str, Sequence] = {}
        # constrained requests whose grammars compile: (request, resolved max_tokens, the compile)
        self._compiling: dict[str, tuple[EngineCoreRequest, int, Future[GrammarMatcher]]] = {}
        self._grammar_pool = GrammarPool(self.tokenizer, self.model_config.vocab_size)
        self.num_requests_received = self.num_steps = self.num_preemptions = 0
        self.prefix_hit_tokens = self.prefix_query_tokens = 0
        self.num_prompt_tokens = self.num_generation_tokens = 0
        self.peak_running = 0
        self.spec_stats = SpecDecodeStats()  # drafts verified and tokens accepted since start
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
        kv_dtype = str(self.executor.dtype).removeprefix("torch.") if config.kv_cache_dtype == "auto" \
            else config.kv_cache_dtype
        if window_blocks and not c.kv_bytes_per_token:
            logger.info("KV cache: every layer attends to a %d-token window: %d bytes/token (%s), %d blocks x %d "
                        "tokens freed as they fall out of the window; %d sequences of max_model_len=%d fit",
                        self.model_config.sliding_window, c.window_bytes_per_token, kv_dtype, window_blocks - 1, bs,
                        c.max_full_length_seqs, c.max_model_len)
        else:
            logger.info(
                "KV cache: %d bytes/token (%s), %d blocks x %d tokens = %d tokens; %d sequences of max_model_len=%d "
                "fit", c.kv_bytes_per_token, kv_dtype, c.num_blocks, bs, c.total_tokens,
                c.max_full_length_seqs, c.max_model_len,
            )
            if window_blocks:
                logger.info("hybrid SWA memory: the sliding-window layers keep %d bytes/token in a pool of their own, "
                            "%d blocks, freed as they fall out of the window", c.window_bytes_per_token,
                            window_blocks - 1)

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> Future[GrammarMatcher] | None:
        """Queue a tokenized request; raises ValueError (and queues nothing) for bad input.

        A constrained request waits while its grammar compiles on the grammar pool, and is scheduled at
        the first step after; the compile's future is returned (it raises ValueError if the grammar
        cannot run, and the request then ends with an error at that step).
        """
        self.num_requests_received += 1
        rid, params = request.request_id, request.params
        if rid in self.requests or rid in self._compiling:
            raise ValueError(f"request id {rid!r} is already in use")
        max_tokens = check_prompt(request.prompt_token_ids, params, self.model_config.vocab_size,
                                  self.max_model_len, self.config.max_num_seqs, self.config.max_logprobs)
        if request.lora is not None:
            if not self.config.enable_lora:
                raise ValueError(f"request {rid!r} names LoRA adapter {request.lora.lora_name!r} but LoRA is not "
                                 "enabled (enable_lora=True / --enable-lora)")
            self.executor.add_lora(request.lora)  # loads and checks it now: a bad adapter fails its request here
        if params.structured_outputs is None:
            self._queue(request, max_tokens, None)
            return None
        future = self._grammar_pool.submit(params.structured_outputs)
        self._compiling[rid] = (request, max_tokens, future)
        return future

    def _queue(self, request: EngineCoreRequest, max_tokens: int, grammar: GrammarMatcher | None) -> None:
        """Hand a checked request to the scheduler; each of its sequences gets its own copy of the grammar."""
        rid, params, ids = request.request_id, request.params, request.prompt_token_ids
        stop_ids = stop_token_ids(params, self.model_config, self.tokenizer)
        if params.bad_words:
            if self.tokenizer is None:
                raise SamplingParamsError("bad_words", f"model {self.model_name!r} has no tokenizer to read bad_words")
            params.update_from_tokenizer(self.tokenizer)
        group = [
            Sequence(
                request_id=rid, prompt=None, prompt_token_ids=list(ids), params=params, max_tokens=max_tokens,
                metrics=RequestMetrics(arrival_time=request.arrival_time, num_prompt_tokens=len(ids)),
                stop_ids=stop_ids, index=index, generator=self._generator(params.seed, index),
                grammar=grammar.copy() if grammar is not None and index else grammar, lora=request.lora,
            )
            for index in range(params.num_seqs)
        ]
        seq = group[0]
        seq.forks, seq.group = group[1:], group
        self.requests[rid] = seq
        self.scheduler.add(seq)

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Queue the requests whose grammars have compiled; fail those whose grammars cannot run. With
        nothing else to run, wait a little for a compile rather than spin."""
        if self._compiling and not self.scheduler.has_unfinished():
            wait([future for _, _, future in self._compiling.values()], COMPILE_WAIT_S, FIRST_COMPLETED)
        failed = []
        for rid, (request, max_tokens, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[rid]
            try:
                self._queue(request, max_tokens, future.result())
            except ValueError as e:
                logger.warning("request %s: its grammar cannot run: %s", rid, e)
                failed.append(EngineCoreOutput(rid, [], self.clock(), finish_reason="error"))
        return failed

    def _generator(self, seed: int | None, index: int) -> torch.Generator | None:
        """A seeded request's own generator; sequence ``index`` of an n > 1 request gets one derived
        from (seed, index), so each is reproducible and they differ."""
        if seed is None:
            return None
        derived = seed if index == 0 else hash((seed, index)) % 2**63  # ints and tuples hash stably
        return torch.Generator(self.executor.device).manual_seed(derived % 2**64)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks; False if it is unknown or done."""
        compiling = self._compiling.pop(request_id, None)
        if compiling is not None:
            compiling[2].cancel()
            return True
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        for member in seq.group:
            if not member.is_finished:
                self.scheduler.finish(member, "abort")
                member.metrics.finished_time = self.clock()
        self._trace_request(seq)
        return True

    def abort_sequence(self, request_id: str, index: int) -> None:
        """Stop one sequence of an n > 1 request (a stop string ended it) and free its blocks; the rest go on."""
        parent = self.requests.get(request_id)
        if parent is not None and index < len(parent.group) and not parent.group[index].is_finished:
            self.scheduler.finish(parent.group[index], "stop")
            self._retire(parent.group[index], self.clock())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._compiling)

    def reset_prefix_cache(self) -> None:
        """Empty the prefix cache between steps (running requests keep their blocks) and publish
        AllBlocksCleared now: an idle engine takes no step that would send it."""
        self.block_manager.reset_prefix_cache()
        self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        if self.kv_events is not None and (events := self.block_manager.take_events()):
            self.kv_events.publish(events)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for the batch, those whose grammars compile included."""
        return len(self.scheduler.waiting) + len(self._compiling)

    # -- the step -------------------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        """Schedule, run one forward pass, apply the samples; the deltas of requests that advanced."""
        refused = self._admit_compiled()
        start = self.clock()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            self._last_step_tokens = 0
            return EngineCoreOutputs(refused, self.stats())
        for s in sched.scheduled:
            if s.seq.metrics.first_scheduled_time is None:
                s.seq.metrics.first_scheduled_time = start
                s.seq.metrics.num_cached_tokens = s.seq.num_cached_tokens
        self._publish_kv_events()  # the blocks this step fills, before the forward pass that fills them
        try:
            self._inject_fault(sched)
            result = self.executor.execute_model(sched.scheduled, sched.block_copies, sched.window_copies)
            update = self.scheduler.update_from_output(sched, result)
        except TensorParallelError:
            raise  # a lost rank is fatal: failing this step's requests and going on would fail every step
        except Exception:  # noqa: BLE001 - a fault fails this step's requests, never the core
            logger.exception("step %d failed; failing its %d requests", self.num_steps + 1, len(sched.scheduled))
            now = self.clock()
            outputs = refused + self._fail(sched, now)
            record = self._record(sched, start, now - start)
            return EngineCoreOutputs(outputs, self.stats(), record if self.emit_steps else None)
        self.spec_stats.add(update.spec)
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        now = self.clock()
        outputs = refused
        for seq in update.sampled:
            outputs.append(self._delta(seq, now, update.new_tokens.get(id(seq), 1)))
            if seq.is_finished:
                self._retire(seq, now)
        record = self._record(sched, start, now - start, update.spec)
        return EngineCoreOutputs(outputs, self.stats(), record if self.emit_steps else None)

    def _delta(self, seq: Sequence, now: float, n: int) -> EngineCoreOutput:
        """The ``n`` tokens ``seq`` got this step (more than one where it accepted drafts)."""
        m = seq.metrics
        m.token_times.extend([now] * n)
        first = m.num_output_tokens == 0
        m.num_output_tokens += n
        if m.first_token_time is None:
            m.first_token_time = now
        self.num_generation_tokens += n
        return EngineCoreOutput(
            request_id=seq.request_id, new_token_ids=seq.output_token_ids[-n:], timestamp=now, index=seq.index,
            new_logprobs=seq.output_logprobs[-n:] if seq.params.logprobs is not None else None,
            cumulative_logprob=seq.cumulative_logprob if seq.params.needs_logprobs else None,
            prompt_logprobs=seq.prompt_logprobs if first and seq.index == 0 and seq.prompt_logprobs else None,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason if isinstance(seq.stop_reason, int) else None,
            first_scheduled_time=m.first_scheduled_time if first else None,
            num_cached_tokens=seq.num_cached_tokens, num_preemptions=m.num_preemptions,
            final_token_is_text=seq.finish_reason == "stop" and seq.output_token_ids[-1] not in seq.stop_ids,
            error=seq.error,
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
            spec_num_drafts=self.spec_stats.num_drafts, spec_num_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
            spec_accepted_per_pos=list(self.spec_stats.accepted_per_pos),
            kv_events_dropped=self.kv_events.dropped if self.kv_events is not None else 0,
            running_loras=self._lora_names(self.scheduler.running) if self.config.enable_lora else [],
            waiting_loras=self._lora_names(self.scheduler.waiting) if self.config.enable_lora else [],
        )

    @staticmethod
    def _lora_names(seqs: Iterable[Sequence]) -> list[str]:
        return sorted({s.lora.lora_name for s in seqs if s.lora is not None})

    def _record(self, sched: SchedulerOutput, start: float, duration: float,
                spec: SpecDecodeStats | None = None) -> StepStats | None:
        """Count the step and publish the KV-cache events it left (evictions, accepted drafts' blocks); its
        StepStats when someone keeps them (history, trace or the server)."""
        self._publish_kv_events()
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
            num_drafts=spec.num_drafts if spec else 0, num_draft_tokens=spec.num_draft_tokens if spec else 0,
            num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
        )
        if self.step_history.maxlen:
            self.step_history.append(stats)
        if self._trace is not None:
            self._trace.write(msgspec.json.encode(stats).decode() + "\n")
            self._trace.flush()  # readable while the engine runs (a server's trace is read live)
        return stats

    def kv_snapshot(self, force: bool = False) -> KVSnapshot | None:
        """Every KV block's state after the last step, rows numbered as in its StepStats; None unless
        a dashboard watches and one is due (``force``: due now, e.g. when the engine falls idle). Paced by
        the wall clock, not ``clock``: the budget is the core's own time spent walking the blocks."""
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
        self._grammar_pool.close()
        if self.kv_events is not None:
            self.kv_events.shutdown()
            self.kv_events = None
        if self._trace is not None:
            self._trace.close()
            self._trace = None
        self.executor.close()

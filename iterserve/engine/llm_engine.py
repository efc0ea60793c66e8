"""The engine loop: requests in, one scheduler step = one forward pass, token deltas out.

``add_request`` validates and queues; ``step`` schedules, runs the model, samples, and turns new
tokens into text, stopping sequences on EOS, stop tokens, stop strings or length; ``abort_request``
frees a request's blocks at once. The server drives ``step`` from a background loop; the offline
:class:`iterserve.LLM` drives it until every request is done.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import IO

import torch

from iterserve.engine.block_manager import BlockManager
from iterserve.engine.model_runner import ModelRunner
from iterserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from iterserve.engine.sequence import RequestMetrics, Sequence, SequenceStatus
from iterserve.models.loader import DEFAULT_MODEL, LoadedModel, load_model
from iterserve.outputs import CompletionOutput, RequestOutput
from iterserve.sampling_params import SamplingParams
from iterserve.tokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)

_SIZE = re.compile(r"^\s*([\d.]+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)


def parse_size(value: str | int) -> int:
    """'2GiB', '512MiB', '1.5GB', 1048576 -> bytes."""
    if isinstance(value, int):
        return value
    m = _SIZE.match(value)
    if not m:
        raise ValueError(f"cannot parse memory size {value!r}; use e.g. '2GiB' or '512MiB'")
    num, unit = float(m.group(1)), (m.group(2) or "B").upper()
    powers = {"K": 1, "M": 2, "G": 3, "T": 4}
    base = 1024 if "I" in unit or unit in ("K", "M", "G", "T") else 1000
    return int(num * (base ** powers.get(unit[0], 0)))


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "bfloat16"
    device: str | None = None
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    kv_cache_memory: str | int = "2GiB"
    num_kv_blocks: int | None = None  # overrides kv_cache_memory
    batching: str = "continuous"
    kv_allocation: str = "paged"
    seed: int = 0
    step_trace: str | None = None  # JSON-lines file of per-step and per-request records


@dataclass
class StepStats:
    """What one step did, for metrics, benchmarks and timelines."""

    step: int
    start: float
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
    seqs: list[tuple[str, str, int]] = field(default_factory=list)  # (request id, prefill|decode, tokens)


@dataclass
class _StreamState:
    """Per-request text state: the detokenizer and how much text has been released."""

    detokenizer: IncrementalDetokenizer | None
    text: str = ""
    sent: int = 0
    sent_tokens: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.loaded = loaded or load_model(config.model, config.dtype, config.device, config.seed)
        self.model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        model = self.loaded.model
        dtype_bytes = model.dtype.itemsize
        self.kv_bytes_per_token = self.model_config.kv_bytes_per_token(dtype_bytes)
        bs = config.block_size
        if bs < 1:
            raise ValueError(f"block_size must be >= 1, got {bs}")
        num_blocks = config.num_kv_blocks or parse_size(config.kv_cache_memory) // (bs * self.kv_bytes_per_token)
        if num_blocks < 1:
            raise ValueError(f"KV cache memory {config.kv_cache_memory!r} does not hold a single block of {bs} tokens")
        capacity = num_blocks * bs
        max_len = config.max_model_len or min(self.model_config.max_position_embeddings, capacity)
        if max_len > self.model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_len} exceeds the model's maximum context "
                f"({self.model_config.max_position_embeddings})"
            )
        if max_len > capacity:
            raise ValueError(
                f"max_model_len {max_len} needs more KV cache than the pool holds ({capacity} tokens in "
                f"{num_blocks} blocks); raise kv_cache_memory/num_kv_blocks or lower max_model_len"
            )
        self.max_model_len = max_len
        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.batching, config.kv_allocation),
            self.block_manager,
        )
        self.runner = ModelRunner(model, num_blocks, bs, config.seed)
        self.requests: dict[str, Sequence] = {}
        self._streams: dict[str, _StreamState] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.peak_running = 0
        self.step_history: deque[StepStats] = deque(maxlen=100_000)
        self._trace: IO[str] | None = open(config.step_trace, "w") if config.step_trace else None
        self.capacity = {
            "kv_bytes_per_token": self.kv_bytes_per_token, "num_blocks": num_blocks, "block_size": bs,
            "total_tokens": capacity, "max_model_len": max_len, "max_full_length_seqs": capacity // max_len,
        }
        logger.info(
            "KV cache: %d bytes/token (%s), %d blocks x %d tokens = %d tokens; %d sequences of max_model_len=%d fit",
            self.kv_bytes_per_token, str(model.dtype).removeprefix("torch."), num_blocks, bs, capacity,
            capacity // max_len, max_len,
        )

    # -- requests -------------------------------------------------------------------------------

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            if self.tokenizer is not None:
                ids |= self.tokenizer.eos_token_ids
            eos = self.model_config.eos_token_id
            ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        return frozenset(ids)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Validate and queue a request; raises ValueError (and queues nothing) for bad input."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"model {self.loaded.name!r} has no tokenizer; pass the prompt as token ids")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
            vocab = self.model_config.vocab_size
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        if not token_ids:
            raise ValueError("prompt is empty")
        n = len(token_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt has {n} tokens but max_model_len is {self.max_model_len}: no room for a generated token"
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds "
                f"max_model_len ({self.max_model_len})"
            )
        device = self.runner.device
        seq = Sequence(
            request_id=request_id, prompt=text, prompt_token_ids=token_ids, params=params, max_tokens=max_tokens,
            metrics=RequestMetrics(arrival_time=arrival_time or time.perf_counter(), num_prompt_tokens=n),
            stop_ids=self._stop_ids(params),
            generator=None if params.seed is None else torch.Generator(device=device).manual_seed(params.seed),
        )
        self.requests[request_id] = seq
        detok = self.tokenizer.detokenizer(params.skip_special_tokens) if self.tokenizer is not None else None
        self._streams[request_id] = _StreamState(detok)
        self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks; False if it is unknown or done."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        self._streams.pop(request_id, None)
        self.scheduler.finish(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"
        seq.metrics.finished_time = time.perf_counter()
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

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, sample; return outputs of requests that advanced."""
        start = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        for s in sched.scheduled:
            if s.seq.metrics.first_scheduled_time is None:
                s.seq.metrics.first_scheduled_time = start
                s.seq.metrics.num_cached_tokens = s.seq.num_cached_tokens
        sampled, result = self.runner.execute(sched.scheduled)
        now = time.perf_counter()
        for s in sched.scheduled:
            s.seq.num_computed_tokens += s.num_tokens
            self.block_manager.commit(s.seq)
        outputs = []
        for s, token, logprobs in zip(sampled, result.token_ids, result.logprobs):
            outputs.append(self._append_token(s.seq, token, logprobs, now))
        self._record(sched, start, time.perf_counter() - start)
        return outputs

    def _append_token(self, seq: Sequence, token: int, logprobs: dict[int, float] | None, now: float) -> RequestOutput:
        seq.output_token_ids.append(token)
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
        m = seq.metrics
        m.token_times.append(now)
        m.num_output_tokens += 1
        if m.first_token_time is None:
            m.first_token_time = now
        self.num_generation_tokens += 1
        p = seq.params
        n_out = len(seq.output_token_ids)
        if token in seq.stop_ids and n_out >= p.min_tokens:
            seq.finish_reason = "stop"
            seq.stop_reason = token if token in p.stop_token_ids else None
        elif n_out >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        state = self._streams[seq.request_id]
        if state.detokenizer is not None:
            if not (seq.finish_reason == "stop" and token in seq.stop_ids):  # a stop token adds no text
                state.text += state.detokenizer.feed(token)
            if seq.finish_reason is not None:
                state.text += state.detokenizer.flush()
            self._check_stop_strings(seq, state)
        if seq.finish_reason is not None:
            seq.status = SequenceStatus.FINISHED
            m.finished_time = now
            self.scheduler.finish(seq)
            self.requests.pop(seq.request_id, None)
            self._streams.pop(seq.request_id, None)
            self._trace_request(seq)
        return self._output(seq, state)

    def _check_stop_strings(self, seq: Sequence, state: _StreamState) -> None:
        stops = seq.params.stop
        if not stops or seq.finish_reason == "stop":
            return
        longest = max(map(len, stops))
        search_from = max(0, state.sent - longest)
        best: tuple[int, str] | None = None
        for s in stops:
            i = state.text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None and len(seq.output_token_ids) >= seq.params.min_tokens:
            state.text = state.text[: best[0]]
            seq.finish_reason, seq.stop_reason = "stop", best[1]

    def _releasable(self, seq: Sequence, state: _StreamState) -> int:
        """How much text may be streamed: hold back a tail that could still become a stop string."""
        if seq.finish_reason is not None or not seq.params.stop:
            return len(state.text)
        text, hold = state.text, 0
        for s in seq.params.stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return len(text) - hold

    def _output(self, seq: Sequence, state: _StreamState) -> RequestOutput:
        upto = max(state.sent, self._releasable(seq, state))
        delta_text = state.text[state.sent:upto]
        state.sent = upto
        delta_ids = seq.output_token_ids[state.sent_tokens:]
        state.sent_tokens = len(seq.output_token_ids)
        completion = CompletionOutput(
            index=0, text=state.text[:upto], token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
            delta_text=delta_text, delta_token_ids=delta_ids,
        )
        return RequestOutput(
            request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=seq.prompt_token_ids,
            outputs=[completion], finished=seq.is_finished, metrics=seq.metrics, num_cached_tokens=seq.num_cached_tokens,
        )

    # -- statistics -----------------------------------------------------------------------------

    def _record(self, sched: SchedulerOutput, start: float, duration: float) -> None:
        self.num_steps += 1
        self.num_preemptions += len(sched.preempted)
        self.prefix_hit_tokens += sched.prefix_hit_tokens
        self.prefix_query_tokens += sched.prefix_query_tokens
        self.num_prompt_tokens += sum(s.num_tokens for s in sched.scheduled if s.is_prefill)
        self.peak_running = max(self.peak_running, len(sched.scheduled))
        prefill = [s for s in sched.scheduled if s.is_prefill]
        stats = StepStats(
            step=self.num_steps, start=start, duration=duration,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_prefill_tokens=sum(s.num_tokens for s in prefill),
            num_decode_tokens=sum(s.num_tokens for s in sched.scheduled if not s.is_prefill),
            num_prefill_seqs=len(prefill), num_decode_seqs=len(sched.scheduled) - len(prefill),
            kv_blocks_used=self.block_manager.num_used_blocks, prefix_hit_tokens=sched.prefix_hit_tokens,
            num_preemptions=len(sched.preempted),
            seqs=[(s.seq.request_id, "prefill" if s.is_prefill else "decode", s.num_tokens) for s in sched.scheduled],
        )
        self.step_history.append(stats)
        if self._trace is not None:
            self._trace.write(json.dumps({"type": "step", **asdict(stats)}) + "\n")

    def _trace_request(self, seq: Sequence) -> None:
        if self._trace is not None:
            record = {"type": "request", "request_id": seq.request_id, "finish_reason": seq.finish_reason}
            self._trace.write(json.dumps({**record, **seq.metrics.as_dict()}) + "\n")
            self._trace.flush()

    def close(self) -> None:
        if self._trace is not None:
            self._trace.close()
            self._trace = None

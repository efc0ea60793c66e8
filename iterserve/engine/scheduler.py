"""Iteration-level scheduling: decide, every step, which tokens of which sequences run.

Continuous batching fills each step's token budget with the running sequences' next tokens first
(one decode token each, or the next chunk of a prompt still being prefilled), then admits waiting
requests in arrival order, chunking the last prompt to fit. A request therefore joins the batch at
the next step and leaves the moment it finishes. When the KV pool runs dry, the most recently
admitted running sequence is preempted: its blocks are freed and it is recomputed later.

After the forward pass, :meth:`Scheduler.update_from_output` is the one place a sequence's progress
moves: computed tokens advance, full blocks enter the prefix cache (KV-cache events announced them when
they were scheduled), the sampled token is
appended, token-level stops are applied and finished sequences leave the batch.

With speculative decoding a decoding sequence may carry draft tokens: it is scheduled for 1 + k
tokens (its next token and the k drafts, all inside the step's token budget) and gets back the
drafts the verifier accepted followed by one sampled token. Only accepted tokens count as computed;
the KV slots of rejected drafts are simply overwritten later, and blocks allocated past the new end
are returned at once. Stops apply token by token along the accepted run.

Static batching runs on the same machinery but admits a new batch only when the previous one has
completely finished; that is the behaviour continuous batching removes. Dynamic batching (as TGI's
and Triton's request batchers do) also runs each batch to completion, but forms it as requests
arrive: with the engine idle, a batch starts once ``max_num_seqs`` requests wait or the oldest has
waited ``max_batch_wait`` seconds. Until then :meth:`Scheduler.schedule` schedules nothing and
:meth:`Scheduler.hold_s` says how long the engine may sleep.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from iterserve.config import SchedulerConfig
from iterserve.engine.block_manager import BlockManager
from iterserve.engine.messages import BatchRow
from iterserve.engine.sampler import SampleResult
from iterserve.engine.sequence import Sequence, SequenceStatus
from iterserve.engine.spec_decode.stats import SpecDecodeStats
from iterserve.outputs import TokenLogprobs

logger = logging.getLogger(__name__)

# a dynamic batch's wait closer to its end than this is over: a clock that adds the wait back to the
# time it was read at (a simulator's) can land a rounding error short of the end, and must not spin there
HOLD_RESOLUTION_S = 1e-9


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens of this sequence computed in this step (drafts included)
    spec_token_ids: list[int] = field(default_factory=list)  # the drafts this step verifies (they come last)
    is_prefill: bool = field(init=False)  # fixed when scheduled: the sequence moves on after the step

    def __post_init__(self) -> None:
        self.is_prefill = self.seq.is_prefill

    @property
    def samples(self) -> bool:
        """This step computes the sequence's last token, so the model samples its next one."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens + len(self.spec_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # decodes first, then prefills
    preempted: list[Sequence] = field(default_factory=list)
    prefix_hit_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    prefix_query_tokens: int = 0  # tokens of the sequences admitted (the hit rate's denominator)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) before the step
    window_copies: list[tuple[int, int]] = field(default_factory=list)  # the same in the windowed layers' pool

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def batch_rows(self) -> list[BatchRow]:
        """The step's batch as the step trace records it; read after the step has been applied."""
        return [BatchRow(s.seq.request_id, "prefill" if s.is_prefill else "decode", s.num_tokens,
                         s.seq.num_computed_tokens, len(s.seq.output_token_ids)) for s in self.scheduled]


def sampling_seqs(scheduled: list[ScheduledSeq]) -> list[Sequence]:
    """The sequences that get a token this step, in order: each one that computed its last token,
    followed by the children it forks now (they sample from the same logits)."""
    seqs: list[Sequence] = []
    for s in scheduled:
        if s.samples:
            seqs.append(s.seq)
            seqs.extend(s.seq.forks)
    return seqs


@dataclass
class SchedulerUpdate:
    """What one step changed: the sequences that got a token (in step order) and those that finished."""

    sampled: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    new_tokens: dict[int, int] = field(default_factory=dict)  # id(seq) -> tokens it got, where more than one
    spec: SpecDecodeStats = field(default_factory=SpecDecodeStats)  # this step's drafts and acceptances


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        """``clock`` is the time requests' arrival times are on (a simulator passes its own)."""
        self.config = config
        self.block_manager = block_manager
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self.static_batch: set[str] = set()  # request ids of the current static or dynamic batch

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def hold_s(self) -> float:
        """Seconds until a dynamic batch may start (0: the next :meth:`schedule` has work, or nothing waits).

        The engine is idle and the waiting requests do not fill a batch yet: the batch starts when the
        oldest has waited ``max_batch_wait``, or sooner if more requests arrive and fill it."""
        cfg = self.config
        if cfg.batching != "dynamic" or self.running or not self.waiting or len(self.waiting) >= cfg.max_num_seqs:
            return 0.0
        left = self.waiting[0].metrics.arrival_time + cfg.max_batch_wait - self.clock()
        return left if left > HOLD_RESOLUTION_S else 0.0

    def _reserve(self, seq: Sequence) -> int:
        """Tokens' worth of blocks to hold from admission on (reserved allocation): the whole output, and
        for a group (n > 1) each child's share too, so that no sequence of it is ever preempted."""
        if self.config.kv_allocation != "reserved":
            return 0
        tokens = seq.num_tokens + seq.max_tokens - len(seq.output_token_ids)
        if not seq.forks:
            return tokens
        bm = self.block_manager
        own = bm.blocks_needed(tokens)
        return (own + len(seq.forks) * (own - seq.num_tokens // bm.block_size)) * bm.block_size

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        decodes: list[ScheduledSeq] = []
        verifies: list[ScheduledSeq] = []  # decodes with drafts: after the one-token decodes, as attention wants
        prefills: list[ScheduledSeq] = []

        # 1. Running sequences, oldest first: their next token (and its drafts), or the next chunk of their prompt.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            drafts = self._fit_drafts(seq, budget - num_new)
            if drafts:
                verifies.append(ScheduledSeq(seq, num_new + len(drafts), drafts))
                budget -= num_new + len(drafts)
                i += 1
                continue
            while not bm.allocate(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                (prefills if seq.is_prefill else decodes).append(ScheduledSeq(seq, num_new))
                budget -= num_new
                i += 1
                continue
            break  # the sequence preempted itself: nothing later in the list can run either

        # 2. Waiting sequences in arrival order, unless this step had to preempt. A static or dynamic batch
        # admits only its own members; a new one is formed once the last has finished (dynamic: and has filled).
        static = self.config.batching != "continuous"
        if static and not self.running:
            held = self.hold_s() > 0
            batch = [] if held else list(self.waiting)[: self.config.max_num_seqs]
            self.static_batch = {s.request_id for s in batch}
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if static and seq.request_id not in self.static_batch:
                break
            if len(self.running) + 1 + len(seq.forks) > self.config.max_num_seqs:
                break  # the group's children join the batch when it samples its first token
            if not self._lora_fits(seq):
                break  # its adapter would be one too many in the batch: it waits for one to leave
            hits = bm.find_cached_prefix(seq)
            num_computed = len(hits) * bm.block_size
            num_new = min(seq.num_tokens - num_computed, budget)
            if not bm.allocate(seq, num_new, hits, reserve_tokens=self._reserve(seq)):
                break
            if hits:
                seq.num_computed_tokens = num_computed
                if seq.metrics.num_preemptions == 0:
                    seq.num_cached_tokens = num_computed
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.prefix_hit_tokens += num_computed
            out.prefix_query_tokens += seq.num_tokens
            prefills.append(ScheduledSeq(seq, num_new))
            budget -= num_new

        out.scheduled = decodes + verifies + prefills
        out.block_copies, out.window_copies = bm.take_copies(), bm.take_window_copies()
        for s in out.scheduled:  # drafts are announced once accepted, when committed
            bm.announce(s.seq, s.num_tokens - len(s.spec_token_ids))
        return out

    def _lora_fits(self, seq: Sequence) -> bool:
        """Whether ``seq``'s LoRA adapter can join the running batch: at most ``max_loras`` adapters run at once
        (every running sequence counts, scheduled this step or not, so a step never holds more)."""
        if seq.lora is None or self.config.max_loras is None:
            return True
        running = {s.lora.lora_int_id for s in self.running if s.lora is not None}
        return seq.lora.lora_int_id in running or len(running) < self.config.max_loras

    def _fit_drafts(self, seq: Sequence, budget: int) -> list[int]:
        """The drafts of a decoding sequence that this step verifies, its KV blocks allocated: as many as
        the token budget left over leaves room for; none when the pool cannot hold them, so that drafts
        never preempt anyone (the sequence then decodes one token as usual)."""
        drafts, seq.spec_token_ids = seq.spec_token_ids[:max(0, budget)], []
        if drafts and self.block_manager.allocate(seq, 1 + len(drafts)):
            return drafts
        return []

    def update_from_output(self, out: SchedulerOutput, result: SampleResult) -> SchedulerUpdate:
        """Apply a step's results: ``result`` holds one sample per scheduled sequence that computed its
        last token, in scheduled order, preceded by the drafts it accepted where it verified some.
        Finished sequences are freed and returned."""
        update = SchedulerUpdate()
        sampling = sampling_seqs(out.scheduled)
        if len(sampling) != len(result.token_ids):
            raise ValueError(f"{len(result.token_ids)} samples for {len(sampling)} sampling sequences")
        drafts: dict[int, list[int]] = {}  # id(seq) -> the drafts it verified
        for i, s in enumerate(out.scheduled):
            seq, samples = s.seq, s.samples  # before its progress moves
            first, entries = result.prompt_logprobs.get(i, (1, []))
            if entries and not seq.prompt_logprobs:
                seq.prompt_logprobs.append(None)  # the first prompt token has no context to predict it
            for k, entry in enumerate(entries):
                if first + k == len(seq.prompt_logprobs):  # a recompute after preemption adds nothing twice
                    seq.prompt_logprobs.append(entry)
            seq.num_computed_tokens += s.num_tokens - len(s.spec_token_ids)  # drafts count once accepted
            self.block_manager.commit(seq)
            if s.spec_token_ids:
                drafts[id(seq)] = s.spec_token_ids
            if samples and seq.forks:
                self._fork(seq)
        for k, (seq, token, logprobs) in enumerate(zip(sampling, result.token_ids, result.logprobs)):
            verdict = result.verdicts.get(k)
            run = [*zip(verdict.accepted, verdict.logprobs), (token, logprobs)] if verdict else [(token, logprobs)]
            if id(seq) in drafts:
                update.spec.observe(len(drafts[id(seq)]), len(run) - 1)
            update.sampled.append(seq)
            if len(run) > 1:
                update.new_tokens[id(seq)] = self._append_run(seq, run)
            else:
                self._append(seq, token, logprobs)
            if id(seq) in drafts:  # the accepted drafts' KV was computed in this step: publish their blocks
                seq.num_computed_tokens = seq.num_tokens - 1
                self.block_manager.commit(seq)
            if seq.finish_reason is not None:
                self.finish(seq, seq.finish_reason)
                update.finished.append(seq)
            elif id(seq) in drafts and self.config.kv_allocation != "reserved":  # a reservation keeps its blocks
                self.block_manager.trim(seq)
        return update

    def _append(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> None:
        """Append one sampled token; a token-level stop sets the sequence's finish reason."""
        seq.output_token_ids.append(token)
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs[token][0]
        reason = self._stop_reason(seq, token)
        if reason is not None:
            seq.finish_reason = reason

    def _append_run(self, seq: Sequence, run: list[tuple[int, TokenLogprobs | None]]) -> int:
        """Append accepted drafts and the token sampled after them, one at a time, so a stop within the
        run ends the sequence exactly where decoding one token per step would have; how many went in."""
        for n, (token, logprobs) in enumerate(run, start=1):
            self._append(seq, token, logprobs)
            if seq.finish_reason is not None:
                return n
        return len(run)

    def _fork(self, parent: Sequence) -> None:
        """The parent's prompt is computed: its children join the batch holding the same blocks (reserved
        allocation: the prompt's full blocks, plus each child's share of the group's reservation)."""
        if self.config.kv_allocation == "reserved":
            own = self.block_manager.blocks_needed(parent.num_tokens + parent.max_tokens)
            self.block_manager.fork_reserved(parent, parent.forks, own)
        for child in parent.forks:
            child.num_computed_tokens = parent.num_computed_tokens
            if self.config.kv_allocation != "reserved":
                self.block_manager.fork(parent, child)
            child.metrics.first_scheduled_time = parent.metrics.first_scheduled_time
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
        parent.forks = []

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        """Token-level stops: a grammar over its limits (first: its last mask may have allowed any token),
        a stop or EOS token (once min_tokens are out), the end of the request's grammar, max_tokens,
        max_model_len. A grammar advances here with each token it is given."""
        n_out = len(seq.output_token_ids)
        if seq.grammar is not None and (failure := seq.grammar.failure) is not None:
            return self._grammar_failed(seq, failure)
        if token in seq.stop_ids and n_out >= seq.params.min_tokens:
            seq.stop_reason = token if token in seq.params.stop_token_ids else None
            return "stop"
        if seq.grammar is not None:
            if not seq.grammar.accept(token):
                logger.error("request %s: its grammar refused token %d: %s", seq.request_id, token, seq.grammar.error)
                return "error"
            if (failure := seq.grammar.failure) is not None:
                return self._grammar_failed(seq, failure)
            if seq.grammar.is_terminated:
                return "stop"
        max_len = self.config.max_model_len
        if n_out >= seq.max_tokens or (max_len is not None and seq.num_tokens >= max_len):
            return "length"
        return None

    @staticmethod
    def _grammar_failed(seq: Sequence, failure: str) -> str:
        seq.error = f"{failure}; an ambiguous grammar slows with every token: make it unambiguous"
        logger.warning("request %s: %s", seq.request_id, seq.error)
        return "error"

    def finish(self, seq: Sequence, reason: str = "abort") -> None:
        """End a sequence wherever it is (``reason``: stop, length, abort or error) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        self.static_batch.discard(seq.request_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

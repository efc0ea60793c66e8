"""The output side: core deltas -> text, stop strings and vLLM-shaped RequestOutputs.

Runs wherever the caller is (the offline engine's thread, the server's event loop), never in the
core. Each request keeps its detokenizer and its text; stop strings are found here, and a request
that hits one is returned for the core to abort. What a consumer gets depends on its output kind:
``DELTA`` (streaming) carries only what is new, ``FINAL_ONLY`` one cumulative output at the end,
``CUMULATIVE`` everything so far at every step (the token lists are the request's own, not copies).
A request with n (or best_of) above 1 keeps one such state per sequence: a DELTA output carries
the one sequence that advanced, under its ``index``; a finished best_of request keeps the n with
the highest cumulative logprob.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from iterserve.engine.messages import EngineCoreOutput
from iterserve.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
    TokenLogprobs,
)
from iterserve.sampling_params import RequestOutputKind, SamplingParams
from iterserve.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class SeqState:
    """One of a request's n (or best_of) sequences: its detokenizer, its text and how much was released."""

    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)  # kept unless the kind is DELTA
    logprobs: SampleLogprobs | None = None
    text: str = ""
    sent: int = 0  # characters of text already released
    num_output_tokens: int = 0
    num_preemptions: int = 0
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    core_finished: bool = False  # the core has ended it too (a stop string ends it here first)


@dataclass
class RequestState:
    """One request's output-side state: its sequences and the request-level facts."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    kind: RequestOutputKind
    metrics: RequestMetrics
    seqs: list[SeqState]
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


@dataclass
class ProcessedOutputs:
    outputs: list[RequestOutput] = field(default_factory=list)
    to_abort: list[str] = field(default_factory=list)  # finished here (a stop string) but still alive in the core
    # (request id, index): one of an n > 1 request's sequences ended here by a stop string while its
    # siblings go on; the core stops computing it and frees its blocks
    seqs_to_abort: list[tuple[str, int]] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # request id -> how it failed, where it was its own doing


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float, kind: RequestOutputKind) -> None:
        keep_logprobs = params.logprobs is not None and kind is not RequestOutputKind.DELTA
        seqs = [
            SeqState(i, self.tokenizer.detokenizer(params.skip_special_tokens)
                     if self.tokenizer is not None and params.detokenize else None,
                     logprobs=[] if keep_logprobs else None)
            for i in range(params.num_seqs)
        ]
        self.states[request_id] = RequestState(
            request_id, prompt, prompt_token_ids, params, kind,
            RequestMetrics(arrival_time=arrival_time, num_prompt_tokens=len(prompt_token_ids)), seqs,
        )

    def abort(self, request_id: str) -> bool:
        return self.states.pop(request_id, None) is not None

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.states

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        result = ProcessedOutputs()
        for o in outputs:
            if o.error is not None:
                result.errors[o.request_id] = o.error
            state = self.states.get(o.request_id)
            if state is None or o.index >= len(state.seqs):  # aborted, or ended by a stop string
                continue
            seq = state.seqs[o.index]
            if seq.finish_reason is not None:  # ended here by a stop string while the core ran on
                seq.core_finished = seq.core_finished or o.finish_reason is not None
                continue
            out = self._process(state, seq, o)
            if state.finished:
                del self.states[o.request_id]
                if not all(s.core_finished for s in state.seqs):
                    result.to_abort.append(o.request_id)
            elif seq.finish_reason is not None and not seq.core_finished:
                seq.core_finished = True  # the core is told now and reports nothing more for it
                result.seqs_to_abort.append((o.request_id, o.index))
            if out is not None:
                result.outputs.append(out)
        return result

    def _decode_logprobs(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        return {t: Logprob(lp, rank, decode([t]) if decode else None) for t, (lp, rank) in entry.items()}

    def _process(self, state: RequestState, seq: SeqState, o: EngineCoreOutput) -> RequestOutput | None:
        m = state.metrics
        if o.first_scheduled_time is not None and m.first_scheduled_time is None:
            m.first_scheduled_time = o.first_scheduled_time
        seq.finish_reason, seq.stop_reason = o.finish_reason, o.stop_reason
        seq.core_finished = o.finish_reason is not None
        if o.finish_reason == "error":  # a failure fails the whole request
            for s in state.seqs:
                if s.finish_reason is None:
                    s.finish_reason, s.core_finished = "error", True
        delta_ids = o.new_token_ids
        if seq.detokenizer is not None:
            delta_ids = delta_ids[:self._detokenize(state.params, seq, o)]
        n = len(delta_ids)
        if n:
            m.first_token_time = m.first_token_time or o.timestamp
            m.token_times.extend([o.timestamp] * n)
            m.num_output_tokens += n
            seq.num_output_tokens += n
        if o.index == 0:  # the sequence that was admitted; the others fork off it
            m.num_cached_tokens = state.num_cached_tokens = o.num_cached_tokens
        seq.num_preemptions = o.num_preemptions
        m.num_preemptions = sum(s.num_preemptions for s in state.seqs)
        if o.prompt_logprobs is not None:
            state.prompt_logprobs = [None if e is None else self._decode_logprobs(e) for e in o.prompt_logprobs]
        if o.cumulative_logprob is not None:
            seq.cumulative_logprob = o.cumulative_logprob
        delta_logprobs = [self._decode_logprobs(e) for e in o.new_logprobs[:n]] if o.new_logprobs else None
        if state.kind is not RequestOutputKind.DELTA:
            seq.token_ids.extend(delta_ids)
            if seq.logprobs is not None and delta_logprobs:
                seq.logprobs.extend(delta_logprobs)
        if state.finished:
            m.finished_time = o.timestamp
        return self._output(state, seq, delta_ids, delta_logprobs)

    def _detokenize(self, params: SamplingParams, seq: SeqState, o: EngineCoreOutput) -> int:
        """Add the delta's text token by token, checking stop strings after each, as if the tokens had
        come one per step; returns how many of the delta's tokens stand (those after a stop string that
        ends inside the delta were never generated, as far as the request is concerned)."""
        assert seq.detokenizer is not None
        ids = o.new_token_ids
        # a stop token ends the request but adds no text, unless asked to (a special one is skipped anyway)
        ends_on_stop_token = o.finish_reason == "stop" and not o.final_token_is_text
        text_ids = ids[:-1] if ends_on_stop_token and not params.include_stop_str_in_output else ids
        for i, token in enumerate(text_ids):
            seq.text += seq.detokenizer.feed(token)
            # a token before the delta's last one ended nothing in the core: only its text can stop here
            if i < len(ids) - 1 and self._check_stop_strings(params, seq, seq.num_output_tokens + i + 1):
                return i + 1
        if o.finish_reason is not None:
            seq.text += seq.detokenizer.flush()
        if o.finish_reason in (None, "length"):
            self._check_stop_strings(params, seq, seq.num_output_tokens + len(ids))
        return len(ids)

    def _check_stop_strings(self, params: SamplingParams, seq: SeqState, num_output_tokens: int) -> bool:
        """End ``seq`` at the first stop string in its text (cut off there); whether one was found."""
        stops = params.stop
        if not stops or num_output_tokens < params.min_tokens:
            return False
        search_from = max(0, seq.sent - max(map(len, stops)))
        best: tuple[int, str] | None = None
        for s in stops:
            i = seq.text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        seq.text = seq.text[: best[0] + (len(best[1]) if params.include_stop_str_in_output else 0)]
        seq.finish_reason, seq.stop_reason = "stop", best[1]
        return True

    def _releasable(self, params: SamplingParams, seq: SeqState) -> int:
        """How much text may be released: hold back a tail that could still become a stop string."""
        text = seq.text
        if seq.finish_reason is not None or not params.stop or params.include_stop_str_in_output:
            return len(text)  # a stop string that completes later stays in the text anyway
        hold = 0
        for s in params.stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return len(text) - hold

    def _completion(self, state: RequestState, seq: SeqState, index: int) -> CompletionOutput:
        """The cumulative output of one sequence; its delta fields hold what this call releases."""
        upto = max(seq.sent, self._releasable(state.params, seq))
        delta_text = seq.text[seq.sent:upto]
        seq.sent = upto
        return CompletionOutput(index, seq.text[:upto], seq.token_ids, seq.finish_reason, seq.stop_reason,
                                seq.logprobs, delta_text, [], seq.cumulative_logprob)

    def _output(self, state: RequestState, seq: SeqState, delta_ids: list[int],
                delta_logprobs: SampleLogprobs | None) -> RequestOutput | None:
        finished = state.finished
        if state.kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if state.kind is RequestOutputKind.DELTA:
            upto = max(seq.sent, self._releasable(state.params, seq))
            delta_text = seq.text[seq.sent:upto]
            seq.sent = upto
            logprobs = (delta_logprobs or []) if state.params.logprobs is not None else None
            completions = [CompletionOutput(seq.index, delta_text, delta_ids, seq.finish_reason, seq.stop_reason,
                                            logprobs, delta_text, delta_ids, seq.cumulative_logprob)]
        else:
            seqs = state.seqs
            if finished and len(seqs) > state.params.n:  # best_of: the n most likely, best first
                seqs = sorted(seqs, key=lambda s: s.cumulative_logprob or 0.0, reverse=True)[:state.params.n]
            completions = [self._completion(state, s, i if finished else s.index) for i, s in enumerate(seqs)]
            for c, s in zip(completions, seqs):
                if s is seq:
                    c.delta_token_ids = delta_ids
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions, finished,
                             state.metrics, state.num_cached_tokens, state.prompt_logprobs)

"""The output side: core deltas -> text, stop strings and vLLM-shaped RequestOutputs.

Runs wherever the caller is (the offline engine's thread, the server's event loop), never in the
core. Each request keeps its detokenizer and its text; stop strings are found here, and a request
that hits one is returned for the core to abort. What a consumer gets depends on its output kind:
``DELTA`` (streaming) carries only what is new, ``FINAL_ONLY`` one cumulative output at the end,
``CUMULATIVE`` everything so far at every step (the token lists are the request's own, not copies).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from iterserve.engine.messages import EngineCoreOutput
from iterserve.engine.sequence import RequestMetrics
from iterserve.outputs import CompletionOutput, RequestOutput
from iterserve.sampling_params import SamplingParams
from iterserve.tokenizer import IncrementalDetokenizer, Tokenizer


class RequestOutputKind(enum.Enum):
    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass
class RequestState:
    """One request's output-side state: detokenizer, the text so far and how much was released."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    kind: RequestOutputKind
    detokenizer: IncrementalDetokenizer | None
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)  # kept unless the kind is DELTA
    logprobs: list[dict[int, float]] | None = None
    text: str = ""
    sent: int = 0  # characters of text already released
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class ProcessedOutputs:
    outputs: list[RequestOutput] = field(default_factory=list)
    to_abort: list[str] = field(default_factory=list)  # finished here (a stop string) but still alive in the core


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float, kind: RequestOutputKind) -> None:
        detok = self.tokenizer.detokenizer(params.skip_special_tokens) if self.tokenizer is not None else None
        self.states[request_id] = RequestState(
            request_id, prompt, prompt_token_ids, params, kind, detok,
            RequestMetrics(arrival_time=arrival_time, num_prompt_tokens=len(prompt_token_ids)),
            logprobs=[] if params.logprobs is not None and kind is not RequestOutputKind.DELTA else None,
        )

    def abort(self, request_id: str) -> bool:
        return self.states.pop(request_id, None) is not None

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.states

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        result = ProcessedOutputs()
        for o in outputs:
            state = self.states.get(o.request_id)
            if state is None:  # aborted, or ended by a stop string while the core ran on
                continue
            out = self._process(state, o)
            if state.finish_reason is not None:
                del self.states[o.request_id]
                if o.finish_reason is None:
                    result.to_abort.append(o.request_id)
            if out is not None:
                result.outputs.append(out)
        return result

    def _process(self, state: RequestState, o: EngineCoreOutput) -> RequestOutput | None:
        m = state.metrics
        if o.first_scheduled_time is not None:
            m.first_scheduled_time = o.first_scheduled_time
        n = len(o.new_token_ids)
        if n:
            m.first_token_time = m.first_token_time or o.timestamp
            m.token_times.extend([o.timestamp] * n)
            m.num_output_tokens += n
        m.num_cached_tokens = state.num_cached_tokens = o.num_cached_tokens
        m.num_preemptions = o.num_preemptions
        delta_ids, delta_logprobs = o.new_token_ids, o.new_logprobs
        if state.kind is not RequestOutputKind.DELTA:
            state.token_ids.extend(delta_ids)
            if state.logprobs is not None and delta_logprobs:
                state.logprobs.extend(delta_logprobs)
        state.finish_reason, state.stop_reason = o.finish_reason, o.stop_reason
        if state.detokenizer is not None:
            # a stop token ends the request but adds no text
            text_ids = delta_ids[:-1] if o.finish_reason == "stop" and not o.final_token_is_text else delta_ids
            state.text += "".join(state.detokenizer.feed(t) for t in text_ids)
            if o.finish_reason is not None:
                state.text += state.detokenizer.flush()
            if o.finish_reason in (None, "length"):
                self._check_stop_strings(state)
        if state.finish_reason is not None:
            m.finished_time = o.timestamp
        return self._output(state, delta_ids, delta_logprobs)

    def _check_stop_strings(self, state: RequestState) -> None:
        stops = state.params.stop
        if not stops or state.metrics.num_output_tokens < state.params.min_tokens:
            return
        search_from = max(0, state.sent - max(map(len, stops)))
        best: tuple[int, str] | None = None
        for s in stops:
            i = state.text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            state.text = state.text[: best[0]]
            state.finish_reason, state.stop_reason = "stop", best[1]

    def _releasable(self, state: RequestState) -> int:
        """How much text may be released: hold back a tail that could still become a stop string."""
        text = state.text
        if state.finish_reason is not None or not state.params.stop:
            return len(text)
        hold = 0
        for s in state.params.stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return len(text) - hold

    def _output(self, state: RequestState, delta_ids: list[int],
                delta_logprobs: list[dict[int, float]] | None) -> RequestOutput | None:
        finished = state.finish_reason is not None
        if state.kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        upto = max(state.sent, self._releasable(state))
        delta_text = state.text[state.sent:upto]
        state.sent = upto
        if state.kind is RequestOutputKind.DELTA:
            logprobs = (delta_logprobs or []) if state.params.logprobs is not None else None
            completion = CompletionOutput(0, delta_text, delta_ids, state.finish_reason, state.stop_reason, logprobs,
                                          delta_text, delta_ids)
        else:
            completion = CompletionOutput(0, state.text[:upto], state.token_ids, state.finish_reason,
                                          state.stop_reason, state.logprobs, delta_text, delta_ids)
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, [completion], finished,
                             state.metrics, state.num_cached_tokens)

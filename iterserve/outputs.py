"""What the engine hands back: vLLM-shaped request outputs, cumulative or only this step's delta."""

from __future__ import annotations

from dataclasses import dataclass, field

# One token's logprobs as the sampler gives them: token id -> (logprob, rank in the vocabulary, 1 = most likely).
TokenLogprobs = dict[int, tuple[float, int]]


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (seconds, ``time.perf_counter`` base) and counts for one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies: gaps between consecutive generated tokens."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (last - first token time) / (tokens - 1)."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "arrival_time": self.arrival_time, "first_scheduled_time": self.first_scheduled_time,
            "first_token_time": self.first_token_time, "finished_time": self.finished_time,
            "ttft": self.ttft, "tpot": self.tpot, "e2e_latency": self.e2e_latency, "queue_time": self.queue_time,
            "num_prompt_tokens": self.num_prompt_tokens, "num_cached_tokens": self.num_cached_tokens,
            "num_output_tokens": self.num_output_tokens, "num_preemptions": self.num_preemptions,
        }


@dataclass
class Logprob:
    """One token's log-probability, as vLLM returns it: ``rank`` 1 is the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per token: token id -> Logprob, holding the chosen token and the requested top alternatives.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]  # the first prompt token has none


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    logprobs: SampleLogprobs | None = None
    delta_text: str = ""  # text released in this step (never past a stop string)
    delta_token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None  # set when logprobs were asked for (or best_of ranked by it)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None

    def add(self, later: RequestOutput) -> None:
        """Merge a later delta output of the same request into this unread one (a slow consumer's backlog)."""
        for theirs in later.outputs:
            mine = next((c for c in self.outputs if c.index == theirs.index), None)
            if mine is None:
                self.outputs.append(theirs)
                continue
            mine.text += theirs.text
            mine.delta_text = mine.text
            mine.token_ids.extend(theirs.token_ids)
            mine.delta_token_ids = mine.token_ids
            if mine.logprobs is not None:
                mine.logprobs.extend(theirs.logprobs or [])
            mine.finish_reason, mine.stop_reason = theirs.finish_reason, theirs.stop_reason
            mine.cumulative_logprob = theirs.cumulative_logprob
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs
        self.finished = later.finished

"""What the engine hands back: vLLM-shaped request outputs, cumulative plus this step's delta."""

from __future__ import annotations

from dataclasses import dataclass, field

from iterserve.engine.sequence import RequestMetrics


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    logprobs: list[dict[int, float]] | None = None
    delta_text: str = ""  # text released in this step (never past a stop string)
    delta_token_ids: list[int] = field(default_factory=list)

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

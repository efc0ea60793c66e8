"""Serving metrics with vLLM's definitions and field names, so results compare with ``vllm bench serve``.

Per request, as its client saw it (seconds from sending it):

* TTFT: until the first chunk that carries generated text;
* ITL: the gaps between consecutive text chunks;
* end-to-end latency (E2EL): until the last text chunk;
* TPOT: ``(E2EL - TTFT) / (output tokens - 1)``, defined for requests with 2+ output tokens.

Over a run of ``duration`` seconds, throughputs divide completed requests and their tokens by
the duration; ``request_goodput`` counts only completed requests that meet every SLO given
(``ttft``, ``tpot``, ``e2el`` in milliseconds; a request of one token has TPOT 0 for this test).
Means, medians, standard deviations and percentiles (numpy's linear interpolation) are over
completed requests; ITL statistics pool every gap of every request.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_PERCENTILES = (90.0, 99.0)


@dataclass
class RequestResult:
    """One request's outcome; times in seconds."""

    prompt_len: int
    output_len: int = 0  # generated tokens: the server's usage count, else counted by the client
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # end to end
    success: bool = False
    error: str = ""
    start_time: float = 0.0  # when it was sent, seconds after the run began

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


def percentile_key(p: float) -> str:
    """vLLM's spelling of a percentile in field names: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def parse_percentiles(text: str) -> list[float]:
    """``"90,99"`` -> [90.0, 99.0], each in (0, 100]."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"percentiles must be numbers separated by commas, got {text!r}") from None
    if not values or not all(0 < v <= 100 for v in values):
        raise ValueError(f"percentiles must be in (0, 100], got {text!r}")
    return values


def parse_goodput(items: Iterable[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if name not in SLO_METRICS or ms < 0:
            raise ValueError(
                f"goodput SLO {item!r} must be METRIC:MILLISECONDS with METRIC one of {', '.join(SLO_METRICS)}"
            )
        slos[name] = ms
    return slos


def _stats(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(values_s if len(values_s) else [0.0], dtype=float) * 1000.0
    out = {
        f"mean_{name}_ms": float(ms.mean()),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(ms.std()),
    }
    for p in percentiles:
        out[f"p{percentile_key(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def is_good(r: RequestResult, slos: dict[str, float]) -> bool:
    """Whether a completed request met every SLO (milliseconds)."""
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
    return all(values[k] * 1000.0 <= limit for k, limit in slos.items())


def compute_metrics(
    results: Sequence[RequestResult],
    duration: float,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    goodput: dict[str, float] | None = None,
) -> dict[str, Any]:
    """A run's summary under vLLM's field names, plus the per-request lists."""
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration}")
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    tpots = [t for r in ok if (t := r.tpot) is not None]
    summary: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration,
        "request_goodput": sum(is_good(r, goodput) for r in ok) / duration if goodput else None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    summary |= _stats("ttft", [r.ttft for r in ok], percentiles)
    summary |= _stats("tpot", tpots, percentiles)
    summary |= _stats("itl", [gap for r in ok for gap in r.itl], percentiles)
    summary |= _stats("e2el", [r.latency for r in ok], percentiles)
    summary |= {
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len if r.success else 0 for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "start_times": [r.start_time for r in results],
        "errors": [r.error for r in results],
    }
    return summary

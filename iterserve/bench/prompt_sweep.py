"""Prompt-length sweep: time to first token grows with the prompt, time per output token does not.

One request at a time goes through the engine at each prompt length, so nothing else shares its
steps. Its first step is the prefill: one forward pass over every prompt token, which also yields
the first output token, so TTFT is the cost of that pass. Every later step is a decode: one pass
that adds one token. The step trace shows both: the tokens each step processed and how many steps
a request took (``1 + (output_len - 1)`` with the prompt in one chunk). Wall-clock figures are
medians over ``repeats`` requests with min and max kept.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from iterserve.bench.timeline import read_trace
from iterserve.bench.workloads import random_tokens
from iterserve.config import EngineConfig
from iterserve.engine.llm_engine import LLMEngine
from iterserve.models.loader import LoadedModel
from iterserve.sampling_params import SamplingParams


@dataclass
class PromptPoint:
    prompt_len: int
    steps_per_request: int  # engine steps one request took
    first_step_tokens: int  # tokens the first (prefill) step processed
    ttft_ms: float  # median over repeats
    tpot_ms: float  # median over repeats
    ttft_ms_runs: list[float] = field(default_factory=list)
    tpot_ms_runs: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)  # tokens each step of the last request processed
    step_ms: list[float] = field(default_factory=list)  # and how long each of those steps took


def sweep_prompt_lengths(
    loaded: LoadedModel, config: EngineConfig, prompt_lens: list[int], output_len: int = 16, repeats: int = 3,
    *, seed: int = 0,
) -> list[PromptPoint]:
    """Time ``repeats`` lone requests of ``output_len`` tokens at every prompt length, after one untimed request."""
    if output_len < 2:
        raise ValueError(f"output_len must be >= 2 so TPOT is defined, got {output_len}")
    if repeats < 1 or not prompt_lens or min(prompt_lens) < 1:
        raise ValueError("need repeats >= 1 and positive prompt lengths")
    import numpy as np

    rng = np.random.default_rng(seed)
    vocab = loaded.config.vocab_size
    points = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in sorted(set(prompt_lens)):
            trace = str(Path(tmp) / f"{n}.jsonl")
            engine = LLMEngine(dataclasses.replace(config, enable_prefix_caching=False, step_trace=trace), loaded)
            ttft, tpot = [], []
            for k in range(repeats + 1):
                params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)
                arrival = time.perf_counter()
                engine.add_request(random_tokens(rng, n, vocab), params, request_id=str(k), arrival_time=arrival)
                times = []
                while engine.has_unfinished_requests():
                    for _ in engine.step():
                        times.append(time.perf_counter())
                if k:  # the first request warms this engine up and is not timed
                    ttft.append((times[0] - arrival) * 1000)
                    tpot.append((times[-1] - times[0]) * 1000 / (len(times) - 1))
            engine.close()
            steps, _ = read_trace(trace)
            last = [s for s in steps if any(rid == str(repeats) for rid, *_ in s["seqs"])]
            step_tokens = [sum(t for _, _, t, *_ in s["seqs"]) for s in last]
            points.append(PromptPoint(
                prompt_len=n, steps_per_request=len(last), first_step_tokens=step_tokens[0],
                ttft_ms=statistics.median(ttft), tpot_ms=statistics.median(tpot), ttft_ms_runs=ttft, tpot_ms_runs=tpot,
                step_tokens=step_tokens, step_ms=[s["duration"] * 1000 for s in last],
            ))
    return points

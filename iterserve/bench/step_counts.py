"""What a run did, counted from its step trace (the JSON lines ``--step-trace`` writes): steps, sequences per
step, KV blocks, preemptions, requests that joined a running batch and speculative drafts. Counts, not times:
the same on any machine for the same workload."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from iterserve.bench.timeline import joined_running_batch, read_trace
from iterserve.engine.spec_decode import stats as spec_stats


@dataclass
class StepCounts:
    """What a run did, counted from its step trace: the same on any machine for the same workload."""

    num_steps: int
    output_tokens_per_step: float
    peak_running: int  # most sequences in one step
    mean_running: float  # sequences per step, averaged over steps
    slot_occupancy: float  # mean_running / max_num_seqs
    peak_kv_blocks: int | None  # None where there is no engine KV pool (hf-static)
    mean_kv_blocks: float | None
    num_preemptions: int
    joined_running_batch: int | None  # requests whose prefill ran in a step that also decoded others
    # speculative decoding, as vLLM counts it (engine/spec_decode/stats.py); zero without it
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        return spec_stats.acceptance_rate(self.num_accepted_tokens, self.num_draft_tokens)

    @property
    def mean_accepted_length(self) -> float | None:
        return spec_stats.mean_accepted_length(self.num_accepted_tokens, self.num_drafts)


def trace_counts(path: str | Path, max_num_seqs: int, output_tokens: int) -> StepCounts:
    """Count steps, sequences per step and KV blocks from a JSON-lines step trace."""
    steps, _ = read_trace(path)
    if not steps:
        raise ValueError(f"{path}: the step trace holds no steps")
    running = [len(s["seqs"]) for s in steps]
    blocks = [s["kv_blocks_used"] for s in steps]
    mean_running = statistics.fmean(running)
    return StepCounts(
        num_steps=len(steps), output_tokens_per_step=output_tokens / len(steps), peak_running=max(running),
        mean_running=mean_running, slot_occupancy=mean_running / max_num_seqs, peak_kv_blocks=max(blocks),
        mean_kv_blocks=statistics.fmean(blocks), num_preemptions=sum(s["num_preemptions"] for s in steps),
        joined_running_batch=joined_running_batch(steps),
        num_drafts=sum(s.get("num_drafts", 0) for s in steps),
        num_draft_tokens=sum(s.get("num_draft_tokens", 0) for s in steps),
        num_accepted_tokens=sum(s.get("num_accepted_tokens", 0) for s in steps),
    )

"""Batch-size sweep: how a forward step's latency and throughput grow with the batch.

Each point times the engine's own step, :meth:`ModelRunner.execute` (attention metadata, the
model forward over the paged KV cache, sampling), on synthetic sequences that hold ``context``
tokens each: a *decode step* (one new token per sequence) and a *prefill* (all ``context``
prompt tokens of every sequence in one pass). The cache holds zeros, which cost the same to read
as real keys and values. Every shape is run once untimed, then the median of ``repeats`` is kept.

The knee is :func:`iterserve.bench.knee.measured_knee` on the decode step times: the first batch
``B_i`` whose step time grew at least ``(B_i / B_{i-1}) ** elasticity``-fold from the previous
batch. Decode throughput is ``B / t``, so at the knee the larger batch bought at most
``(B_i / B_{i-1}) ** (1 - elasticity)`` times the throughput: with the default elasticity 0.5,
a doubling gave less than 41% more tokens/s while every sequence waited at least 41% longer
per token.

A step over more sequences never does less work, so its time cannot fall as the batch grows; a
sweep where it does (by more than :data:`iterserve.bench.knee.NOISE_TOLERANCE`) measured the machine's other load, not
the model, and no knee is called on it: the sweep says so and asks for a rerun.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from iterserve.bench.knee import DEFAULT_ELASTICITY, read_knee
from iterserve.bench.workloads import random_tokens
from iterserve.config.units import parse_size
from iterserve.engine.model_runner import ModelRunner
from iterserve.engine.scheduler import ScheduledSeq
from iterserve.engine.sequence import Sequence
from iterserve.models.loader import LoadedModel
from iterserve.outputs import RequestMetrics
from iterserve.sampling_params import SamplingParams


class StepTimer:
    """Times engine steps of ``batch`` synthetic sequences at ``context`` tokens each."""

    def __init__(self, loaded: LoadedModel, block_size: int = 16, seed: int = 0) -> None:
        self.loaded = loaded
        self.block_size = block_size
        self.rng = np.random.default_rng(seed)
        self.params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        self.runner: ModelRunner | None = None
        self.num_blocks = 0

    def _runner(self, num_blocks: int) -> ModelRunner:
        """A runner whose KV pool holds ``num_blocks``, reused while it is big enough."""
        if self.runner is None or self.num_blocks < num_blocks:
            self.runner = None  # free the old pool before allocating the larger one
            self.runner = ModelRunner(self.loaded.model, num_blocks, self.block_size)
            self.num_blocks = num_blocks
        return self.runner

    def _sequences(self, batch: int, context: int, decode: bool) -> tuple[ModelRunner, list[ScheduledSeq]]:
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch size must be a positive integer, got {batch!r}")
        total = context + 1 if decode else context  # a decode step adds one token to `context` cached ones
        limit = self.loaded.config.max_position_embeddings
        if isinstance(context, bool) or not isinstance(context, int) or context < 1 or total > limit:
            raise ValueError(f"context must be an integer in [1, {limit - decode}] for this model, got {context!r}")
        per_seq = -(-total // self.block_size)
        runner = self._runner(batch * per_seq)
        vocab = self.loaded.config.vocab_size
        scheduled = []
        for i in range(batch):
            ids = random_tokens(self.rng, total, vocab)
            seq = Sequence(
                request_id=str(i), prompt=None, prompt_token_ids=ids[:context], params=self.params, max_tokens=1,
                metrics=RequestMetrics(arrival_time=0.0), block_table=list(range(i * per_seq, (i + 1) * per_seq)),
            )
            if decode:
                seq.output_token_ids, seq.num_computed_tokens = ids[context:], context
            scheduled.append(ScheduledSeq(seq, 1 if decode else context))
        return runner, scheduled

    def _time(self, batch: int, context: int, decode: bool) -> float:
        runner, scheduled = self._sequences(batch, context, decode)
        cuda = runner.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(runner.device)
        start = time.perf_counter()
        runner.execute(scheduled)
        if cuda:
            torch.cuda.synchronize(runner.device)
        return time.perf_counter() - start

    def decode(self, batch: int, context: int) -> float:
        """Seconds of one decode step: ``batch`` sequences with ``context`` cached tokens each."""
        return self._time(batch, context, decode=True)

    def prefill(self, batch: int, context: int) -> float:
        """Seconds of one step that prefills ``batch`` prompts of ``context`` tokens."""
        return self._time(batch, context, decode=False)


def decode_step_timer(loaded: LoadedModel, block_size: int = 16) -> Callable[[int, int], float]:
    """``measure(batch, context) -> seconds`` of one engine decode step, for the capacity planner."""
    return StepTimer(loaded, block_size).decode


def median_time(measure: Callable[[int, int], float], batch: int, context: int, repeats: int) -> float:
    """One untimed warm-up call, then the median of ``repeats`` timed ones."""
    measure(batch, context)
    return statistics.median(measure(batch, context) for _ in range(repeats))


def default_batch_sizes(loaded: LoadedModel, context: int, kv_cache_memory: str | int, max_batch: int,
                        block_size: int = 16) -> list[int]:
    """Powers of two up to ``max_batch`` whose sequences' KV cache fits in ``kv_cache_memory``."""
    tokens = -(-(context + 1) // block_size) * block_size
    per_seq = tokens * loaded.config.kv_bytes_per_token(loaded.model.dtype.itemsize)
    fits = min(max_batch, parse_size(kv_cache_memory) // per_seq)
    if fits < 1:
        raise ValueError(f"one sequence of {context} tokens needs more KV cache than {kv_cache_memory!r}")
    return [1 << k for k in range(fits.bit_length()) if 1 << k <= fits]


@dataclass
class BatchPoint:
    batch_size: int
    decode_s: float  # one decode step; also each sequence's time per output token
    decode_tokens_per_s: float
    ms_per_token: float  # decode step time shared out over the batch's tokens
    prefill_s: float | None = None
    prefill_tokens_per_s: float | None = None


@dataclass
class BatchSweep:
    model: str
    dtype: str
    device: str
    context: int
    repeats: int
    elasticity: float
    knee_batch_size: int | None  # measured_knee over decode step times
    points: list[BatchPoint] = field(default_factory=list)
    knee_refused: str | None = None  # why no knee was called on a non-monotone sweep

    @property
    def max_gain_at_knee(self) -> float:
        """Throughput gain below which a doubling of the batch counts as past the knee (0.414 for 0.5)."""
        return 2 ** (1 - self.elasticity) - 1


def sweep_batches(
    loaded: LoadedModel,
    batch_sizes: list[int],
    context: int = 256,
    *,
    repeats: int = 5,
    block_size: int = 16,
    prefill: bool = True,
    elasticity: float = DEFAULT_ELASTICITY,
    use_tqdm: bool = True,
) -> BatchSweep:
    """Time decode steps (and prefills) at every batch size and find the knee."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not 0 < elasticity < 1:
        raise ValueError(f"elasticity must be in (0, 1), got {elasticity}")
    timer = StepTimer(loaded, block_size)
    points = []
    for b in tqdm(sorted(set(batch_sizes)), desc="batch sweep", unit="batch", disable=not use_tqdm):
        dec = median_time(timer.decode, b, context, repeats)
        pre = median_time(timer.prefill, b, context, repeats) if prefill else None
        points.append(BatchPoint(b, dec, b / dec, dec * 1000 / b, pre, b * context / pre if pre else None))
    knee, refused = read_knee([p.batch_size for p in points], [p.decode_s for p in points], elasticity)
    return BatchSweep(
        model=loaded.name, dtype=str(loaded.model.dtype).removeprefix("torch."), device=str(loaded.model.device),
        context=context, repeats=repeats, elasticity=elasticity, knee_batch_size=knee, points=points,
        knee_refused=refused,
    )

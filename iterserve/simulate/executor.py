"""The cost-model executor: an :class:`~iterserve.engine.executor.Executor` that runs no model.

Plugged under the real :class:`~iterserve.engine.core.EngineCore`, whose clock is the same
:class:`VirtualClock`, it makes the simulator run the code that serves: the core schedules each step,
this executor asks the cost model how long a step of that shape takes, moves the clock on by that
much and hands back one filler token per sequence that samples; the core then stamps the tokens,
finishes each request at its ``max_tokens`` and writes the step trace exactly as on a server.

With speculative decoding the executor is also the core's proposer: after each step the core's
:class:`~iterserve.engine.spec_decode.proposer.Speculator` asks it for drafts (filler tokens, as many
as the sequence may take, as an n-gram lookup that always hits would give), the scheduler fits them
into the next step, and verifying them accepts each position with probability ``acceptance`` until
the first rejection, as the rejection sampler stops at the first token the target disagrees with.
The accepted drafts go back as the real sampler's verdicts, so the scheduler's KV rollback, the
spec-decode counters and the step trace run their serving code.
"""

from __future__ import annotations

import numpy as np
import torch

from iterserve.config import EngineConfig, ModelConfig, parse_dtype
from iterserve.engine.capacity import Capacity, token_bytes
from iterserve.engine.executor import Executor
from iterserve.engine.sampler import SampleResult, Verdict
from iterserve.engine.scheduler import ScheduledSeq, sampling_seqs
from iterserve.engine.sequence import Sequence
from iterserve.engine.spec_decode.stats import SpecDecodeStats
from iterserve.simulate.cost import CostModel, StepShape

FILLER = 0  # every sampled token: requests run with ignore_eos and end at their max_tokens


class VirtualClock:
    """Simulated seconds since the run began: the executor moves it by each step's modelled time, the
    simulator to the next arrival when the engine is idle. Called, it tells the time (the core's clock)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def advance_to(self, when: float) -> None:
        self.now = max(self.now, when)


def step_shape(scheduled: list[ScheduledSeq]) -> StepShape:
    """Summarise a scheduled step before it runs (the sequences' computed tokens have not moved yet)."""
    prefill_tokens = decode = context = pairs = prefill_seqs = sampling = drafts = 0
    for s in scheduled:
        n, c0 = s.num_tokens, s.seq.num_computed_tokens
        if s.is_prefill:
            prefill_tokens += n
            prefill_seqs += 1
        else:
            decode += 1
            drafts += len(s.spec_token_ids)
        context += c0 + n
        pairs += n * c0 + n * (n + 1) // 2
        sampling += s.samples
    return StepShape(prefill_tokens, decode, context, pairs, prefill_seqs, sampling, drafts)


class CostModelExecutor(Executor):
    """Steps that take the cost model's time on ``clock`` and sample :data:`FILLER`; the KV pool is
    ``config``'s ``num_kv_blocks`` and ``max_model_len`` as given (no device memory to size it from),
    and ``model`` supplies the vocabulary requests are checked against. ``acceptance`` is the chance
    that a draft position is accepted, drawn from a generator seeded with ``seed``."""

    def __init__(self, config: EngineConfig, model: ModelConfig, cost: CostModel, clock: VirtualClock, *,
                 acceptance: float = 0.0, seed: int = 0) -> None:
        if config.num_kv_blocks is None or config.max_model_len is None or config.dtype == "auto":
            raise ValueError("a simulated engine needs num_kv_blocks, max_model_len and a dtype")
        if not 0 <= acceptance <= 1:
            raise ValueError(f"the draft acceptance probability must be in [0, 1], got {acceptance}")
        self.model_config, self.tokenizer, self.model_name = model, None, model.name or model.architecture
        self.dtype, self.device = parse_dtype(config.dtype), torch.device("cpu")
        blocks, block_size, max_len = config.num_kv_blocks, config.block_size, config.max_model_len
        tokens = blocks * block_size
        self.capacity = Capacity(token_bytes(model, config.kv_cache_dtype, self.dtype.itemsize), blocks, block_size,
                                 tokens, max_len, tokens // max_len)
        self.cost, self.clock = cost, clock
        self.busy_s = 0.0  # simulated time spent in steps
        self.rows = 0  # sequences scheduled, summed over the steps
        self.acceptance = acceptance
        self.rng = np.random.default_rng(seed)
        self.drawn = SpecDecodeStats()  # every verification's draws: what the core's counters must report

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """The core's proposer: every draft the sequences may take."""
        return [[FILLER] * limit for limit in limits]

    def execute_model(self, scheduled: list[ScheduledSeq], block_copies: list[tuple[int, int]],
                      window_copies: list[tuple[int, int]] | None = None) -> SampleResult:
        seconds = self.cost.step_time(step_shape(scheduled))
        self.clock.advance(seconds)
        self.busy_s += seconds
        self.rows += len(scheduled)
        verdicts, i = {}, 0  # keyed by sampling index, as the sampler's
        for s in scheduled:
            if s.samples:
                if s.spec_token_ids:
                    verdicts[i] = self._verify(s.spec_token_ids)
                i += 1 + len(s.seq.forks)  # a prefill's forks sample beside it (and verify nothing)
        n = len(sampling_seqs(scheduled))
        return SampleResult([FILLER] * n, [None] * n, verdicts=verdicts)

    def _verify(self, drafts: list[int]) -> Verdict:
        """Accept each draft position with probability ``acceptance``, up to the first rejection."""
        accepted = 0
        while accepted < len(drafts) and self.rng.random() < self.acceptance:
            accepted += 1
        self.drawn.observe(len(drafts), accepted)
        return Verdict(drafts[:accepted], [None] * accepted)

    def close(self) -> None:
        """Nothing to release."""

"""The cost-model executor: an :class:`~iterserve.engine.executor.Executor` that runs no model.

Plugged under the real :class:`~iterserve.engine.core.EngineCore`, whose clock is the same
:class:`VirtualClock`, it makes the simulator run the code that serves: the core schedules each step,
this executor asks the cost model how long a step of that shape takes, moves the clock on by that
much and hands back one filler token per sequence that samples; the core then stamps the tokens,
finishes each request at its ``max_tokens`` and writes the step trace exactly as on a server.
"""

from __future__ import annotations

import torch

from iterserve.config import EngineConfig, ModelConfig, parse_dtype
from iterserve.engine.capacity import Capacity
from iterserve.engine.executor import Executor
from iterserve.engine.sampler import SampleResult
from iterserve.engine.scheduler import ScheduledSeq, sampling_seqs
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
    prefill_tokens = decode = context = pairs = prefill_seqs = sampling = 0
    for s in scheduled:
        n, c0 = s.num_tokens, s.seq.num_computed_tokens
        if s.is_prefill:
            prefill_tokens += n
            prefill_seqs += 1
        else:
            decode += 1
        context += c0 + n
        pairs += n * c0 + n * (n + 1) // 2
        sampling += s.samples
    return StepShape(prefill_tokens, decode, context, pairs, prefill_seqs, sampling)


class CostModelExecutor(Executor):
    """Steps that take the cost model's time on ``clock`` and sample :data:`FILLER`; the KV pool is
    ``config``'s ``num_kv_blocks`` and ``max_model_len`` as given (no device memory to size it from),
    and ``model`` supplies the vocabulary requests are checked against."""

    def __init__(self, config: EngineConfig, model: ModelConfig, cost: CostModel, clock: VirtualClock) -> None:
        if config.num_kv_blocks is None or config.max_model_len is None or config.dtype == "auto":
            raise ValueError("a simulated engine needs num_kv_blocks, max_model_len and a dtype")
        self.model_config, self.tokenizer, self.model_name = model, None, model.name or model.architecture
        self.dtype, self.device = parse_dtype(config.dtype), torch.device("cpu")
        blocks, block_size, max_len = config.num_kv_blocks, config.block_size, config.max_model_len
        tokens = blocks * block_size
        self.capacity = Capacity(model.kv_bytes_per_token(self.dtype.itemsize), blocks, block_size, tokens, max_len,
                                 tokens // max_len)
        self.cost, self.clock = cost, clock
        self.busy_s = 0.0  # simulated time spent in steps
        self.rows = 0  # sequences scheduled, summed over the steps

    def execute_model(self, scheduled: list[ScheduledSeq], block_copies: list[tuple[int, int]]) -> SampleResult:
        seconds = self.cost.step_time(step_shape(scheduled))
        self.clock.advance(seconds)
        self.busy_s += seconds
        self.rows += len(scheduled)
        n = len(sampling_seqs(scheduled))
        return SampleResult([FILLER] * n, [None] * n)

    def close(self) -> None:
        """Nothing to release."""

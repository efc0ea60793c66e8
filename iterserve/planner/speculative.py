"""Speculative decoding on the roofline: tokens per verification pass, and the batch where it stops paying.

A verification step runs ``1 + k`` query tokens per sequence (its next token and k drafts) for
the price of reading the weights and each sequence's KV cache once, as a decode step does; its
FLOPs are ``1 + k`` times a decode's. Each pass yields on average ``(1 - a^(k+1)) / (1 - a)``
tokens per sequence when each draft is accepted with probability ``a`` given the ones before it
were. While decode is memory-bound the extra tokens are nearly free and speculation multiplies
tokens/s by up to that mean; once the verification step turns compute-bound its time grows with
the drafted tokens, and past the crossover batch plain decoding is faster.
"""

from __future__ import annotations

from dataclasses import dataclass

from iterserve.config import ModelConfig
from iterserve.planner.hardware import Accelerator
from iterserve.planner.roofline import (
    Cost,
    attention_flops_per_token,
    check_context,
    check_positive,
    decode_cost,
    kv_read_bytes,
    matmul_parameters,
    roofline,
    streamed_weight_bytes,
)
from iterserve.planner.weights import Quantization


def mean_accepted_length(num_speculative_tokens: int, acceptance: float) -> float:
    """Tokens one sequence gets from one verification pass: accepted drafts plus the sampled token."""
    if not 0 <= acceptance <= 1:
        raise ValueError(f"the draft acceptance probability must be in [0, 1], got {acceptance}")
    k = num_speculative_tokens
    return k + 1.0 if acceptance == 1 else (1 - acceptance ** (k + 1)) / (1 - acceptance)


def verify_cost(cfg: ModelConfig, batch: int, context: int, num_speculative_tokens: int, dtype: str = "bf16",
                kv_dtype: str | None = None, quantization: Quantization | str | None = None) -> Cost:
    """One verification step: ``batch`` sequences of ``1 + k`` query tokens each over ``context`` cached tokens."""
    check_positive(batch, "batch size")
    check_context(cfg, context)
    queries = batch * (1 + num_speculative_tokens)
    flops = queries * (2 * matmul_parameters(cfg) + attention_flops_per_token(cfg, context))
    return Cost(flops=flops, bytes=streamed_weight_bytes(cfg, dtype, quantization, queries)
                + batch * kv_read_bytes(cfg, context, kv_dtype or dtype))


@dataclass(frozen=True)
class SpecPoint:
    batch: int
    plain_tokens_per_s: float
    spec_tokens_per_s: float
    verify_bound: str  # "memory" or "compute"

    @property
    def speedup(self) -> float:
        return self.spec_tokens_per_s / self.plain_tokens_per_s


def speculative_sweep(cfg: ModelConfig, hw: Accelerator, batches: list[int], context: int,
                      num_speculative_tokens: int, acceptance: float, dtype: str = "bf16",
                      kv_dtype: str | None = None, quantization: Quantization | str | None = None) -> list[SpecPoint]:
    """Decode tokens/s without and with speculation at each batch size (drafting itself costs nothing
    here: n-gram lookup; a draft model adds its own, smaller, decode steps)."""
    length = mean_accepted_length(num_speculative_tokens, acceptance)
    points = []
    for b in batches:
        plain = roofline(decode_cost(cfg, b, context, dtype, kv_dtype, quantization), hw, dtype)
        verify = roofline(verify_cost(cfg, b, context, num_speculative_tokens, dtype, kv_dtype, quantization), hw,
                          dtype)
        points.append(SpecPoint(b, b / plain.time_s, b * length / verify.time_s, verify.bound))
    return points


def crossover_batch(points: list[SpecPoint]) -> int | None:
    """The smallest batch of the sweep at which speculation is slower than plain decoding."""
    return next((p.batch for p in points if p.speedup < 1), None)

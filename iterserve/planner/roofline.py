"""Roofline arithmetic for serving a decoder on an accelerator: pure arithmetic, no torch.

For a model's shapes (a :class:`~iterserve.config.ModelConfig`) and an accelerator (an
:class:`~iterserve.planner.hardware.Accelerator`, from the datasheet table or measured), it answers:

* how many bytes the weights take and how many KV-cache tokens / sequences fit beside them;
* the arithmetic intensity (FLOPs per byte moved) of a decode step at batch ``B`` and context
  ``C``, and of a prefill of ``N`` tokens, and whether each is compute- or memory-bound;
* the *knee*: the smallest decode batch at which intensity reaches the hardware's ops:byte;
* roofline times, ``time = max(FLOPs / peak FLOP/s, bytes / bandwidth)``, for prefill (TTFT) and
  decode steps (TPOT, tokens/s) over a sweep of batch sizes.

Counting conventions (``docs/planning.md`` has the derivation and a worked example):

* Matmul weights are the linear layers plus the LM head (``V x h``); norm weights and biases are
  elementwise and left out of FLOPs and streamed bytes but counted in the memory footprint.
  The token embedding is a gather (a few rows per step); it is not streamed unless it doubles
  as the LM head (tied embeddings).
* A decode step of ``B`` sequences at context ``C`` does ``B * (2 * P_mm + 4 * L * H * d * C)``
  FLOPs and reads ``P_mm * w + B * C * kv`` bytes (``w`` bytes per weight, ``kv`` KV bytes per
  token, so grouped-query attention reads fewer bytes). Quantized weights
  (:mod:`~iterserve.planner.weights`) replace ``P_mm * w`` by the bytes of their formats, scales included.
* A prefill of ``N`` tokens runs the layers on all ``N`` tokens but the LM head on the last one,
  and causal attention costs ``2 * L * H * d * N * (N + 1)`` FLOPs; it reads the weights once and
  writes ``N * kv`` bytes of KV.
* A mixture-of-experts layer runs a token through its router and ``k`` of its ``E`` experts: ``P_mm`` counts
  those (the active parameters), while a step of ``B`` tokens reads the router and the expected share
  ``1 - (1 - k/E)^B`` of the experts (:func:`~iterserve.planner.weights.expert_share`, routing taken as
  uniform), so ``P_mm * w`` above becomes the attention, router and LM head bytes plus that share of the
  experts' bytes. The memory footprint holds every expert.
* Under tensor parallelism over ``T`` devices every figure is one device's: the model's shapes become
  one rank's shard (:meth:`ModelConfig.tensor_parallel_shard`: a ``T``-th of the heads, MLP and
  vocabulary, KV heads replicated when fewer than ``T``), and each step adds its communication, not
  overlapped with compute: ``2 L + 1`` ring all-reduces of the step's activations (o and down in every
  layer, the embedding) and the gather of the logits on one device, over a named
  :class:`~iterserve.planner.hardware.Interconnect`.

Models are taken as shapes only (``ModelConfig`` is imported for type checking alone), so this
module runs wherever the standard library does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from iterserve.config.dtypes import canonical_dtype, dtype_bytes
from iterserve.config.kv_cache import INT8_SCALE_BYTES
from iterserve.config.moe import mlp_parameters
from iterserve.planner.hardware import Accelerator, GiB, Interconnect, get_interconnect
from iterserve.planner.weights import Quantization, as_quantization, streamed_bytes, total_bytes

if TYPE_CHECKING:
    from iterserve.config import ModelConfig

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_BLOCK_SIZE = 16
DEFAULT_CONTEXT = 4096
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def model_label(cfg: ModelConfig) -> str:
    return cfg.name or cfg.architecture


def layer_matmul_parameters(cfg: ModelConfig) -> int:
    """Weights of the linear layers in all decoder layers a token runs through (q, k, v, o, gate, up, down;
    of a MoE layer the router and ``num_experts_per_tok`` experts)."""
    h = cfg.hidden_size
    attention = h * cfg.q_size + 2 * h * cfg.kv_size + cfg.q_size * h
    return cfg.num_layers * attention + mlp_parameters(cfg, active=True)


def matmul_parameters(cfg: ModelConfig) -> int:
    """Weights that take part in a matmul for every token: the layers plus the LM head."""
    return layer_matmul_parameters(cfg) + cfg.vocab_size * cfg.hidden_size


def weight_bytes(cfg: ModelConfig, dtype: str = "bf16", quantization: Quantization | str | None = None) -> int:
    """Memory the weights occupy (every parameter, tied embeddings once), in ``quantization``'s formats."""
    return total_bytes(cfg, dtype, as_quantization(quantization))


def streamed_weight_bytes(cfg: ModelConfig, dtype: str = "bf16", quantization: Quantization | str | None = None,
                          tokens: int | None = None) -> int:
    """Weight bytes a forward step of ``tokens`` tokens reads from memory: the matmul weights, in
    ``quantization``'s formats (of a MoE model's experts, the share those tokens run; None: all)."""
    return streamed_bytes(cfg, dtype, as_quantization(quantization), tokens)


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str = "bf16") -> int:
    """layers x 2 (K and V) x KV heads x head_dim x bytes; an int8 cache adds its float16 scale per token and
    KV head (:mod:`iterserve.config.kv_cache`). fp8_e4m3 / fp8_e5m2 are fp8's byte."""
    scales = cfg.num_layers * 2 * cfg.num_kv_heads * INT8_SCALE_BYTES if canonical_dtype(kv_dtype) == "int8" else 0
    return cfg.kv_bytes_per_token(dtype_bytes(kv_dtype)) + scales


def attended_keys(cfg: ModelConfig, context: int) -> int:
    """Keys one query at ``context`` attends to, summed over the layers: a sliding-window layer sees its window."""
    return sum(context if w is None else min(context, w) for w in cfg.layer_windows())


def attention_flops_per_token(cfg: ModelConfig, context: int) -> int:
    """Q.K^T and P.V for one query attending ``context`` keys in every layer (a windowed layer's window): 4 L H d C."""
    return 4 * cfg.num_heads * cfg.head_dim * attended_keys(cfg, context)


def kv_read_bytes(cfg: ModelConfig, context: int, kv_dtype: str = "bf16") -> int:
    """The K/V one decoding sequence at ``context`` reads: every layer's cached tokens, a windowed layer's window."""
    return kv_bytes_per_token(cfg, kv_dtype) * attended_keys(cfg, context) // cfg.num_layers


@dataclass(frozen=True)
class Cost:
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes


def check_positive(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


def check_context(cfg: ModelConfig, context: int, what: str = "context length") -> int:
    check_positive(context, what)
    if context > cfg.max_position_embeddings:
        raise ValueError(
            f"{what} {context} exceeds the model's max_position_embeddings "
            f"({cfg.max_position_embeddings}) for {model_label(cfg)}"
        )
    return context


def decode_cost(
    cfg: ModelConfig, batch: int, context: int, dtype: str = "bf16", kv_dtype: str | None = None,
    quantization: Quantization | str | None = None,
) -> Cost:
    """One decode step: ``batch`` sequences each attending ``context`` cached tokens (weights in
    ``quantization``'s formats: they change the bytes read, not the FLOPs)."""
    check_positive(batch, "batch size")
    check_context(cfg, context)
    flops = batch * (2 * matmul_parameters(cfg) + attention_flops_per_token(cfg, context))
    return Cost(flops=flops, bytes=streamed_weight_bytes(cfg, dtype, quantization, batch)
                + batch * kv_read_bytes(cfg, context, kv_dtype or dtype))


def prefill_cost(
    cfg: ModelConfig,
    prompt_len: int,
    batch: int = 1,
    dtype: str = "bf16",
    kv_dtype: str | None = None,
    quantization: Quantization | str | None = None,
) -> Cost:
    """Prefill of ``batch`` prompts of ``prompt_len`` tokens in one step (causal attention)."""
    check_positive(batch, "batch size")
    check_context(cfg, prompt_len, "prompt length")
    n = prompt_len
    pairs = sum(n * (n + 1) // 2 if w is None or n <= w else w * (w + 1) // 2 + (n - w) * w
                for w in cfg.layer_windows())  # (query, key) pairs of causal attention within each layer's window
    attn = 4 * cfg.num_heads * cfg.head_dim * pairs
    per_seq = 2 * layer_matmul_parameters(cfg) * n + 2 * cfg.vocab_size * cfg.hidden_size + attn
    kv = kv_bytes_per_token(cfg, kv_dtype or dtype)
    return Cost(flops=batch * per_seq,
                bytes=streamed_weight_bytes(cfg, dtype, quantization, batch * n) + batch * n * kv)


@dataclass(frozen=True)
class RooflinePoint:
    flops: float
    bytes: float
    intensity: float
    compute_s: float
    memory_s: float
    time_s: float
    bound: str  # "compute" or "memory"
    comm_s: float = 0.0  # tensor-parallel collectives, included in time_s

    @property
    def comm_share(self) -> float:
        return self.comm_s / self.time_s


def roofline(cost: Cost, hw: Accelerator, dtype: str = "bf16", comm_s: float = 0.0) -> RooflinePoint:
    """time = max(FLOPs / peak, bytes / bandwidth) + communication; compute-bound when the first term wins."""
    compute_s = cost.flops / hw.peak_flops(dtype)
    memory_s = cost.bytes / hw.bandwidth
    return RooflinePoint(
        flops=cost.flops,
        bytes=cost.bytes,
        intensity=cost.intensity,
        compute_s=compute_s,
        memory_s=memory_s,
        time_s=max(compute_s, memory_s) + comm_s,
        bound="compute" if compute_s >= memory_s else "memory",
        comm_s=comm_s,
    )


def tensor_parallel_comm_s(cfg: ModelConfig, tokens: int, logits_rows: int, tp: int, link: Interconnect | None,
                           dtype: str = "bf16") -> float:
    """One step's collectives over ``tp`` devices: ``2 L + 1`` all-reduces of ``tokens`` activations and
    the gather of ``logits_rows`` rows of logits (``cfg`` is the whole model)."""
    if tp == 1 or link is None:
        return 0.0
    w = dtype_bytes(dtype)
    activations = tokens * cfg.hidden_size * w
    logits = logits_rows * cfg.tensor_parallel_shard(tp).vocab_size * tp * w
    return (2 * cfg.num_layers + 1) * link.all_reduce_s(activations, tp) + link.gather_s(logits, tp)


def decode_knee(
    cfg: ModelConfig, hw: Accelerator, context: int, dtype: str = "bf16", kv_dtype: str | None = None,
    quantization: Quantization | str | None = None,
) -> int | None:
    """Smallest batch whose decode step is compute-bound at ``context``; None if none is.

    Intensity ``B f / (W + B k)`` rises with ``B`` towards ``f / k`` (``f`` FLOPs and ``k`` KV
    bytes per sequence, ``W`` weight bytes), so the knee is ``ceil(R W / (f - R k))`` for
    ops:byte ``R`` when ``f > R k``; otherwise KV reads keep decode memory-bound at any batch.
    A MoE model's ``W`` grows with ``B`` (more experts touched) up to every expert's bytes: the closed form
    with all of them bounds the knee from above, and a bisection settles it.
    """
    ratio = hw.ops_per_byte(dtype)
    k = kv_read_bytes(cfg, context, kv_dtype or dtype)
    f = 2 * matmul_parameters(cfg) + attention_flops_per_token(cfg, context)
    denom = f - ratio * k
    if denom <= 0:
        return None
    b = max(1, math.ceil(ratio * streamed_weight_bytes(cfg, dtype, quantization) / denom))

    def compute_bound(batch: int) -> bool:
        return roofline(decode_cost(cfg, batch, context, dtype, kv_dtype, quantization), hw, dtype).bound == "compute"

    # the closed form can be off by one in floating point (and is an upper bound for MoE): bisect on the
    # same predicate, which is monotone in the batch (intensity rises with it)
    while not compute_bound(b):
        b += 1
    low = 0  # not compute-bound (batch 0 does nothing)
    while b - low > 1:
        mid = (low + b) // 2
        low, b = (low, mid) if compute_bound(mid) else (mid, b)
    return b


@dataclass(frozen=True)
class MemoryPlan:
    """How an accelerator's memory splits between the weights and the KV cache, and what that cache holds."""

    memory_bytes: int
    usable_bytes: int  # memory x gpu_memory_utilization
    weight_bytes: int
    kv_budget_bytes: int
    kv_bytes_per_token: int
    block_size: int
    kv_blocks: int
    kv_tokens: int
    context: int
    max_seqs: int  # sequences of `context` tokens that fit at once


def kv_capacity(
    cfg: ModelConfig,
    hw: Accelerator,
    context: int,
    dtype: str = "bf16",
    kv_dtype: str | None = None,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    block_size: int = DEFAULT_BLOCK_SIZE,
    quantization: Quantization | str | None = None,
) -> MemoryPlan:
    """KV memory left after the weights, in tokens and in sequences of ``context`` tokens.

    Memory is handed out in blocks of ``block_size`` tokens, so a sequence holds
    ``ceil(context / block_size)`` blocks, but only its window's in a sliding-window layer (vLLM's sliding-window
    and hybrid allocators, iterserve's hybrid SWA memory): ``kv_tokens`` counts
    tokens held in every layer, ``max_seqs`` the sequences those window savings let in. Activation workspace
    is not subtracted.
    """
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu memory utilization must be in (0, 1], got {gpu_memory_utilization!r}")
    check_positive(block_size, "block size")
    check_context(cfg, context)
    usable = int(hw.memory_bytes * gpu_memory_utilization)
    q = as_quantization(quantization)
    weights = weight_bytes(cfg, dtype, q)
    if weights >= usable:
        stored = canonical_dtype(dtype) + (f" with {q.name} weights" if q.name != "none" else "")
        raise ValueError(
            f"{model_label(cfg)} weights need {weights / GiB:.1f} GiB in {stored} "
            f"but {hw.name} offers {hw.memory_bytes / GiB:.1f} GiB x {gpu_memory_utilization:g} = "
            f"{usable / GiB:.1f} GiB; the weights do not fit"
        )
    kv = kv_bytes_per_token(cfg, kv_dtype or dtype)
    budget = usable - weights
    blocks = budget // (kv * block_size)
    per_seq_blocks = -(-context // block_size)
    layer_blocks = sum(per_seq_blocks if w is None else min(per_seq_blocks, -(-w // block_size) + 1)
                       for w in cfg.layer_windows())
    return MemoryPlan(
        memory_bytes=hw.memory_bytes,
        usable_bytes=usable,
        weight_bytes=weights,
        kv_budget_bytes=budget,
        kv_bytes_per_token=kv,
        block_size=block_size,
        kv_blocks=blocks,
        kv_tokens=blocks * block_size,
        context=context,
        max_seqs=blocks * cfg.num_layers // layer_blocks,
    )


# -- the plan -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepPoint:
    batch: int
    decode: RooflinePoint
    tokens_per_s: float
    ttft_s: float  # prefill of `batch` prompts together
    fits: bool  # batch <= max concurrent sequences at the plan's context


@dataclass
class Plan:
    model: str
    hardware: Accelerator
    dtype: str
    kv_dtype: str
    context: int
    prompt_len: int
    batch: int
    gpu_memory_utilization: float
    num_parameters: int
    matmul_parameters: int
    weight_bytes: int
    streamed_weight_bytes: int  # read by a decode step at `batch` (of a MoE model's experts, the share it runs)
    kv_bytes_per_token: int
    peak_flops: float
    bandwidth: float
    ops_per_byte: float
    capacity: MemoryPlan
    knee_batch: int | None  # at `context`
    knee_batch_no_kv: int | None  # the weights-only limit (context -> 0)
    decode_intensity_limit: float  # intensity as batch -> infinity: per-sequence FLOPs / KV bytes
    prefill: RooflinePoint  # one prompt of prompt_len tokens
    decode: RooflinePoint  # at `batch`
    ttft_s: float
    tpot_s: float
    tokens_per_s: float
    sweep: list[SweepPoint] = field(default_factory=list)
    knee_point: SweepPoint | None = None  # the sweep quantities at knee_batch
    tensor_parallel_size: int = 1  # memory, work and times above are one device's of this many
    interconnect: Interconnect | None = None  # the devices' link (tensor_parallel_size > 1)
    total_weight_bytes: int = 0  # the whole model's, on all devices together
    quantization: str = "none"  # the weights' formats (a Quantization's label)

    @property
    def knee_reachable(self) -> bool:
        return self.knee_batch is not None and self.knee_batch <= self.capacity.max_seqs

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["hardware"] = self.hardware.to_dict()
        d["knee_reachable"] = self.knee_reachable
        d["batch_fits"] = self.batch <= self.capacity.max_seqs
        return d


def default_batches(
    cfg: ModelConfig, hw: Accelerator, context: int, dtype: str = "bf16", kv_dtype: str | None = None,
    quantization: Quantization | str | None = None,
) -> list[int]:
    """The decode sweep a plan draws by default: powers of two up to 256, or to twice the knee."""
    knee = decode_knee(cfg, hw, context, dtype, kv_dtype, quantization)
    top = min(max(DEFAULT_BATCHES[-1], 2 * knee if knee else 0), 8192)
    return [2**i for i in range(int(math.log2(top)) + 1)]


def build_plan(
    cfg: ModelConfig,
    hw: Accelerator,
    *,
    dtype: str = "bf16",
    kv_dtype: str | None = None,
    context: int | None = None,
    prompt_len: int | None = None,
    batch: int = 1,
    batches: Sequence[int] | None = None,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    block_size: int = DEFAULT_BLOCK_SIZE,
    tensor_parallel_size: int = 1,
    interconnect: Interconnect | None = None,
    quantization: Quantization | str | None = None,
) -> Plan:
    """Every planner answer for one model on one accelerator (per device of ``tensor_parallel_size``,
    linked by ``interconnect``, default the accelerator's own).

    ``context`` (default ``min(4096, max_position_embeddings)``) is the per-sequence context
    used for KV capacity and decode steps; ``prompt_len`` (default ``context``) is the prompt
    prefilled for TTFT; ``batch`` is the batch for the headline TTFT/TPOT; ``batches`` the
    decode sweep (default :func:`default_batches`); ``quantization`` the weights' formats (default: all
    in ``dtype``), which change weight memory, KV room and the bytes a step reads.
    """
    dtype = canonical_dtype(dtype)
    kv_dtype = canonical_dtype(kv_dtype or dtype)
    if context is None:
        context = min(DEFAULT_CONTEXT, cfg.max_position_embeddings)
    check_context(cfg, context)
    prompt_len = context if prompt_len is None else prompt_len
    check_context(cfg, prompt_len, "prompt length")
    check_positive(batch, "batch size")
    tp = tensor_parallel_size
    whole, cfg = cfg, cfg.tensor_parallel_shard(tp)  # from here on: one device's shard
    if tp > 1 and interconnect is None:
        if not hw.interconnect:
            raise ValueError(f"{hw.name} names no interconnect; say which links the {tp} devices")
        interconnect = get_interconnect(hw.interconnect)
    link = interconnect if tp > 1 else None
    q = as_quantization(quantization)
    peak = hw.peak_flops(dtype)
    capacity = kv_capacity(cfg, hw, context, dtype, kv_dtype, gpu_memory_utilization, block_size, q)
    knee = decode_knee(cfg, hw, context, dtype, kv_dtype, q)

    # weights-only knee: R W / f with f = 2 P_mm, the classic "batch ~ ops:byte x bytes/2" rule
    ratio = hw.ops_per_byte(dtype)
    knee_no_kv = max(1, math.ceil(ratio * streamed_weight_bytes(cfg, dtype, q) / (2 * matmul_parameters(cfg))))
    per_seq_flops = 2 * matmul_parameters(cfg) + attention_flops_per_token(cfg, context)
    limit = per_seq_flops / kv_read_bytes(cfg, context, kv_dtype or dtype)

    if batches is None:
        batches = default_batches(cfg, hw, context, dtype, kv_dtype, q)
    batches = sorted({check_positive(b, "batch size") for b in batches} | {batch})

    def point(b: int) -> SweepPoint:
        dec = roofline(decode_cost(cfg, b, context, dtype, kv_dtype, q), hw, dtype,
                       tensor_parallel_comm_s(whole, b, b, tp, link, dtype))
        pre = roofline(prefill_cost(cfg, prompt_len, b, dtype, kv_dtype, q), hw, dtype,
                       tensor_parallel_comm_s(whole, b * prompt_len, b, tp, link, dtype))
        return SweepPoint(b, dec, b / dec.time_s, pre.time_s, b <= capacity.max_seqs)

    sweep = [point(b) for b in batches]
    knee_point = point(knee) if knee is not None else None
    at_batch = next(p for p in sweep if p.batch == batch)
    return Plan(
        model=model_label(whole), hardware=hw, dtype=dtype, kv_dtype=kv_dtype, context=context,
        prompt_len=prompt_len, batch=batch, gpu_memory_utilization=gpu_memory_utilization,
        num_parameters=whole.num_parameters(), matmul_parameters=matmul_parameters(cfg),
        weight_bytes=weight_bytes(cfg, dtype, q), streamed_weight_bytes=streamed_weight_bytes(cfg, dtype, q, batch),
        kv_bytes_per_token=kv_bytes_per_token(cfg, kv_dtype), peak_flops=peak, bandwidth=hw.bandwidth,
        ops_per_byte=ratio, capacity=capacity, knee_batch=knee, knee_batch_no_kv=knee_no_kv,
        decode_intensity_limit=limit,
        prefill=roofline(prefill_cost(cfg, prompt_len, 1, dtype, kv_dtype, q), hw, dtype,
                         tensor_parallel_comm_s(whole, prompt_len, 1, tp, link, dtype)),
        decode=at_batch.decode, ttft_s=at_batch.ttft_s, tpot_s=at_batch.decode.time_s,
        tokens_per_s=at_batch.tokens_per_s, sweep=sweep, knee_point=knee_point, tensor_parallel_size=tp,
        interconnect=link, total_weight_bytes=weight_bytes(whole, dtype, q), quantization=q.label,
    )

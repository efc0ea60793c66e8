"""Capacity planner: roofline arithmetic for serving a decoder on an accelerator.

Everything here is closed-form. For a model (a :class:`~iterserve.config.ModelConfig`) and an
accelerator (an :class:`~iterserve.hardware.Accelerator`, from the datasheet table or measured),
the planner answers:

* how many bytes the weights take and how many KV-cache tokens / sequences fit beside them;
* the arithmetic intensity (FLOPs per byte moved) of a decode step at batch ``B`` and context
  ``C``, and of a prefill of ``N`` tokens, and whether each is compute- or memory-bound;
* the *knee*: the smallest decode batch at which intensity reaches the hardware's ops:byte;
* roofline times, ``time = max(FLOPs / peak FLOP/s, bytes / bandwidth)``, for prefill (TTFT) and
  decode steps (TPOT, tokens/s) over a sweep of batch sizes;
* with :func:`validate`, how those predictions compare with a decode step timed on this machine.

Counting conventions (``docs/planning.md`` has the derivation and a worked example):

* Matmul weights are the linear layers plus the LM head (``V x h``); norm weights and biases are
  elementwise and left out of FLOPs and streamed bytes but counted in the memory footprint.
  The token embedding is a gather (a few rows per step); it is not streamed unless it doubles
  as the LM head (tied embeddings).
* A decode step of ``B`` sequences at context ``C`` does ``B * (2 * P_mm + 4 * L * H * d * C)``
  FLOPs and reads ``P_mm * w + B * C * kv`` bytes (``w`` bytes per weight, ``kv`` KV bytes per
  token, so grouped-query attention reads fewer bytes).
* A prefill of ``N`` tokens runs the layers on all ``N`` tokens but the LM head on the last one,
  and causal attention costs ``2 * L * H * d * N * (N + 1)`` FLOPs; it reads the weights once and
  writes ``N * kv`` bytes of KV.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from iterserve.config import PRESETS, ModelConfig, get_preset
from iterserve.hardware import (
    ACCELERATORS,
    PLANNER_DTYPES,
    Accelerator,
    GiB,
    canonical_dtype,
    custom_accelerator,
    get_accelerator,
    measure_local,
)

__all__ = [
    "ACCELERATORS", "Accelerator", "Capacity", "Cost", "Plan", "RooflinePoint", "SweepPoint",
    "Validation", "ValidationRow", "attention_flops_per_token", "check_context", "check_positive",
    "config_from_gguf", "custom_accelerator", "decode_cost", "decode_knee", "default_decode_timer",
    "dtype_bytes", "find_preset", "get_accelerator", "kv_bytes_per_token", "kv_capacity",
    "layer_matmul_parameters", "load_model_config", "matmul_parameters", "measure_local",
    "measured_knee", "plan", "prefill_cost", "roofline", "streamed_weight_bytes",
    "synthetic_decode_timer", "validate", "weight_bytes",
]  # fmt: skip

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_BLOCK_SIZE = 16
DEFAULT_CONTEXT = 4096
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_VALIDATION_BATCHES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_VALIDATION_CONTEXT = 256

DecodeTimer = Callable[[int, int], float]


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a planner dtype (fp32/tf32 4, fp16/bf16 2, fp8/int8 1)."""
    return PLANNER_DTYPES[canonical_dtype(dtype)]


# -- model resolution -----------------------------------------------------------------------------

_NAME_SUFFIXES = ("-hf", "-instruct", "-chat", "-base", "-it", "-v0.1")


def _norm_model_name(name: str) -> str:
    key = name.strip().lower().rsplit("/", 1)[-1].replace("_", "-").replace(" ", "-")
    changed = True
    while changed:
        changed = False
        for suffix in _NAME_SUFFIXES:
            if key.endswith(suffix):
                key, changed = key[: -len(suffix)], True
    key = key.removeprefix("meta-")
    return re.sub(r"[^a-z0-9.]", "", key)


def find_preset(name: str) -> str | None:
    """The preset key for a preset name or a common spelling of it, or None.

    ``"Llama-2-7B"``, ``"meta-llama/Llama-2-7b-hf"``, ``"llama2-7b"`` and
    ``"Meta-Llama-3-8B-Instruct"`` all resolve; matching ignores case, an ``org/`` prefix, a
    ``meta-`` prefix, ``-hf``/``-instruct``/``-chat`` suffixes and punctuation.
    """
    if name.lower() in PRESETS:
        return name.lower()
    target = _norm_model_name(name)
    for key, cfg in PRESETS.items():
        if target in (_norm_model_name(key), _norm_model_name(cfg.name)):
            return key
    return None


def config_from_gguf(path: str | os.PathLike) -> ModelConfig:
    """Model shapes from a GGUF file's metadata (no tensor data is read)."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError, struct or numpy errors on damaged files
        raise ValueError(f"cannot read GGUF file {str(path)!r}: {e}") from None
    from iterserve.models.loader import gguf_config

    return gguf_config(reader, name=Path(path).stem)


def _config_from_json(path: Path) -> ModelConfig:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read model config {str(path)!r}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"model config {str(path)!r} is not a JSON object")
    try:
        return ModelConfig.from_hf_config(data, name=data.get("_name_or_path") or path.parent.name)
    except KeyError as e:
        raise ValueError(f"model config {str(path)!r} lacks the field {e.args[0]!r}") from None


def load_model_config(model: str | os.PathLike | ModelConfig) -> ModelConfig:
    """A ModelConfig from a preset name (or common spelling), a config.json, a folder, a GGUF."""
    if isinstance(model, ModelConfig):
        return model
    spec = str(model)
    path = Path(spec).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return _config_from_json(path / "config.json")
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return config_from_gguf(ggufs[0])
        raise ValueError(f"folder {spec!r} holds no config.json (nor a single .gguf file)")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return config_from_gguf(path)
        return _config_from_json(path)
    key = find_preset(spec)
    if key is None:
        raise ValueError(
            f"unknown model {spec!r}: not a preset ({', '.join(PRESETS)}) "
            "nor an existing config.json, model folder or .gguf file"
        )
    cfg = get_preset(key)
    return cfg.replace(name=cfg.name or key)


def _model_label(cfg: ModelConfig) -> str:
    return cfg.name or cfg.architecture


# -- model arithmetic ----------------------------------------------------------------------------


def layer_matmul_parameters(cfg: ModelConfig) -> int:
    """Weights of the linear layers in all decoder layers (q, k, v, o, gate, up, down)."""
    h = cfg.hidden_size
    per_layer = h * cfg.q_size + 2 * h * cfg.kv_size + cfg.q_size * h + 3 * h * cfg.intermediate_size
    return cfg.num_layers * per_layer


def matmul_parameters(cfg: ModelConfig) -> int:
    """Weights that take part in a matmul for every token: the layers plus the LM head."""
    return layer_matmul_parameters(cfg) + cfg.vocab_size * cfg.hidden_size


def weight_bytes(cfg: ModelConfig, dtype: str = "bf16") -> int:
    """Memory the weights occupy (every parameter, tied embeddings once)."""
    return cfg.num_parameters() * dtype_bytes(dtype)


def streamed_weight_bytes(cfg: ModelConfig, dtype: str = "bf16") -> int:
    """Weight bytes a forward step reads from memory: the matmul weights."""
    return matmul_parameters(cfg) * dtype_bytes(dtype)


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str = "bf16") -> int:
    """layers x 2 (K and V) x KV heads x head_dim x bytes."""
    return cfg.kv_bytes_per_token(dtype_bytes(kv_dtype))


def attention_flops_per_token(cfg: ModelConfig, context: int) -> int:
    """Q.K^T and P.V for one query attending ``context`` keys in every layer: 4 L H d C."""
    return 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context


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
            f"({cfg.max_position_embeddings}) for {_model_label(cfg)}"
        )
    return context


def decode_cost(
    cfg: ModelConfig, batch: int, context: int, dtype: str = "bf16", kv_dtype: str | None = None
) -> Cost:
    """One decode step: ``batch`` sequences each attending ``context`` cached tokens."""
    check_positive(batch, "batch size")
    check_context(cfg, context)
    kv = kv_bytes_per_token(cfg, kv_dtype or dtype)
    flops = batch * (2 * matmul_parameters(cfg) + attention_flops_per_token(cfg, context))
    return Cost(flops=flops, bytes=streamed_weight_bytes(cfg, dtype) + batch * context * kv)


def prefill_cost(
    cfg: ModelConfig,
    prompt_len: int,
    batch: int = 1,
    dtype: str = "bf16",
    kv_dtype: str | None = None,
) -> Cost:
    """Prefill of ``batch`` prompts of ``prompt_len`` tokens in one step (causal attention)."""
    check_positive(batch, "batch size")
    check_context(cfg, prompt_len, "prompt length")
    n = prompt_len
    attn = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * n * (n + 1)
    per_seq = 2 * layer_matmul_parameters(cfg) * n + 2 * cfg.vocab_size * cfg.hidden_size + attn
    kv = kv_bytes_per_token(cfg, kv_dtype or dtype)
    return Cost(flops=batch * per_seq, bytes=streamed_weight_bytes(cfg, dtype) + batch * n * kv)


@dataclass(frozen=True)
class RooflinePoint:
    flops: float
    bytes: float
    intensity: float
    compute_s: float
    memory_s: float
    time_s: float
    bound: str  # "compute" or "memory"


def roofline(cost: Cost, hw: Accelerator, dtype: str = "bf16") -> RooflinePoint:
    """time = max(FLOPs / peak, bytes / bandwidth); compute-bound when the first term wins."""
    compute_s = cost.flops / hw.peak_flops(dtype)
    memory_s = cost.bytes / hw.bandwidth
    return RooflinePoint(
        flops=cost.flops,
        bytes=cost.bytes,
        intensity=cost.intensity,
        compute_s=compute_s,
        memory_s=memory_s,
        time_s=max(compute_s, memory_s),
        bound="compute" if compute_s >= memory_s else "memory",
    )


def decode_knee(
    cfg: ModelConfig, hw: Accelerator, context: int, dtype: str = "bf16", kv_dtype: str | None = None
) -> int | None:
    """Smallest batch whose decode step is compute-bound at ``context``; None if none is.

    Intensity ``B f / (W + B k)`` rises with ``B`` towards ``f / k`` (``f`` FLOPs and ``k`` KV
    bytes per sequence, ``W`` weight bytes), so the knee is ``ceil(R W / (f - R k))`` for
    ops:byte ``R`` when ``f > R k``; otherwise KV reads keep decode memory-bound at any batch.
    """
    ratio = hw.ops_per_byte(dtype)
    k = context * kv_bytes_per_token(cfg, kv_dtype or dtype)
    f = 2 * matmul_parameters(cfg) + attention_flops_per_token(cfg, context)
    denom = f - ratio * k
    if denom <= 0:
        return None
    b = max(1, math.ceil(ratio * streamed_weight_bytes(cfg, dtype) / denom))

    def compute_bound(batch: int) -> bool:
        return roofline(decode_cost(cfg, batch, context, dtype, kv_dtype), hw, dtype).bound == "compute"

    # the closed form can be off by one in floating point; settle it with the same predicate
    while b > 1 and compute_bound(b - 1):
        b -= 1
    while not compute_bound(b):
        b += 1
    return b


@dataclass(frozen=True)
class Capacity:
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
) -> Capacity:
    """KV memory left after the weights, in tokens and in sequences of ``context`` tokens.

    Memory is handed out in blocks of ``block_size`` tokens, so a sequence holds
    ``ceil(context / block_size)`` blocks. Activation workspace is not subtracted.
    """
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu memory utilization must be in (0, 1], got {gpu_memory_utilization!r}")
    check_positive(block_size, "block size")
    check_context(cfg, context)
    usable = int(hw.memory_bytes * gpu_memory_utilization)
    weights = weight_bytes(cfg, dtype)
    if weights >= usable:
        raise ValueError(
            f"{_model_label(cfg)} weights need {weights / GiB:.1f} GiB in {canonical_dtype(dtype)} "
            f"but {hw.name} offers {hw.memory_bytes / GiB:.1f} GiB x {gpu_memory_utilization:g} = "
            f"{usable / GiB:.1f} GiB; the weights do not fit"
        )
    kv = kv_bytes_per_token(cfg, kv_dtype or dtype)
    budget = usable - weights
    blocks = budget // (kv * block_size)
    per_seq_blocks = -(-context // block_size)
    return Capacity(
        memory_bytes=hw.memory_bytes,
        usable_bytes=usable,
        weight_bytes=weights,
        kv_budget_bytes=budget,
        kv_bytes_per_token=kv,
        block_size=block_size,
        kv_blocks=blocks,
        kv_tokens=blocks * block_size,
        context=context,
        max_seqs=blocks // per_seq_blocks,
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
    streamed_weight_bytes: int
    kv_bytes_per_token: int
    peak_flops: float
    bandwidth: float
    ops_per_byte: float
    capacity: Capacity
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

    @property
    def knee_reachable(self) -> bool:
        return self.knee_batch is not None and self.knee_batch <= self.capacity.max_seqs

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["hardware"] = self.hardware.to_dict()
        d["knee_reachable"] = self.knee_reachable
        d["batch_fits"] = self.batch <= self.capacity.max_seqs
        return d


def plan(
    model: str | os.PathLike | ModelConfig,
    hardware: str | Accelerator,
    *,
    dtype: str = "bf16",
    kv_dtype: str | None = None,
    context: int | None = None,
    prompt_len: int | None = None,
    batch: int = 1,
    batches: Sequence[int] | None = None,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> Plan:
    """Every planner answer for one model on one accelerator.

    ``context`` (default ``min(4096, max_position_embeddings)``) is the per-sequence context
    used for KV capacity and decode steps; ``prompt_len`` (default ``context``) is the prompt
    prefilled for TTFT; ``batch`` is the batch for the headline TTFT/TPOT; ``batches`` the
    decode sweep (default powers of two up to 256, extended past the knee).
    """
    cfg = load_model_config(model)
    hw = get_accelerator(hardware) if isinstance(hardware, str) else hardware
    dtype = canonical_dtype(dtype)
    kv_dtype = canonical_dtype(kv_dtype or dtype)
    if context is None:
        context = min(DEFAULT_CONTEXT, cfg.max_position_embeddings)
    check_context(cfg, context)
    prompt_len = context if prompt_len is None else prompt_len
    check_context(cfg, prompt_len, "prompt length")
    check_positive(batch, "batch size")
    peak = hw.peak_flops(dtype)
    capacity = kv_capacity(cfg, hw, context, dtype, kv_dtype, gpu_memory_utilization, block_size)
    knee = decode_knee(cfg, hw, context, dtype, kv_dtype)

    # weights-only knee: R W / f with f = 2 P_mm, the classic "batch ~ ops:byte x bytes/2" rule
    ratio = hw.ops_per_byte(dtype)
    knee_no_kv = max(1, math.ceil(ratio * streamed_weight_bytes(cfg, dtype) / (2 * matmul_parameters(cfg))))
    per_seq_flops = 2 * matmul_parameters(cfg) + attention_flops_per_token(cfg, context)
    limit = per_seq_flops / (context * kv_bytes_per_token(cfg, kv_dtype))

    if batches is None:
        top = max(DEFAULT_BATCHES[-1], 2 * knee if knee else 0)
        top = min(top, 8192)
        batches = [2**i for i in range(int(math.log2(top)) + 1)]
    batches = sorted({check_positive(b, "batch size") for b in batches} | {batch})

    def point(b: int) -> SweepPoint:
        dec = roofline(decode_cost(cfg, b, context, dtype, kv_dtype), hw, dtype)
        pre = roofline(prefill_cost(cfg, prompt_len, b, dtype, kv_dtype), hw, dtype)
        return SweepPoint(b, dec, b / dec.time_s, pre.time_s, b <= capacity.max_seqs)

    sweep = [point(b) for b in batches]
    knee_point = point(knee) if knee is not None else None
    at_batch = next(p for p in sweep if p.batch == batch)
    return Plan(
        model=_model_label(cfg),
        hardware=hw,
        dtype=dtype,
        kv_dtype=kv_dtype,
        context=context,
        prompt_len=prompt_len,
        batch=batch,
        gpu_memory_utilization=gpu_memory_utilization,
        num_parameters=cfg.num_parameters(),
        matmul_parameters=matmul_parameters(cfg),
        weight_bytes=weight_bytes(cfg, dtype),
        streamed_weight_bytes=streamed_weight_bytes(cfg, dtype),
        kv_bytes_per_token=kv_bytes_per_token(cfg, kv_dtype),
        peak_flops=peak,
        bandwidth=hw.bandwidth,
        ops_per_byte=ratio,
        capacity=capacity,
        knee_batch=knee,
        knee_batch_no_kv=knee_no_kv,
        decode_intensity_limit=limit,
        prefill=roofline(prefill_cost(cfg, prompt_len, 1, dtype, kv_dtype), hw, dtype),
        decode=at_batch.decode,
        ttft_s=at_batch.ttft_s,
        tpot_s=at_batch.decode.time_s,
        tokens_per_s=at_batch.tokens_per_s,
        sweep=sweep,
        knee_point=knee_point,
    )


# -- validation against a measured decode step ---------------------------------------------------


def measured_knee(batches: Sequence[int], times: Sequence[float], elasticity: float = 0.5) -> int | None:
    """The first swept batch past the bend of a measured step-time curve.

    On a roofline, step time is flat in batch while memory-bound and proportional to batch
    once compute-bound, so the elasticity ``dlog t / dlog B`` jumps from ~0 to 1 at the knee.
    Returns the first batch ``B_i`` whose elasticity from ``B_{i-1}`` reaches ``elasticity``
    (None if no step of the sweep does).
    """
    pairs = sorted(zip(batches, times))
    for (b0, t0), (b1, t1) in zip(pairs, pairs[1:]):
        if b1 > b0 and t0 > 0 and t1 > 0 and math.log(t1 / t0) / math.log(b1 / b0) >= elasticity:
            return b1
    return None


@dataclass(frozen=True)
class ValidationRow:
    batch: int
    predicted_s: float
    measured_s: float
    relative_error: float  # (predicted - measured) / measured
    bound: str


@dataclass
class Validation:
    model: str
    dtype: str
    context: int
    hardware: Accelerator
    rows: list[ValidationRow]
    predicted_knee: int | None  # closed form at `context`
    predicted_knee_on_sweep: int | None  # measured_knee() applied to the predicted curve
    measured_knee: int | None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["hardware"] = self.hardware.to_dict()
        return d


def validate(
    model: str | os.PathLike | ModelConfig,
    measure_decode_step: DecodeTimer,
    *,
    hardware: Accelerator | None = None,
    device: str | None = None,
    dtype: str = "fp32",
    kv_dtype: str | None = None,
    context: int = DEFAULT_VALIDATION_CONTEXT,
    batches: Sequence[int] = DEFAULT_VALIDATION_BATCHES,
    repeats: int = 3,
) -> Validation:
    """Predicted vs measured decode step time over a batch sweep at a fixed context.

    ``measure_decode_step(batch_size, context_len)`` returns the seconds of one decode step;
    each batch is timed once to warm up and then ``repeats`` times (median kept).
    ``hardware`` defaults to :func:`~iterserve.hardware.measure_local` on ``device``.
    """
    cfg = load_model_config(model)
    dtype = canonical_dtype(dtype)
    check_context(cfg, context)
    check_positive(repeats, "repeats")
    batches = sorted({check_positive(b, "batch size") for b in batches})
    if not batches:
        raise ValueError("validation needs at least one batch size")
    hw = hardware if hardware is not None else measure_local(device)
    hw.peak_flops(dtype)  # fail early when the device has no figure for dtype
    rows = []
    for b in batches:
        measure_decode_step(b, context)
        measured = statistics.median(measure_decode_step(b, context) for _ in range(repeats))
        pred = roofline(decode_cost(cfg, b, context, dtype, kv_dtype), hw, dtype)
        rows.append(ValidationRow(b, pred.time_s, measured, (pred.time_s - measured) / measured, pred.bound))
    return Validation(
        model=_model_label(cfg),
        dtype=dtype,
        context=context,
        hardware=hw,
        rows=rows,
        predicted_knee=decode_knee(cfg, hw, context, dtype, kv_dtype),
        predicted_knee_on_sweep=measured_knee([r.batch for r in rows], [r.predicted_s for r in rows]),
        measured_knee=measured_knee([r.batch for r in rows], [r.measured_s for r in rows]),
    )


def default_decode_timer(model_name: str, dtype: str, *, device: str = "cpu") -> DecodeTimer:
    """The decode-step timer ``--validate`` uses: one real engine decode step.

    Returns ``measure_decode_step(batch_size, context_len) -> seconds``, which times one decode
    step of ``batch_size`` sequences that each hold ``context_len`` tokens of KV cache, run
    through the engine's model forward (``iterserve.models.llama`` driven by
    ``iterserve.engine.model_runner``, see :func:`iterserve.bench.batch.decode_step_timer`).
    A preset name that is not a loadable model gets the preset's architecture with random
    weights, which time the same as trained ones.
    """
    missing = []
    for module in ("iterserve.models.llama", "iterserve.engine.model_runner"):
        try:
            __import__(module)
        except ImportError as e:
            missing.append(f"{module} ({e})")
    if missing:
        raise ValueError(
            "validation times the engine's model forward, which is not available: cannot import "
            + "; ".join(missing)
            + ". Pass measure_decode_step= to iterserve.planner.validate, or use --timer synthetic"
        )
    from iterserve.bench.batch import decode_step_timer
    from iterserve.models.loader import load_model

    try:
        loaded = load_model(model_name, dtype, device)
    except ValueError:
        preset = find_preset(model_name)
        if preset is None:
            raise
        loaded = load_model(f"random:{preset}", dtype, device)
    return decode_step_timer(loaded)


def synthetic_decode_timer(
    model: str | os.PathLike | ModelConfig, dtype: str = "fp32", *, device: str = "cpu", seed: int = 0
) -> DecodeTimer:
    """A stand-in decode step with the model's shapes and random weights, in plain torch.

    Per layer: the fused QKV projection, scaled-dot-product attention of one query per sequence
    over ``context_len`` cached K/V (grouped-query), the output projection and the gated MLP;
    then the LM head. Norms and RoPE are left out (elementwise, negligible). It exercises the
    same matmul and KV traffic as a decode step, so it checks the plumbing and the roofline
    without the engine, but it is not the engine.
    """
    import time

    import torch
    import torch.nn.functional as F

    cfg = load_model_config(model)
    key = canonical_dtype(dtype)
    tdtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if key not in tdtypes:
        raise ValueError(f"the synthetic timer runs fp32, bf16 or fp16, not {key}")
    td = tdtypes[key]
    esize = dtype_bytes(key)
    need = cfg.num_parameters() * esize
    from iterserve.hardware import available_memory_bytes

    if device == "cpu" and need > available_memory_bytes() // 2:
        raise ValueError(
            f"the synthetic timer needs {need / GiB:.1f} GiB of weights for {_model_label(cfg)}; "
            "this machine has too little free memory; pick a smaller model"
        )
    gen = torch.Generator(device="cpu").manual_seed(seed)
    h, q, kvs, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size

    def w(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen) * 0.02).to(device=device, dtype=td)

    layers = [(w(h, q + 2 * kvs), w(q, h), w(h, 2 * i), w(i, h)) for _ in range(cfg.num_layers)]
    lm_head = w(h, cfg.vocab_size)
    cache: dict[str, Any] = {}

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)

    @torch.inference_mode()
    def step(batch_size: int, context_len: int) -> float:
        check_positive(batch_size, "batch size")
        check_context(cfg, context_len)
        if cache.get("shape") != (batch_size, context_len):
            cache.clear()
            kv_shape = (batch_size, cfg.num_kv_heads, context_len, cfg.head_dim)
            cache["kv"] = [
                (torch.randn(kv_shape, generator=gen).to(device=device, dtype=td),
                 torch.randn(kv_shape, generator=gen).to(device=device, dtype=td))
                for _ in range(cfg.num_layers)
            ]  # fmt: skip
            cache["shape"] = (batch_size, context_len)
        x = torch.randn(batch_size, h, generator=gen).to(device=device, dtype=td)
        sync()
        t0 = time.perf_counter()
        for (wqkv, wo, wgu, wd), (k, v) in zip(layers, cache["kv"]):
            qh = (x @ wqkv)[:, :q].view(batch_size, cfg.num_heads, 1, cfg.head_dim)
            attn = F.scaled_dot_product_attention(qh, k, v, enable_gqa=True)
            x = x + attn.reshape(batch_size, q) @ wo
            gate, up = (x @ wgu).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ wd
        (x @ lm_head).float()
        sync()
        return time.perf_counter() - t0

    return step

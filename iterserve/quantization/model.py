"""A model's layers served from quantized blocks: how a sharded or fused layer keeps its part of them, and the
linear method that multiplies with them (which of a GGUF's tensors stay in blocks:
:func:`iterserve.formats.gguf.tensors.gguf_block_tensors`).

``quantization``:

* ``None`` (the default): float weights in the model's dtype, as loaded;
* ``"gguf"``: a GGUF file's quantized matrices stay in their blocks (the token embedding and LM head too):
  Q4_0, Q4_1 and Q8_0 repacked for the block kernel, the K-quants (Q2_K..Q6_K), Q5_0/Q5_1 and IQ4_NL/IQ4_XS as stored
  (:mod:`iterserve.quantization.gguf_weight`); float ones (F16, ...) load in the dtype, with one log line;
  any other type is refused at load;
* ``"int8"``: every linear layer and the LM head quantized at load to int8 blocks of 32 (one float16 scale
  per column and block), from any float checkpoint.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

import torch
from torch import nn

from iterserve.config.runtime import Quantization
from iterserve.distributed.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from iterserve.models.cpu_linear import default_chooser
from iterserve.models.linear import LinearBase, LinearMethod, MethodChooser, process_weights
from iterserve.models.llama import LlamaModel
from iterserve.models.moe import Experts, Router, SparseMoeBlock
from iterserve.models.native_decoder import LinearKind, NativeLinear
from iterserve.platforms.ops import cpu_kernels
from iterserve.quantization.gguf_weight import GGUFWeight
from iterserve.quantization.packed import (
    BlockWeight,
    PackedWeight,
    QuantizedWeight,
    dequantize,
    linear,
    pack,
    quantize_int8,
)

QUANTIZATIONS: tuple[str, ...] = typing.get_args(Quantization)


def check_quantization(quantization: str | None) -> str | None:
    """``None`` or one of :data:`QUANTIZATIONS` (case-insensitive), else a ValueError naming them."""
    if quantization is None or quantization.lower() in ("", "none"):
        return None
    if quantization.lower() not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; choose one of: none, {', '.join(QUANTIZATIONS)}")
    return quantization.lower()


# -- loading blocks into a (sharded, fused) layer ----------------------------------------------------


def _check(name: str, w: BlockWeight | GGUFWeight, expected: tuple[int, ...]) -> None:
    if w.shape != expected:
        raise ValueError(f"{name} has shape {w.shape}, expected {expected}")


Layer = LinearBase | VocabParallelEmbedding


def load_blocks(layer: nn.Module, name: str, w: BlockWeight | GGUFWeight, part: int | None = None) -> None:
    """Keep this rank's part of a whole checkpoint tensor in blocks, as ``layer.load`` does for a float one;
    the layer's float weight is dropped (its memory is what quantization saves)."""
    if name != "weight":
        raise ValueError(f"only weights load in blocks, not {name!r}")
    parts: dict[int, BlockWeight | GGUFWeight] = layer.__dict__.setdefault("weight_blocks", {})
    if isinstance(layer, ColumnParallelLinear):
        if part is None:
            _check(name, w, layer.full_shape(name))
            start = 0
            for i, s in enumerate(layer.shards):
                load_blocks(layer, name, w.rows(slice(start, start + s.full)), i)
                start += s.full
            return
        s = layer.shards[part]
        _check(name, w, (s.full, layer.in_features))
        parts[part] = w.rows(slice(s.start, s.start + s.size))
    elif isinstance(layer, RowParallelLinear):
        _check(name, w, layer.full_shape(name))
        parts[0] = w.columns(layer.shard.start, layer.shard.size)
    elif isinstance(layer, (VocabParallelEmbedding, ParallelLMHead)):
        _check(name, w, layer.full_shape(name))
        rows = layer.rows
        parts[0] = w.rows(slice(rows.start, rows.start + rows.valid)).padded_rows(rows.per_rank)
    else:
        raise ValueError(f"a {type(layer).__name__} does not load quantized weights")
    _drop_float_weight(layer)


def _drop_float_weight(layer: Layer) -> None:
    w = layer.weight
    if w.numel():
        layer.weight = nn.Parameter(torch.empty(0, dtype=w.dtype, device=w.device), requires_grad=False)


def _pack_blocks(layer: Layer, tiled: bool) -> QuantizedWeight | None:
    """The layer's loaded blocks, fused in part order and packed (once; GGUF blocks ``tiled`` for a matmul, which
    row lookups read too); None when it loaded float."""
    if layer.qweight is not None:
        return layer.qweight
    parts: dict[int, BlockWeight | GGUFWeight] | None = layer.__dict__.pop("weight_blocks", None)
    if not parts:
        return None
    stored = [parts[i] for i in sorted(parts) if isinstance(parts[i], GGUFWeight)]
    if stored:
        if len(stored) != len(parts):
            raise ValueError("a fused layer's parts load either all as stored GGUF blocks or none")
        w = GGUFWeight.cat(typing.cast(list[GGUFWeight], stored))
        layer.qweight = (w.tiled() if tiled else w).to(layer.weight.device)
        return layer.qweight
    blocks = [typing.cast(BlockWeight, parts[i]) for i in sorted(parts)]
    if len({b.bits for b in blocks}) > 1:  # a 4-bit block is an 8-bit one with small quants
        blocks = [BlockWeight(b.q, b.d, b.c, 8, b.fmt) for b in blocks]
    packed = pack(BlockWeight.cat(blocks)).to(layer.weight.device)
    layer.qweight = packed
    return packed


# -- the linear method --------------------------------------------------------------------------------


class QuantizedLinear(LinearMethod):
    """``x @ W^T`` with ``W`` in blocks (``layer.qweight``): the C++ kernel on the CPU, else dequantize then
    matmul. ``process_weights`` packs the blocks a GGUF loaded, or quantizes the float weight to int8."""

    name = "quantized"

    def process_weights(self, layer: LinearBase) -> None:
        if _pack_blocks(layer, tiled=True) is None:
            layer.qweight = pack(quantize_int8(layer.weight.detach())).to(layer.weight.device)
            _drop_float_weight(layer)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return self._product(layer, x, float_out=False)

    def logits(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return self._product(layer, x, float_out=True).float()  # float32 sums where the kernel runs

    def _product(self, layer: LinearBase, x: torch.Tensor, float_out: bool) -> torch.Tensor:
        assert layer.qweight is not None, "process_weights packs the weight first"
        out = linear(x, layer.qweight, float_out=float_out)
        return out if layer.bias is None else out + layer.bias

    def dense_weight(self, layer: LinearBase) -> torch.Tensor:
        assert layer.qweight is not None, "process_weights packs the weight first"
        return dequantize(layer.qweight, layer.weight.dtype)

    def native(self, layer: LinearBase) -> NativeLinear | None:
        w = layer.qweight
        if cpu_kernels() is None:  # without them the blocks multiply by dequantizing, in Python
            return None
        if isinstance(w, GGUFWeight):
            if not all(p.raw.is_cpu for p in w.parts):
                return None
            return NativeLinear(LinearKind.GGUF, [p.raw for p in w.parts], w.n, layer.bias,
                                type_ids=list(w.type_ids), part_rows=[p.rows for p in w.parts])
        if not isinstance(w, PackedWeight) or not w.data.is_cpu:
            return None
        return NativeLinear(LinearKind.QUANTIZED, [w.data], w.n, layer.bias, bits=w.bits)


QUANTIZED = QuantizedLinear()


def quantize_model(model: LlamaModel, quantization: str | None,
                   fallback: MethodChooser | None = None) -> dict[str, str]:
    """After loading: give the linear layers that loaded blocks (all of them for int8) :class:`QuantizedLinear`
    and the others ``fallback``'s method (by default :func:`iterserve.models.cpu_linear.default_chooser`'s, and float
    experts then packed for the CPU kernels: :meth:`~iterserve.models.moe.Experts.pack`); a tied
    embedding and LM head share one packed weight. Logs and returns what :func:`process_weights` does."""
    embed, head, tied = model.embed_tokens, model.lm_head, model.config.tie_word_embeddings
    if _pack_blocks(embed, tiled=tied) is not None and tied:  # tiled for the LM head's matmul
        head.qweight, head.weight = embed.qweight, embed.weight

    other = fallback or default_chooser()

    def choose(layer: LinearBase) -> LinearMethod:
        int8 = quantization == "int8" and not isinstance(layer, Router)  # which experts run stays the float choice
        if layer.qweight is not None or "weight_blocks" in layer.__dict__ or int8:
            return QUANTIZED
        return other(layer)

    chosen = process_weights(model, choose)
    ops = cpu_kernels() if fallback is None else None  # float experts follow the CPU's default methods
    for module in model.modules():
        if ops is not None and isinstance(module, Experts) and module.down_proj.device.type == "cpu":
            module.pack(ops)
    if tied and head.qweight is not None:
        embed.qweight = head.qweight  # int8: the embedding looks its rows up in the LM head's blocks
        _drop_float_weight(embed)
        head.weight = embed.weight
    return chosen


# -- what is loaded in which format --------------------------------------------------------------------


@dataclass(frozen=True)
class WeightFormat:
    """Weights held in one format: how many tensors, parameters and bytes."""

    fmt: str
    tensors: int
    parameters: int
    bytes: int


def weight_formats(model: nn.Module) -> list[WeightFormat]:
    """Every weight of ``model`` by storage format (``float32``, ``Q4_1``, ``int8``...), shared ones once:
    what the engine logs and exports as its weight memory."""
    seen: set[int] = set()
    totals: dict[str, list[int]] = {}

    def add(key: object, fmt: str, params: int, nbytes: int) -> None:
        if id(key) in seen or params == 0:
            return
        seen.add(id(key))
        t = totals.setdefault(fmt, [0, 0, 0])
        t[0], t[1], t[2] = t[0] + 1, t[1] + params, t[2] + nbytes

    for module in model.modules():
        q = getattr(module, "qweight", None)
        if isinstance(q, PackedWeight):
            add(q, q.fmt, q.n * q.k, q.nbytes)
        # each part in its own type, a fused layer's too; a MoE layer's experts (``qweights``) one by one
        for w in [q] if isinstance(q, GGUFWeight) else getattr(module, "qweights", []):
            for part in w.parts:
                add(part.raw, part.type_name, part.rows * w.k, part.raw.numel())
        if isinstance(module, Experts):
            for t, params in module.packed_parts:
                add(t, _dtype_name(t), params, t.nbytes)
        packed = getattr(module, "packed", None)  # a float weight re-laid out for the CPU kernel (cpu_linear)
        weight = getattr(module, "weight", None)
        if isinstance(packed, torch.Tensor) and isinstance(weight, torch.Tensor):
            add(packed, _dtype_name(packed), weight.numel(), packed.nbytes)
    for p in model.parameters():
        if not p.is_meta:  # a released weight: its method holds it (above)
            add(p, _dtype_name(p), p.numel(), p.numel() * p.element_size())
    return [WeightFormat(f, *t) for f, t in sorted(totals.items(), key=lambda kv: -kv[1][2])]


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def describe(formats: list[WeightFormat]) -> list[str]:
    """One log line per format, e.g. ``weights in Q4_1: 182 tensors, 61.6 MB of 93.5 MB``."""
    total = sum(f.bytes for f in formats)
    return [f"weights in {f.fmt}: {f.tensors} tensor{'s' if f.tensors != 1 else ''}, {f.bytes / 1e6:.1f} MB of "
            f"{total / 1e6:.1f} MB" for f in formats]


def streamed_weight_bytes(model: nn.Module, rows: int = 1) -> int:
    """Bytes of the matmul weights (every linear layer and the LM head, shared ones once) that a forward step of
    ``rows`` tokens reads at least, the memory floor of a decode step: of a MoE layer's experts, the share that
    ``rows`` tokens are expected to run, routing taken as uniform (as the planner takes it)."""
    seen: set[int] = set()
    total = 0.0
    for module in model.modules():
        if isinstance(module, LinearBase):
            packed = getattr(module, "packed", None)
            w = module.qweight if module.qweight is not None else packed if packed is not None else module.weight
            if id(w) not in seen:
                seen.add(id(w))
                total += w.nbytes
        elif isinstance(module, SparseMoeBlock):
            e = module.experts
            total += e.nbytes * (1 - (1 - module.top_k / module.num_experts) ** rows)
    return round(total)

"""A decode step's whole layer stack in one C++ call: the model runner's strategy for steps of decodes only.

A model describes its layers once, as typed descriptors (:class:`NativeStack` of :class:`NativeLayer`, each
linear layer a :class:`NativeLinear` its :class:`~iterserve.models.linear.LinearMethod` gives); the
:class:`NativeDecoder` turns them into ``csrc/decoder.cpp``'s ``DecoderStack`` (:func:`build_stack`, the one
place that knows the C++ side's argument layout) and runs a step on it, calling the kernels the Python layers
call one by one, in the same order. A model whose layers it cannot run (a sharded model, a mixture of experts,
another layer order, a linear method without a kernel) gives no descriptor and runs its layers in Python.
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from iterserve.attention.metadata import AttentionMetadata, KVCache
from iterserve.platforms.ops import CpuOps, cpu_kernels

# A step's LoRA weights for the native loop: for every linear layer (qkv, o, gate/up and down of each decoder
# layer in turn) each adapter's column-blocked A (None where that adapter leaves the layer alone, empty lists where
# all do), the blocks of their B that can be nonzero and four numbers per block (lora_add_'s ``parts``), and each
# row's adapter (None: all rows have the step's one adapter) (:meth:`iterserve.lora.batch.LoRABatch.native`).
NativeLoRA = tuple[list[list[torch.Tensor | None]], list[list[torch.Tensor]], list[list[int]], torch.Tensor | None]


class LinearKind(enum.Enum):
    """How the native loop multiplies one linear layer; the values are ``csrc/decoder.cpp``'s ``LinearKind``."""

    DENSE = 0  # F.linear on the plain [out, in] weight
    COLUMN_BLOCKED = 1  # packed_linear on the weight laid out in column blocks (cpu_linear.PackedLinear)
    QUANTIZED = 2  # qgemm on 4/8-bit quantized blocks
    GGUF = 3  # kgemm on GGUF blocks as stored, one or more parts


@dataclass(frozen=True)
class NativeLinear:
    """One linear layer as the native loop multiplies it: ``weights`` holds one tensor, or a GGUF weight's parts."""

    kind: LinearKind
    weights: list[torch.Tensor]
    out_features: int
    bias: torch.Tensor | None
    amx_min_rows: int = 0  # COLUMN_BLOCKED: rows from which bf16 runs on AMX tiles
    bits: int = 0  # QUANTIZED: 4 or 8
    type_ids: list[int] = field(default_factory=list)  # GGUF: each part's ggml type
    part_rows: list[int] = field(default_factory=list)  # GGUF: each part's row count


@dataclass(frozen=True)
class NativeLayer:
    """One decoder layer: its norms' weights and its four linear layers (Gemma 3's: its norms as float32 (1 + w),
    two more around the MLP, and its sliding window)."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    q_norm: torch.Tensor | None  # QK-norm (Qwen3, Gemma 3): both or neither
    k_norm: torch.Tensor | None
    qkv: NativeLinear
    o: NativeLinear
    gate_up: NativeLinear
    down: NativeLinear
    pre_feedforward_norm: torch.Tensor | None = None
    post_feedforward_norm: torch.Tensor | None = None
    window: int = 0  # Gemma 3: a local layer's window (its RoPE and paging are the step's local ones); 0: global


@dataclass(frozen=True)
class NativeStack:
    """A model's decoder layers and the shape of their attention, as the native loop takes them."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float
    layers: list[NativeLayer]
    gemma: bool = False  # Gemma 3's layer order (iterserve/models/gemma3.py); Llama's otherwise


class NativeModel(Protocol):
    """A model that can describe its layers to the native loop."""

    def native_stack(self) -> NativeStack | None:
        """Its layers' descriptors, or None where the native loop cannot run them."""


def build_stack(ops: CpuOps, spec: NativeStack) -> Any:
    """``spec`` as ``csrc/decoder.cpp``'s ``DecoderStack``: the one function that knows what its constructor,
    ``add_layer`` (a layer's norms) and ``add_linear`` take (each linear layer's kind, its weight or GGUF parts,
    out_features, its params: AMX's minimum rows, the bits, or the parts' type ids followed by their row counts,
    and its bias)."""

    def add_linear(lin: NativeLinear) -> None:
        if lin.kind is LinearKind.GGUF:
            params = lin.type_ids + lin.part_rows
        else:
            params = [{LinearKind.COLUMN_BLOCKED: lin.amx_min_rows, LinearKind.QUANTIZED: lin.bits}.get(lin.kind, 0)]
        stack.add_linear(lin.kind.value, lin.weights, lin.out_features, params, lin.bias)

    stack = ops.decoder_stack(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.eps, spec.scale, spec.gemma)
    for layer in spec.layers:
        stack.add_layer(layer.input_norm, layer.post_attention_norm, layer.q_norm, layer.k_norm,
                        layer.pre_feedforward_norm, layer.post_feedforward_norm, layer.window)
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            add_linear(lin)
    return stack


class NativeDecoder:
    """Runs a step whose every token is a decode through a model's ``DecoderStack``, built on first use and kept
    per model; the model runner holds one where the C++ kernels loaded (:meth:`for_device`)."""

    def __init__(self, ops: CpuOps) -> None:
        self.ops = ops
        self._stacks: weakref.WeakKeyDictionary[NativeModel, Any] = weakref.WeakKeyDictionary()

    @classmethod
    def for_device(cls, device: torch.device | str) -> NativeDecoder | None:
        """The strategy for a model on ``device``: on a CPU where the kernels loaded, else None."""
        ops = cpu_kernels()
        return cls(ops) if ops is not None and torch.device(device).type == "cpu" else None

    def __call__(self, model: NativeModel, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_caches: list[KVCache], meta: AttentionMetadata, lora: NativeLoRA | None = None,
                 local: tuple[torch.Tensor, torch.Tensor, AttentionMetadata] | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """All of ``model``'s decoder layers: ``(output, residual)`` as the last layer returns them; None where
        the step has a prompt token or the model no descriptor (the layers then run one by one). ``local``: Gemma
        3's local layers' cos, sin and metadata (their window, and their own pool's tables where they have one)."""
        if not meta.num_decode_tokens or meta.num_decode_tokens != x.shape[0]:
            return None
        if model not in self._stacks:
            spec = model.native_stack()
            self._stacks[model] = None if spec is None else build_stack(self.ops, spec)
        stack = self._stacks[model]
        if stack is None:
            return None
        tables, context_lens = meta.decode_tables()
        lora_a, lora_b, lora_parts, lora_slots = lora or ([], [], [], None)
        # the class's schema takes no list of lists: every linear layer's entries in a row, with two counts a layer
        counts = [n for a, b in zip(lora_a, lora_b, strict=True) for n in (len(a), len(b))]
        paged: list[torch.Tensor] = []
        if local is not None:
            local_cos, local_sin, local_meta = local
            paged = [local_cos[:, 0], local_sin[:, 0], local_meta.slot_blocks, local_meta.slot_offsets,
                     *local_meta.decode_tables()]
        out: tuple[torch.Tensor, torch.Tensor] = stack.forward(
            x, cos[:, 0], sin[:, 0], [c.k for c in kv_caches], [c.v for c in kv_caches], meta.slot_blocks,
            meta.slot_offsets, tables, context_lens, meta.sliding_window or 0,
            [c.k_scale for c in kv_caches if c.k_scale is not None],
            [c.v_scale for c in kv_caches if c.v_scale is not None], [t for per in lora_a for t in per],
            [t for per in lora_b for t in per], [n for per in lora_parts for n in per], counts, lora_slots, paged)
        return out

"""One step's adapters and the rows each serves: the base matmul runs once for every row, then each row gets its
own adapter's low-rank product. With the C++ kernels, ``lora_add_`` (csrc/lora.cpp) groups the rows by adapter
and multiplies each group by its own adapter's A and B only, packed once as the dense linear layers' weights are,
on the kernels' thread pool (vLLM's punica SGMV); a fused layer's B goes as its parts' blocks, so that no zero
block of it is multiplied. Without them, torch ops: the step's adapters' A stacked for one
shrink ``x @ A.T``, each row's columns of other adapters zeroed, and their B side by side for one expand."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from iterserve.lora.adapter import LoRAAdapter, LoRAWeights
from iterserve.models.linear import LinearBase
from iterserve.models.native_decoder import NativeLoRA
from iterserve.platforms.ops import CpuOps, ops_for


@dataclass
class LayerStack:
    """The step's adapters' weights for one layer, side by side: ``a_t`` (A transposed) ``[in, sum of ranks]``,
    ``b`` ``[out, sum of ranks]``, and ``layout``: the place among the step's adapters of each stacked column."""

    a_t: torch.Tensor  # contiguous: a bf16 matmul with a transposed view of A takes a far slower path
    b: torch.Tensor
    layout: tuple[int, ...]


@dataclass
class PackedStack:
    """The step's adapters' weights for one layer as ``lora_add_`` takes them: per slot (the adapter's place among
    the step's) its A laid out by ``pack_linear_weight``, None where that adapter leaves the layer alone; the
    blocks of their B that can be nonzero, each so laid out; and per block four numbers: its slot, its first
    column of the slot's stacked rank, its first output column and its output columns."""

    a: list[torch.Tensor | None]
    b: list[torch.Tensor]
    parts: list[int]


def pack_weights(ops: CpuOps, weights: list[LoRAWeights | None]) -> PackedStack:
    """The :class:`PackedStack` of a layer's weights per slot. Each part's ranks but the last are padded to an
    even count with zeros, so that the next part's start at an even column: bf16 k-pairs need that."""
    stack = PackedStack([], [], [])
    for slot, w in enumerate(weights):
        if w is None:
            stack.a.append(None)
            continue
        a_rows, rank0, blocks = [], 0, w.blocks()
        for i, part in enumerate(blocks):
            rank = part.rank1 - part.rank0
            pad = rank % 2 if i + 1 < len(blocks) else 0
            a_rows.append(F.pad(w.a[part.rank0:part.rank1], (0, 0, 0, pad)))
            b = F.pad(w.b[part.out0:part.out1, part.rank0:part.rank1], (0, pad))
            stack.b.append(ops.pack_linear_weight(b.contiguous()))
            stack.parts += [slot, rank0, part.out0, part.out1 - part.out0]
            rank0 += rank + pad
        stack.a.append(ops.pack_linear_weight(torch.cat(a_rows).contiguous()))
    return stack


def stack_layer(adapters: list[LoRAAdapter], layer: LinearBase,
                ops: CpuOps | None = None) -> LayerStack | PackedStack | None:
    """``layer``'s stack of the adapters that target it (None: none does), packed for ``ops`` if given."""
    parts = [(slot, w) for slot, adapter in enumerate(adapters) if (w := adapter.weights.get(layer)) is not None]
    if not parts:
        return None
    if ops is not None:
        return pack_weights(ops, [adapter.weights.get(layer) for adapter in adapters])
    layout = tuple(slot for slot, w in parts for _ in range(w.a.shape[0]))
    return LayerStack(torch.cat([w.a for _, w in parts]).T.contiguous(), torch.cat([w.b for _, w in parts], dim=1),
                      layout)


@dataclass
class LoRABatch:
    """What :meth:`LinearBase.forward` adds to a step's rows; passed down the model's forward with the step."""

    adapters: list[LoRAAdapter]  # the step's, by their place (a slot)
    row_slots: torch.Tensor | None  # each row's slot, -1 for the base model; None: every row is under slot 0
    stacks: dict[LinearBase, LayerStack | PackedStack | None]  # per layer, built on first use (kept while the
    # adapters are)
    ops: CpuOps | None = None  # the C++ kernels that add the products (None: torch ops)
    masks: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)  # per layout: 1 where row meets column

    def add(self, layer: LinearBase, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        stack = self._stack(layer)
        if stack is None:  # no adapter of the step targets this layer
            return out
        if isinstance(stack, PackedStack):
            assert self.ops is not None
            return self.ops.lora_add_(out, x, stack.a, stack.b, stack.parts, self.row_slots)
        shrunk = x @ stack.a_t
        mask = self._mask(stack)
        if mask is not None:
            shrunk = shrunk * mask
        return out + shrunk @ stack.b.T

    def native(self, layers: list[LinearBase]) -> NativeLoRA | None:
        """What csrc/decoder.cpp adds with the kernel :meth:`add` calls: per layer each slot's packed A, the B
        blocks and their four numbers each (empty lists for a layer no adapter targets), and each row's slot;
        None without the kernels."""
        if self.ops is None:
            return None
        stacks = [self._stack(layer) for layer in layers]
        packed = [s if isinstance(s, PackedStack) else PackedStack([], [], []) for s in stacks]
        return [s.a for s in packed], [s.b for s in packed], [s.parts for s in packed], self.row_slots

    def _stack(self, layer: LinearBase) -> LayerStack | PackedStack | None:
        if layer not in self.stacks:
            self.stacks[layer] = stack_layer(self.adapters, layer, self.ops)
        return self.stacks[layer]

    def _mask(self, stack: LayerStack) -> torch.Tensor | None:
        """1 where a row meets a column of its own adapter (None: every row has the step's one adapter)."""
        if self.row_slots is None:
            return None
        mask = self.masks.get(stack.layout)
        if mask is None:
            columns = torch.tensor(stack.layout, device=self.row_slots.device)
            mask = self.masks[stack.layout] = (self.row_slots[:, None] == columns[None, :]).to(stack.a_t.dtype)
        return mask

    @classmethod
    def build(cls, adapters: list[LoRAAdapter | None], query_lens: list[int], device: torch.device,
              stacks: dict[LinearBase, LayerStack | PackedStack | None] | None = None) -> LoRABatch | None:
        """The batch of a step whose scheduled sequence i runs ``query_lens[i]`` rows under ``adapters[i]``;
        None when no row has an adapter (the step then runs the base model alone). ``stacks``: the layers'
        stacks of these same adapters in id order, kept from an earlier step."""
        present = sorted({a.id: a for a in adapters if a is not None}.items())
        if not present:
            return None
        slot_of = {lora_id: slot for slot, (lora_id, _) in enumerate(present)}
        slots = [slot_of[a.id] if a is not None else -1 for a, n in zip(adapters, query_lens) for _ in range(n)]
        row_slots = None if len(present) == 1 and -1 not in slots else torch.tensor(slots, device=device)
        ops = ops_for(device)
        return cls([a for _, a in present], row_slots, {} if stacks is None else stacks,
                   ops if isinstance(ops, CpuOps) else None)

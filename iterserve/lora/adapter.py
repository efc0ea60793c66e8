"""A PEFT LoRA adapter loaded onto the base model's fused linear layers.

A PEFT folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``...) and
``adapter_model.safetensors`` with ``...layers.{i}.self_attn.q_proj.lora_A.weight`` ``[r, in]`` and
``lora_B.weight`` ``[out, r]`` per target module. Here q/k/v share one ``qkv_proj`` and gate/up one
``gate_up_proj``, so the adapter's parts of a fused layer are stacked: their A matrices one above the other,
their B matrices block-diagonally (part p's rows of the fused output, part p's columns of the stacked rank),
so that ``x @ A.T @ B.T`` is each part's product in its own slice and zero in the parts it does not target.
The scaling (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA) is folded into B once, at load. A llama.cpp
GGUF adapter file reads into the same names (:mod:`iterserve.lora.gguf_adapter`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from iterserve.config import ModelConfig
from iterserve.distributed.layers import ColumnParallelLinear
from iterserve.lora.gguf_adapter import is_gguf_adapter, read_gguf_adapter
from iterserve.lora.request import LoRARequest
from iterserve.models.linear import LinearBase
from iterserve.models.llama import LlamaModel

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"

# a PEFT target module -> (the fused layer holding it, its part of that layer's output; None: the whole layer)
TARGETS: dict[str, tuple[str, int | None]] = {
    "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1), "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", None),
    "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1), "down_proj": ("mlp.down_proj", None),
}
MODULE_OF = {place: module for module, place in TARGETS.items()}  # (fused layer, part) -> PEFT module
TENSOR_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


@dataclass(frozen=True)
class BlockOfB:
    """One part's block of a fused layer's block-diagonal B: its output rows ``[out0, out1)`` and its columns of
    the stacked rank ``[rank0, rank1)``."""

    out0: int
    out1: int
    rank0: int
    rank1: int


@dataclass
class LoRAWeights:
    """One layer's share of an adapter: ``a`` ``[rank, in]``, ``b`` ``[out, rank]`` with the scaling in it;
    ``parts``: the blocks of ``b`` that can be nonzero (empty: all of it), in rank order."""

    a: torch.Tensor
    b: torch.Tensor
    parts: tuple[BlockOfB, ...] = ()

    def blocks(self) -> tuple[BlockOfB, ...]:
        return self.parts or (BlockOfB(0, self.b.shape[0], 0, self.b.shape[1]),)


@dataclass
class LoRAAdapter:
    """An adapter ready to run: its request and its weights per linear layer of the model (by identity)."""

    request: LoRARequest
    rank: int
    scaling: float
    weights: dict[LinearBase, LoRAWeights]

    @property
    def id(self) -> int:
        return self.request.lora_int_id


class AdapterError(ValueError):
    """An adapter that cannot be served with this model and these settings; the message names the problem."""

    def __init__(self, lora: LoRARequest, problem: str) -> None:
        super().__init__(f"LoRA adapter {lora.lora_name!r} ({lora.lora_path}): {problem}")


def read_config(lora: LoRARequest, max_rank: int) -> tuple[int, float]:
    """The adapter's rank and scaling from its ``adapter_config.json``, refusing what this engine does not run."""
    path = Path(lora.lora_path) / CONFIG_FILE
    try:
        config: Any = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdapterError(lora, f"no {CONFIG_FILE} in the adapter folder") from None
    except (OSError, ValueError) as e:
        raise AdapterError(lora, f"cannot read {CONFIG_FILE}: {e}") from None
    if not isinstance(config, dict) or not isinstance(config.get("r"), int) or config["r"] < 1:
        raise AdapterError(lora, f"{CONFIG_FILE} has no rank 'r' (an integer >= 1)")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(lora, f"peft_type {config['peft_type']!r} is not LoRA")
    unsupported = [k for k in ("rank_pattern", "alpha_pattern", "modules_to_save", "use_dora") if config.get(k)]
    if config.get("bias", "none") != "none":
        unsupported.append("bias")
    if unsupported:
        raise AdapterError(lora, f"unsupported adapter options: {', '.join(unsupported)}")
    rank = config["r"]
    if rank > max_rank:
        raise AdapterError(lora, f"rank {rank} is above max_lora_rank={max_rank}")
    alpha = float(config["lora_alpha"]) if "lora_alpha" in config else float(rank)
    return rank, alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def read_tensors(lora: LoRARequest) -> dict[str, torch.Tensor]:
    path = Path(lora.lora_path) / WEIGHTS_FILE
    if not path.is_file():
        raise AdapterError(lora, f"no {WEIGHTS_FILE} in the adapter folder")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise AdapterError(lora, f"cannot read {WEIGHTS_FILE}: {e}") from None


def read_adapter(lora: LoRARequest, max_rank: int, config: ModelConfig) -> tuple[int, float, dict[str, torch.Tensor]]:
    """The rank, scaling and PEFT-named tensors of a PEFT folder or of a llama.cpp GGUF adapter file."""
    if not lora.lora_path:
        raise AdapterError(lora, "no lora_path to load it from")
    if is_gguf_adapter(lora):
        try:
            rank, scaling, tensors = read_gguf_adapter(lora, config)
        except ValueError as e:
            raise AdapterError(lora, str(e)) from None
        if rank > max_rank:
            raise AdapterError(lora, f"rank {rank} is above max_lora_rank={max_rank}")
        return rank, scaling, tensors
    if not Path(lora.lora_path).is_dir():
        raise AdapterError(lora, "the adapter folder does not exist")
    rank, scaling = read_config(lora, max_rank)
    return rank, scaling, read_tensors(lora)


def group_parts(lora: LoRARequest, tensors: dict[str, torch.Tensor],
                num_layers: int) -> dict[tuple[int, str], dict[int | None, dict[str, torch.Tensor]]]:
    """``{(layer index, fused layer name): {part: {"A": ..., "B": ...}}}``; a tensor naming a module this model
    has no LoRA place for is refused."""
    grouped: dict[tuple[int, str], dict[int | None, dict[str, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        m = TENSOR_NAME.search(name)
        if m is None or m.group(2) not in TARGETS:
            module = re.search(r"(\w+)\.lora_\w+(?:\.\w+)*$", name)
            raise AdapterError(lora, f"tensor {name!r} targets module "
                                     f"{(module.group(1) if module else name)!r}, "
                                     f"which this model does not have (LoRA targets: {', '.join(TARGETS)})")
        index, (layer, part) = int(m.group(1)), TARGETS[m.group(2)]
        if index >= num_layers:
            raise AdapterError(lora, f"tensor {name!r} is for layer {index}; the model has {num_layers} layers")
        grouped.setdefault((index, layer), {}).setdefault(part, {})[m.group(3)] = tensor
    if not grouped:
        raise AdapterError(lora, f"{WEIGHTS_FILE} holds no LoRA weights")
    return grouped


def fuse(lora: LoRARequest, layer: LinearBase, index: int, name: str, parts: dict[int | None, dict[str, torch.Tensor]],
         scaling: float, max_rank: int, device: torch.device) -> LoRAWeights:
    """One fused layer's stacked A and block-diagonal, scaled B; each part's shapes checked against the layer."""
    slices: list[tuple[int, int, int | None]] = [(0, layer.out_features, None)]  # (row offset, rows, part)
    if isinstance(layer, ColumnParallelLinear):
        offsets = [sum(s.size for s in layer.shards[:i]) for i in range(len(layer.shards))]
        slices = [(offsets[i], s.size, i) for i, s in enumerate(layer.shards)]
    a_rows: list[torch.Tensor] = []
    blocks: list[BlockOfB] = []
    b = torch.zeros(layer.out_features, sum(p["A"].shape[0] for p in parts.values() if "A" in p))
    for offset, rows, part in slices:
        if part not in parts:
            continue
        pair, where = parts[part], f"layers.{index}.{name.split('.')[0]}.{MODULE_OF[name, part]}"
        if set(pair) != {"A", "B"}:
            raise AdapterError(lora, f"{where} has lora_A or lora_B alone")
        a, b_part = pair["A"], pair["B"]
        r = a.shape[0]
        if r > max_rank:
            raise AdapterError(lora, f"{where} has rank {r}, above max_lora_rank={max_rank}")
        for label, t, want in (("lora_A", a, (r, layer.in_features)), ("lora_B", b_part, (rows, r))):
            if tuple(t.shape) != want:
                raise AdapterError(lora, f"{where}.{label} has shape {tuple(t.shape)}, expected {want} for this "
                                         "model: an adapter of another base model?")
        col = sum(x.shape[0] for x in a_rows)
        b[offset:offset + rows, col:col + r] = b_part.float() * scaling
        a_rows.append(a.float())
        blocks.append(BlockOfB(offset, offset + rows, col, col + r))
    dtype = layer.weight.dtype  # the device is the model's: a packed layer's plain weight is on "meta"
    return LoRAWeights(torch.cat(a_rows).to(device, dtype).contiguous(), b.to(device, dtype).contiguous(),
                       tuple(blocks))


def load_adapter(lora: LoRARequest, model: LlamaModel, max_rank: int) -> LoRAAdapter:
    """Read and check the adapter at ``lora.lora_path`` and lay it out for ``model``'s fused layers."""
    rank, scaling, tensors = read_adapter(lora, max_rank, model.config)
    grouped = group_parts(lora, tensors, model.config.num_layers)
    weights: dict[LinearBase, LoRAWeights] = {}
    for (index, name), parts in sorted(grouped.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        try:
            layer = model.get_submodule(f"layers.{index}.{name}")
        except AttributeError:
            layer = None
        if not isinstance(layer, LinearBase):  # a mixture-of-experts layer's MLP has no one linear layer
            raise AdapterError(lora, f"layers.{index}.{name} is not a linear layer of this model")
        weights[layer] = fuse(lora, layer, index, name, parts, scaling, max_rank, model.device)
    return LoRAAdapter(lora, rank, scaling, weights)

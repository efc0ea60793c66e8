"""A model built empty and filled from a checkpoint's named tensors, whatever file they come from: the module
tree of one rank's shard, each tensor copied into its parameter (fused and sharded layers keep their part),
and seeded random weights for a model with none."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

import torch
from tqdm.auto import tqdm

from iterserve.config import ModelConfig
from iterserve.distributed.layers import ShardedLayer
from iterserve.distributed.parallel_state import ParallelState
from iterserve.models.archs import hf_param_name, model_class, parts_of
from iterserve.models.llama import LlamaModel
from iterserve.models.moe import ExpertLoader
from iterserve.quantization.gguf_weight import GGUFWeight
from iterserve.quantization.model import load_blocks
from iterserve.quantization.packed import BlockWeight
from iterserve.tokenizer import Tokenizer

T = TypeVar("T")


@dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer | None


def empty_model(config: ModelConfig, dtype: torch.dtype, device: torch.device,
                parallel: ParallelState | None = None) -> LlamaModel:
    """Build the module tree (this rank's shard) without initialising weights, then place it on ``device``."""
    config.tensor_parallel_shard(parallel.world_size if parallel else 1)  # a clear error if it does not split
    with torch.device("meta"):
        model = model_class(config)(config, parallel)
    model = model.to_empty(device=device).to(dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = model.make_rotary().to(device)
    return model.eval()


def load_weight(model: LlamaModel, name: str, tensor: torch.Tensor | BlockWeight | GGUFWeight,
                part: int | None = None) -> None:
    """Copy one whole tensor (part ``part`` of a fused one) into parameter ``name``; a sharded layer keeps
    this rank's rows of it (in blocks, for a :class:`BlockWeight` or :class:`GGUFWeight`)."""
    module_name, _, param = name.rpartition(".")
    module = model.get_submodule(module_name)
    if isinstance(tensor, (BlockWeight, GGUFWeight)):
        load_blocks(module, param, tensor, part)
        return
    if isinstance(module, ShardedLayer):
        module.load(param, tensor, part)
        return
    dest = getattr(module, param)
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
    with torch.no_grad():
        dest.copy_(tensor)


def load_hf_state_dict(model: LlamaModel,
                       tensors: Iterable[tuple[str, torch.Tensor | BlockWeight | GGUFWeight]]) -> None:
    """Copy Hugging Face-named tensors into the model, fusing q/k/v and gate/up projections
    (:func:`~iterserve.models.archs.hf_param_name` names each tensor's parameter)."""
    c = model.config
    experts = ExpertLoader(model)  # expert weights, under any of their names, go to the 3-D expert tensors
    params = {n: p for n, p in model.named_parameters() if n not in experts.names}
    parts_needed = {n: parts_of(n) for n in params}
    parts_loaded: Counter[str] = Counter()
    for hf_name, tensor in experts.take(tensors):
        mapped = hf_param_name(c, hf_name)
        if mapped is None:
            continue
        name, part = mapped
        if name not in params:
            raise ValueError(f"unexpected weight {hf_name!r} for a {c.architecture} model")
        try:
            load_weight(model, name, tensor, part)
        except ValueError as e:
            raise ValueError(f"weight {hf_name!r}: {e}") from None
        parts_loaded[name] += 1 if part is not None else parts_needed[name]  # a whole fused tensor fills all
    missing = [n for n, k in parts_needed.items() if parts_loaded[n] != k]
    if missing:
        raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")


def init_random_weights(model: LlamaModel, seed: int) -> None:
    """Seeded N(0, 0.02) weights and unit norms: deterministic for a seed on a given device.

    Each whole tensor is drawn, then a sharded layer keeps its rows: a model has the same weights at
    every tensor-parallel size.
    """
    gen = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            module = model.get_submodule(name.rpartition(".")[0])
            shape = module.full_shape(name.rpartition(".")[2]) if isinstance(module, ShardedLayer) else p.shape
            load_weight(model, name, torch.empty(shape, dtype=p.dtype, device=p.device).normal_(0.0, 0.02,
                                                                                                generator=gen))


def tensor_progress(tensors: Iterable[T], total: int | None, enabled: bool) -> Iterable[T]:
    """``tensors``, counted on stderr as they are taken when ``enabled`` and stderr is a terminal.

    A large model takes minutes to load and a silent terminal looks hung, so a bar counts the tensors as vLLM
    counts its checkpoint shards; never into logs, pipes or tests, and not at all with ``--no-load-progress``.
    """
    if not enabled or not sys.stderr.isatty():
        return tensors
    return tqdm(tensors, total=total, desc="Loading weights", unit="tensor", file=sys.stderr, mininterval=0.25)

"""The loaded adapters of one model: at most ``max_loras`` of them, least recently used evicted first, each
loaded from its path on first use (and again after an eviction)."""

from __future__ import annotations

from collections import OrderedDict

import torch

from iterserve.lora.adapter import LoRAAdapter, load_adapter
from iterserve.lora.batch import LayerStack, LoRABatch, PackedStack
from iterserve.lora.request import LoRARequest
from iterserve.models.linear import LinearBase
from iterserve.models.llama import LlamaModel

MAX_STACKED_SETS = 8  # sets of a step's adapters whose stacked weights are kept for the next steps


class LoRAManager:
    def __init__(self, model: LlamaModel, max_loras: int, max_lora_rank: int) -> None:
        if not getattr(model, "supports_lora", False):
            raise ValueError(f"LoRA adapters are not supported on {type(model).__name__} models")
        if model.parallel.world_size > 1:
            raise ValueError("LoRA adapters run with tensor_parallel_size=1 only")
        self.model = model
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()  # LRU order: evict from the front
        self.active: set[int] = set()  # the last step's adapters: evicted last
        # per set of a step's adapters (ids in order), its layers' stacked weights: steps reuse them
        self.stacks: dict[tuple[int, ...], dict[LinearBase, LayerStack | PackedStack | None]] = {}

    def add(self, lora: LoRARequest) -> LoRAAdapter:
        """The adapter, loaded (and checked) if it is not yet; raises ValueError naming what is wrong with it."""
        adapter = self.loaded.get(lora.lora_int_id)
        if adapter is not None:
            if (adapter.request.lora_name, adapter.request.lora_path) != (lora.lora_name, lora.lora_path):
                raise ValueError(f"lora_int_id {lora.lora_int_id} is already adapter {adapter.request.lora_name!r} "
                                 f"({adapter.request.lora_path}); give {lora.lora_name!r} another id")
            self.loaded.move_to_end(lora.lora_int_id)
            return adapter
        adapter = load_adapter(lora, self.model, self.max_lora_rank)  # before evicting: a bad one changes nothing
        while len(self.loaded) >= self.max_loras:
            idle = [i for i in self.loaded if i not in self.active]
            del self.loaded[idle[0] if idle else next(iter(self.loaded))]
        self.loaded[lora.lora_int_id] = adapter
        self.stacks.clear()  # stacks of an evicted adapter's weights would keep them in memory
        return adapter

    def batch(self, loras: list[LoRARequest | None], query_lens: list[int],
              device: torch.device) -> LoRABatch | None:
        """The step's :class:`LoRABatch` (None when no sequence has an adapter); the scheduler admits at most
        ``max_loras`` adapters to a step, so every one of them is held at once."""
        wanted = {lora.lora_int_id for lora in loras if lora is not None}
        if len(wanted) > self.max_loras:
            raise ValueError(f"a step holds {len(wanted)} LoRA adapters; max_loras is {self.max_loras}")
        self.active = wanted
        adapters = [None if lora is None else self.add(lora) for lora in loras]
        key = tuple(sorted(wanted))
        stacks = self.stacks.pop(key, {})  # put back last: the dict's order is least recently used first
        self.stacks[key] = stacks
        while len(self.stacks) > MAX_STACKED_SETS:
            del self.stacks[next(iter(self.stacks))]
        return LoRABatch.build(adapters, query_lens, device, stacks)

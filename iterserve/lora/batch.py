"""One step's adapters and the rows each serves: the base matmul runs once for every row, then each adapter's
low-rank product is added to its own rows only (a segmented shrink ``x @ A.T`` and expand ``@ B.T``, as vLLM's
punica kernels do, here in plain torch ops)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from iterserve.lora.adapter import LoRAAdapter
from iterserve.models.linear import LinearBase


@dataclass
class LoRASegment:
    """An adapter and the step's rows it serves (None: every row of the step)."""

    adapter: LoRAAdapter
    rows: torch.Tensor | None


@dataclass
class LoRABatch:
    """What :meth:`LinearBase.forward` adds to a step's rows; passed down the model's forward with the step."""

    segments: list[LoRASegment]

    def add(self, layer: LinearBase, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        for segment in self.segments:
            w = segment.adapter.weights.get(layer)
            if w is None:  # the adapter does not target this layer
                continue
            if segment.rows is None:
                out = out + (x @ w.a.T) @ w.b.T
            else:
                out = out.index_add(0, segment.rows, (x.index_select(0, segment.rows) @ w.a.T) @ w.b.T)
        return out

    @classmethod
    def build(cls, adapters: list[LoRAAdapter | None], query_lens: list[int],
              device: torch.device) -> LoRABatch | None:
        """The segments of a step whose scheduled sequence i runs ``query_lens[i]`` rows under ``adapters[i]``;
        None when no row has an adapter (the step then runs the base model alone)."""
        rows: dict[int, list[int]] = {}
        by_id: dict[int, LoRAAdapter] = {}
        start = 0
        for adapter, n in zip(adapters, query_lens):
            if adapter is not None:
                by_id[adapter.id] = adapter
                rows.setdefault(adapter.id, []).extend(range(start, start + n))
            start += n
        if not rows:
            return None
        return cls([
            LoRASegment(by_id[i], None if len(r) == start else torch.tensor(r, dtype=torch.long, device=device))
            for i, r in rows.items()
        ])

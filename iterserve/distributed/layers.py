"""Sharded layers of the Megatron split: column-parallel in, row-parallel out, one all-reduce between.

q/k/v and gate/up are column-parallel: each rank computes its heads (its slice of the MLP width) from the
whole activation, so attention and the gate run with no communication. o and down are row-parallel: each
rank multiplies its slice of the inputs and one all-reduce sums the partial outputs. The embedding and the
LM head split the vocabulary; the logits are gathered on rank 0, where the sampler runs.

Every layer loads the *whole* checkpoint tensor and keeps its own rows (``load``), so a loader only names
the tensor; ``full_shape`` says what a whole tensor looks like (random weights are drawn at that shape, so a
model splits into the same numbers at any tensor-parallel size). With one rank each layer computes what the
plain ``nn.Linear`` / ``nn.Embedding`` it derives from does; a linear layer's product goes through its
:class:`~iterserve.models.linear.LinearMethod`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from iterserve.distributed.parallel_state import ParallelState
from iterserve.models.linear import LinearBase, LinearDelta
from iterserve.quantization.packed import QuantizedWeight, dequantize


@dataclass(frozen=True)
class Shard:
    """The rows ``[start, start + size)`` this rank holds of one output part of ``full`` rows."""

    full: int
    start: int
    size: int


def even_shard(full: int, ps: ParallelState) -> Shard:
    start, size = ps.shard_range(full)
    return Shard(full, start, size)


def head_shard(num_heads: int, head_dim: int, ps: ParallelState) -> Shard:
    """This rank's heads: ``num_heads / world`` of them, or one head shared with the neighbouring ranks
    when there are fewer heads than ranks (KV heads under grouped-query attention)."""
    if num_heads >= ps.world_size:
        per = num_heads // ps.world_size
        first = ps.rank * per
    else:
        per, first = 1, ps.rank * num_heads // ps.world_size
    return Shard(num_heads * head_dim, first * head_dim, per * head_dim)


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {expected}")


class ColumnParallelLinear(LinearBase):
    """Output rows split across ranks; ``shards`` lists the fused parts (q, k, v or gate, up) in order,
    each holding its own slice, so a fused matmul still yields ``[q_local | k_local | v_local]``."""

    def __init__(self, input_size: int, shards: list[Shard], bias: bool = False) -> None:
        super().__init__(input_size, sum(s.size for s in shards), bias=bias)
        self.shards = shards

    def full_shape(self, name: str) -> tuple[int, ...]:
        rows = sum(s.full for s in self.shards)
        return (rows, self.in_features) if name == "weight" else (rows,)

    def load(self, name: str, tensor: torch.Tensor, part: int | None = None) -> None:
        """Keep this rank's rows of part ``part`` (of every part when None: a whole fused tensor)."""
        if part is None:
            _check_shape(name, tensor, self.full_shape(name))
            for i, piece in enumerate(tensor.split([s.full for s in self.shards])):
                self.load(name, piece, i)
            return
        s = self.shards[part]
        _check_shape(name, tensor, (s.full, *self.full_shape(name)[1:]))
        offset = sum(x.size for x in self.shards[:part])
        with torch.no_grad():
            getattr(self, name)[offset:offset + s.size].copy_(tensor[s.start:s.start + s.size])


class RowParallelLinear(LinearBase):
    """Input columns split across ranks; the partial products are summed with one all-reduce."""

    def __init__(self, input_size: int, output_size: int, ps: ParallelState) -> None:
        self.shard = even_shard(input_size, ps)
        super().__init__(self.shard.size, output_size, bias=False)
        self.ps = ps

    def full_shape(self, name: str) -> tuple[int, ...]:
        return (self.out_features, self.shard.full)

    def load(self, name: str, tensor: torch.Tensor, part: int | None = None) -> None:
        _check_shape(name, tensor, self.full_shape(name))
        with torch.no_grad():
            self.weight.copy_(tensor[:, self.shard.start:self.shard.start + self.shard.size])

    def forward(self, x: torch.Tensor, delta: LinearDelta | None = None) -> torch.Tensor:
        out = self.matmul(x)  # an adapter's rows are added on this rank, before the sum over ranks
        return self.ps.all_reduce(out if delta is None else delta.add(self, x, out))


class _VocabRows:
    """The vocabulary rows a rank holds: ``ceil(vocab / world)`` of them, the last rank's padded with zeros."""

    def __init__(self, vocab_size: int, ps: ParallelState) -> None:
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // ps.world_size)
        self.start = ps.rank * self.per_rank
        self.valid = max(0, min(self.per_rank, vocab_size - self.start))

    def load(self, weight: torch.Tensor, name: str, tensor: torch.Tensor) -> None:
        _check_shape(name, tensor, (self.vocab_size, weight.shape[1]))
        with torch.no_grad():
            weight[:self.valid].copy_(tensor[self.start:self.start + self.valid])
            weight[self.valid:].zero_()


class VocabParallelEmbedding(nn.Embedding):
    """Each rank looks up the ids in its slice of the vocabulary (zeros for the others); an all-reduce
    assembles the embeddings."""

    def __init__(self, vocab_size: int, hidden_size: int, ps: ParallelState) -> None:
        self.rows = _VocabRows(vocab_size, ps)
        super().__init__(self.rows.per_rank, hidden_size)
        self.ps = ps

    def full_shape(self, name: str) -> tuple[int, ...]:
        return (self.rows.vocab_size, self.embedding_dim)

    qweight: QuantizedWeight | None = None  # the rows in quantized blocks (iterserve.quantization) instead

    def load(self, name: str, tensor: torch.Tensor, part: int | None = None) -> None:
        self.rows.load(self.weight, name, tensor)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is None:
            return F.embedding(ids, self.weight)
        return dequantize(self.qweight, self.weight.dtype, rows=ids)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.ps.is_parallel:
            return self.lookup(ids)
        mine = (ids >= self.rows.start) & (ids < self.rows.start + self.rows.valid)
        out = self.lookup((ids - self.rows.start) * mine) * mine.unsqueeze(-1)
        return self.ps.all_reduce(out)


class ParallelLMHead(LinearBase):
    """Each rank scores its slice of the vocabulary; the logits are gathered on rank 0 (empty elsewhere)."""

    def __init__(self, hidden_size: int, vocab_size: int, ps: ParallelState) -> None:
        self.rows = _VocabRows(vocab_size, ps)
        super().__init__(hidden_size, self.rows.per_rank, bias=False)
        self.ps = ps

    def full_shape(self, name: str) -> tuple[int, ...]:
        return (self.rows.vocab_size, self.in_features)

    def load(self, name: str, tensor: torch.Tensor, part: int | None = None) -> None:
        self.rows.load(self.weight, name, tensor)

    def forward(self, x: torch.Tensor, delta: LinearDelta | None = None) -> torch.Tensor:
        """Float32 logits (the method's ``logits``: where its kernel sums in float32, not rounded to bf16)."""
        logits = self.ps.gather_last_dim(self.method.logits(self, x))
        return logits[..., :self.rows.vocab_size] if self.ps.is_parallel else logits


ShardedLayer = ColumnParallelLinear | RowParallelLinear | VocabParallelEmbedding | ParallelLMHead

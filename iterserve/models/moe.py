"""The sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE) and the loading of its expert weights.

A router (``gate``, a linear layer to ``num_experts`` logits) picks each token's ``num_experts_per_tok``
experts by softmax probability (in float32), renormalised to sum to 1 where the model says so (Mixtral
always, Qwen3-MoE with ``norm_topk_prob``). The experts' weights are one 3-D tensor per projection,
``gate_up_proj [experts, 2 * width, hidden]`` (gate rows then up rows) and ``down_proj [experts, hidden,
width]``, the layout transformers 5 holds in memory. The computation is grouped by expert: the rows routed
to an expert are gathered, go through one gate_up matmul, SiLU-and-mul and one down matmul, and are added
back weighted by their routing weight.

A row's result does not depend on the other rows of the batch: the router's choice is per row, and each row
adds its experts' outputs in increasing expert id (the order transformers adds them in, too).

Checkpoints name expert weights several ways, all read here (:class:`ExpertLoader`): transformers 5's fused
3-D ``mlp.experts.gate_up_proj`` / ``down_proj``; one 2-D tensor per expert, ``mlp.experts.N.gate_proj`` /
``up_proj`` / ``down_proj`` (Qwen3-MoE on the Hub and what ``save_pretrained`` writes) or
``block_sparse_moe.experts.N.w1`` / ``w3`` / ``w2`` (Mixtral); and GGUF's 3-D ``ffn_gate_exps`` /
``ffn_up_exps`` / ``ffn_down_exps`` with the router as ``ffn_gate_inp`` (read by :mod:`iterserve.formats.gguf`).
With ``quantization="gguf"`` GGUF's quantized experts stay in their blocks (``ExpertBlocks``), one weight per
expert multiplied as stored by the kernel of every other GGUF layer, so a quantized MoE file holds about its
own size in memory.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from iterserve.attention import AttentionBackend
from iterserve.config import ModelConfig
from iterserve.formats.gguf.tensors import ExpertBlocks
from iterserve.models.cpu_linear import AMX_MIN_ROWS
from iterserve.models.linear import LinearBase
from iterserve.platforms import huge_pages
from iterserve.platforms.ops import CpuOps
from iterserve.quantization import gguf_weight
from iterserve.quantization.gguf_weight import GGUFWeight


class Router(LinearBase):
    """The ``gate`` linear layer: ``[experts, hidden]``, kept in float (it is small, and quantizing it would
    change which experts run); its method is chosen as every float layer's (packed on a CPU in bf16, so that a
    row's routing does not depend on its batch)."""

    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__(hidden, experts, bias=False)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's expert logits in float32 (a kernel that sums in float32 returns its sums unrounded)."""
        return self.method.logits(self, x)


class Experts(nn.Module):
    """Every expert's weights as one 3-D tensor per projection, ``[experts, out, in]``, or a projection's
    experts each in GGUF blocks (``gate_up_blocks``, ``down_blocks``; its 3-D tensor is then empty), or on a
    CPU with the C++ kernels each float expert packed for them (``gate_up_packed``, ``down_packed``: see
    :meth:`pack`)."""

    def __init__(self, experts: int, hidden: int, width: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * width, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, width))
        self.gate_up_blocks: list[GGUFWeight] = []
        self.down_blocks: list[GGUFWeight] = []
        self.gate_up_packed: list[torch.Tensor] = []
        self.down_packed: list[torch.Tensor] = []
        self._ops: CpuOps | None = None
        self._loading: dict[tuple[str, int | None], list[GGUFWeight]] = {}

    @property
    def qweights(self) -> list[GGUFWeight]:
        """The weights kept in blocks (what the engine counts per format)."""
        return self.gate_up_blocks + self.down_blocks

    def gate_up(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_blocks:
            return gguf_weight.linear(x, self.gate_up_blocks[expert])
        if self._ops is not None and self.gate_up_packed:
            return self._ops.packed_linear(x, self.gate_up_packed[expert], self.gate_up_proj.shape[1], None,
                                           AMX_MIN_ROWS)
        return F.linear(x, self.gate_up_proj[expert])

    def down(self, expert: int, h: torch.Tensor) -> torch.Tensor:
        if self.down_blocks:
            return gguf_weight.linear(h, self.down_blocks[expert])
        if self._ops is not None and self.down_packed:
            return self._ops.packed_linear(h, self.down_packed[expert], self.down_proj.shape[1], None, AMX_MIN_ROWS)
        return F.linear(h, self.down_proj[expert])

    @property
    def packed_parts(self) -> list[tuple[torch.Tensor, int]]:
        """Each packed expert projection and its parameter count (the packing pads its columns; the released 3-D
        tensor keeps the shape)."""
        return ([(t, self.gate_up_proj[0].numel()) for t in self.gate_up_packed]
                + [(t, self.down_proj[0].numel()) for t in self.down_packed])

    @property
    def nbytes(self) -> int:
        """The bytes every expert's weights hold, in whatever form."""
        return (sum(w.nbytes for w in self.qweights) + sum(t.nbytes for t, _ in self.packed_parts)
                + sum(p.nbytes for p in (self.gate_up_proj, self.down_proj) if not p.is_meta))

    def pack(self, ops: CpuOps) -> None:
        """Each float expert re-laid out for the CPU kernel of the dense layers (``cpu_linear.PackedLinear``), its
        3-D tensor released: the kernel streams an expert's weight once for the few rows routed to it, adds in one
        order whatever their number (bf16 tokens then do not depend on batching), and widens bf16 where the CPU
        has no bf16 arithmetic, which ``F.linear`` emulates several times slower."""
        self._ops = ops
        if not self.gate_up_blocks and not self.gate_up_proj.is_meta:
            self.gate_up_packed = [huge_pages.copy(ops.pack_linear_weight(w)) for w in self.gate_up_proj.detach()]
            self.gate_up_proj = _on_meta(self.gate_up_proj)
        if not self.down_blocks and not self.down_proj.is_meta:
            self.down_packed = [huge_pages.copy(ops.pack_linear_weight(w)) for w in self.down_proj.detach()]
            self.down_proj = _on_meta(self.down_proj)

    def keep_blocks(self, param: str, part: int | None, weights: list[GGUFWeight]) -> None:
        """Hold every expert's ``param`` (``part`` 0 / 1: its gate / up rows) in blocks until :meth:`finish_blocks`."""
        dest: torch.Tensor = getattr(self, param)
        shape = (dest.shape[1] // (1 if part is None else 2), dest.shape[2])
        if len(weights) != dest.shape[0] or any(w.shape != shape for w in weights):
            raise ValueError(f"has {len(weights)} experts of shape {weights[0].shape if weights else ()}, expected "
                             f"{dest.shape[0]} of {shape}")
        self._loading[(param, part)] = weights

    def finish_blocks(self) -> None:
        """Each expert's gate and up blocks fused and tiled for the kernel; a projection held in blocks drops its
        float tensor (its memory is what keeping the blocks saves)."""
        loading, self._loading = self._loading, {}
        gate, up = loading.pop(("gate_up_proj", 0), None), loading.pop(("gate_up_proj", 1), None)
        if (gate is None) != (up is None) or loading.keys() - {("down_proj", None)}:
            raise ValueError("an expert layer's gate and up weights load both in blocks or both as float")
        device = self.down_proj.device
        if gate is not None and up is not None:
            self.gate_up_blocks = [GGUFWeight.cat([g, u]).tiled().to(device) for g, u in zip(gate, up)]
            self.gate_up_proj = _released(self.gate_up_proj)
        if (down := loading.get(("down_proj", None))) is not None:
            self.down_blocks = [w.tiled().to(device) for w in down]
            self.down_proj = _released(self.down_proj)


def _released(p: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(torch.empty(0, dtype=p.dtype, device=p.device), requires_grad=False)


def _on_meta(p: nn.Parameter) -> nn.Parameter:
    """A weight whose memory a packed copy now holds: its shape and dtype stay (as a released linear weight's)."""
    return nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False)


def route(logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``top_k`` experts ``[rows, top_k]`` (most probable first) and their float32 weights, from the
    router's logits."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


Matmul = Callable[[int, torch.Tensor], torch.Tensor]  # (expert, rows) -> the rows times that expert's weight


def mix_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, num_experts: int, gate_up: Matmul,
                down: Matmul, backend: AttentionBackend) -> torch.Tensor:
    """``sum_k weights[:, k] * expert_{experts[:, k]}(x)``, one gathered matmul pair per expert hit.

    Experts run in increasing id, so each row's sum is in the same order whatever else is in the batch.
    """
    top_k = experts.shape[1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (row, rank) pairs grouped by expert, rows ascending in each
    rows = order // top_k
    row_weights = weights.reshape(-1)[order].to(x.dtype)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        picked = rows[start:start + count]
        h = backend.ops.silu_and_mul(gate_up(expert, x[picked]))
        out.index_add_(0, picked, down(expert, h) * row_weights[start:start + count, None])
        start += count
    return out


class SparseMoeBlock(nn.Module):
    """A MoE layer's MLP: the router ``gate`` and the ``experts``; takes and returns ``[tokens, hidden]``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.num_experts = config.num_experts_per_tok, config.num_experts
        self.renormalise = config.norm_topk_prob
        self.gate = Router(config.hidden_size, config.num_experts)
        self.experts = Experts(config.num_experts, config.hidden_size, config.expert_intermediate_size)

    def forward(self, x: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        weights, experts = route(self.gate.logits(x), self.top_k, self.renormalise)
        return mix_experts(x, weights, experts, self.num_experts, self.experts.gate_up, self.experts.down, backend)


# -- loading ------------------------------------------------------------------------------------------

# One expert's 2-D weight: Qwen3-MoE's names and Mixtral's w1 (gate), w3 (up), w2 (down).
_PER_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
# Every expert's weight in one 3-D tensor: transformers 5's fused names, and GGUF's (named so by formats.gguf).
_ALL_EXPERTS = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|gate_proj|up_proj|down_proj)(?:\.weight)?$")
# (parameter, part): part 0 / 1 are the gate / up rows of gate_up_proj, None the whole of down_proj.
_TARGET: dict[str, tuple[str, int | None]] = {
    "gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "w3": ("gate_up_proj", 1), "down_proj": ("down_proj", None), "w2": ("down_proj", None),
    "gate_up_proj": ("gate_up_proj", None),
}

class ExpertLoader:
    """Copies expert tensors, in any of the namings above, into a model's 3-D expert weights.

    :meth:`take` passes every other tensor on (Mixtral's ``block_sparse_moe`` renamed ``mlp``) and, once the
    checkpoint is read, raises a ValueError naming any expert weight it lacked.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.names: set[str] = set()
        self._needed: dict[str, set[tuple[int, int | None]]] = {}
        for name, module in model.named_modules():
            if isinstance(module, Experts):
                n = module.gate_up_proj.shape[0]
                self.names.update((f"{name}.gate_up_proj", f"{name}.down_proj"))
                self._needed[f"{name}.gate_up_proj"] = {(e, p) for e in range(n) for p in (0, 1)}
                self._needed[f"{name}.down_proj"] = {(e, None) for e in range(n)}

    def take(self, tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        for hf_name, tensor in tensors:
            name = hf_name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
            one, every = _PER_EXPERT.match(name), _ALL_EXPERTS.match(name)
            if one is None and every is None:
                yield name, _dense(tensor) if name.endswith(".mlp.gate.weight") else tensor
                continue
            try:
                if one is not None:
                    param, part = _TARGET[one.group(3)]
                    self._copy(f"layers.{one.group(1)}.mlp.experts.{param}", int(one.group(2)), part, tensor)
                elif every is not None:
                    param, part = _TARGET[every.group(2)]
                    self._copy(f"layers.{every.group(1)}.mlp.experts.{param}", None, part, tensor)
            except ValueError as e:
                raise ValueError(f"weight {hf_name!r}: {e}") from None
        for module in self.model.modules():
            if isinstance(module, Experts):
                module.finish_blocks()
        missing = [f"{name.rpartition('.')[0]}.{e}.{'down_proj' if p is None else ('gate_proj', 'up_proj')[p]}"
                   for name, left in self._needed.items() for e, p in sorted(left, key=lambda ep: (ep[0], ep[1] or 0))]
        if missing:
            raise ValueError(f"checkpoint is missing expert weights: {', '.join(missing[:8])}"
                             f"{' ...' if len(missing) > 8 else ''}")

    def _copy(self, name: str, expert: int | None, part: int | None, tensor: Any) -> None:
        """Copy into ``name``'s expert ``expert`` (every expert when None), rows of part ``part`` (all when None)."""
        if name not in self._needed:
            raise ValueError(f"{name} is not an expert weight of this model (is the layer dense?)")
        dest: torch.Tensor = self.model.get_parameter(name)
        experts = range(dest.shape[0]) if expert is None else [expert]
        if expert is not None and not 0 <= expert < dest.shape[0]:
            raise ValueError(f"expert {expert} is out of range: the model has {dest.shape[0]} experts")
        if isinstance(tensor, ExpertBlocks):  # GGUF's 3-D experts, every expert at once
            module, _, param = name.rpartition(".")
            typing.cast(Experts, self.model.get_submodule(module)).keep_blocks(param, part, tensor.weights)
        else:
            view = dest if expert is None else dest[expert]
            if part is not None:
                width = dest.shape[1] // 2
                view = view[..., part * width:(part + 1) * width, :]
            src = _dense(tensor)
            if tuple(src.shape) != tuple(view.shape):
                raise ValueError(f"has shape {tuple(src.shape)}, expected {tuple(view.shape)}")
            with torch.no_grad():
                view.copy_(src)
        for e in experts:
            for p in ((0, 1) if part is None and name.endswith("gate_up_proj") else (part,)):
                self._needed[name].discard((e, p))


def _dense(tensor: Any) -> torch.Tensor:
    """A float tensor from a float one or a GGUF block weight (a router or experts kept in blocks)."""
    if isinstance(tensor, torch.Tensor):
        return tensor
    dense: Callable[[], torch.Tensor] | None = getattr(tensor, "dequantize", None)
    if dense is None:
        raise ValueError(f"expert and router weights load as float, not as {type(tensor).__name__}")
    return dense()

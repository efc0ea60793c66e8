"""Bytes a model's weights take in each storage format: the one count the planner and the simulator share.

A :class:`MatrixFormat` stores an ``[n, k]`` matrix (``n`` outputs of ``k`` inputs) as a fixed number of
bytes per weight plus, in every row, ``scale_bytes`` of scales per group of ``group`` inputs (one group per
row when ``group`` is None: per-channel scales). A :class:`Quantization` says which format each weight of a
model is in, by the tensor's GGUF role (``attn_q``, ``ffn_down``, ``output``, ``token_embd``, ...); a role it
does not name stays in the plan's dtype, as do norms and biases.

The named formats (``--quantization``) quantize every matmul weight (the decoder's linear layers and the LM
head) and leave an untied token embedding in the dtype; ``gguf`` takes each tensor's type from the file, as
``iterserve serve --quantization gguf`` loads it (quantized types in their blocks, float types in the dtype).
Pure arithmetic: the GGUF's tensor list is read by the caller (:func:`iterserve.planner.quantization_for`).

A mixture-of-experts layer holds ``E`` experts (roles ``ffn_gate_exps``, ``ffn_up_exps``, ``ffn_down_exps``) and a
router (``ffn_gate_inp``, kept in the dtype), but a token runs only ``k`` experts: a step of ``B`` tokens reads
the router and the experts its tokens picked, :func:`expert_share` of them (the named formats cover experts too;
``gguf`` loads them in the dtype, as iterserve does today).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING

from iterserve.config.dtypes import dtype_bytes
from iterserve.formats.gguf.types import REPACKED_TYPES, STORED_TYPES

if TYPE_CHECKING:
    from iterserve.config import ModelConfig

LAYER_ROLES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
EXPERT_ROLES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
MATMUL_ROLES = (*LAYER_ROLES, *EXPERT_ROLES, "output")


@dataclass(frozen=True)
class MatrixFormat:
    """One storage format: ``bytes_per_weight`` (None: the plan's dtype) and the scales beside them."""

    name: str
    bytes_per_weight: Fraction | None
    group: int | None = None  # inputs per group of scales; None: one group per row
    scale_bytes: int = 0  # bytes of scales per group and row
    description: str = ""

    def matrix_bytes(self, n: int, k: int, dtype: str) -> Fraction:
        per_weight = Fraction(dtype_bytes(dtype)) if self.bytes_per_weight is None else self.bytes_per_weight
        groups = 0 if not self.scale_bytes else 1 if self.group is None else -(-k // self.group)
        return n * k * per_weight + n * groups * self.scale_bytes


FLOAT = MatrixFormat("float", None, description="the plan's --dtype")
FORMATS: dict[str, MatrixFormat] = {
    "q8_0": MatrixFormat("Q8_0", Fraction(1), 32, 2, "GGUF Q8_0: blocks of 32 int8 and a float16 scale, 34 B / 32"),
    "q4_0": MatrixFormat("Q4_0", Fraction(1, 2), 32, 2, "GGUF Q4_0: blocks of 32 nibbles and a float16 scale, "
                         "18 B / 32"),
    "q4_1": MatrixFormat("Q4_1", Fraction(1, 2), 32, 4, "GGUF Q4_1: blocks of 32 nibbles, a float16 scale and "
                         "minimum, 20 B / 32"),
    "int8": MatrixFormat("int8", Fraction(1), None, 2, "weight-only int8: 1 B a weight and a float16 scale per "
                         "output channel"),
    "int4": MatrixFormat("int4", Fraction(1, 2), 128, 2, "weight-only int4 (GPTQ/AWQ-like): 0.5 B a weight and a "
                         "float16 scale per group of 128 inputs"),
    "fp8": MatrixFormat("fp8", Fraction(1), description="fp8 (e4m3) weights: 1 B a weight (one scale per tensor)"),
}
# Every GGUF type quantization="gguf" keeps in blocks, at its stored bytes (the scales inside the block's bytes).
GGUF_TYPES = {name: FORMATS[name.lower()] if name in REPACKED_TYPES else
              MatrixFormat(name, Fraction(nbytes, block), description=f"GGUF {name}: {nbytes} B / {block}")
              for name, (block, nbytes) in STORED_TYPES.items()}
QUANTIZATION_CHOICES = ("none", "gguf", *FORMATS)

Mix = tuple[tuple[MatrixFormat, Fraction], ...]  # formats and the share of a role's weights in each


@dataclass(frozen=True)
class Quantization:
    """Which format each weight role is in; ``label`` is what a plan shows."""

    name: str
    label: str
    roles: Mapping[str, Mix] = field(default_factory=dict)

    def role_bytes(self, role: str, n: int, k: int, dtype: str) -> Fraction:
        mix = self.roles.get(role, ((FLOAT, Fraction(1)),))
        return sum((share * fmt.matrix_bytes(n, k, dtype) for fmt, share in mix), Fraction(0))


NONE = Quantization("none", "none")


def uniform(name: str) -> Quantization:
    """Every matmul weight in one of :data:`FORMATS`."""
    key = name.lower()
    if key not in FORMATS:
        raise ValueError(f"unknown quantization {name!r}; choose one of: {', '.join(QUANTIZATION_CHOICES)}")
    fmt = FORMATS[key]
    return Quantization(key, f"{fmt.name} ({fmt.description})", {role: ((fmt, Fraction(1)),) for role in MATMUL_ROLES})


GGUF_APPROXIMATION = Quantization(
    "gguf", "gguf, approximated (not a GGUF file): Q4_1 layers, Q8_0 LM head and embedding",
    {**{role: ((FORMATS["q4_1"], Fraction(1)),) for role in LAYER_ROLES},
     "output": ((FORMATS["q8_0"], Fraction(1)),), "token_embd": ((FORMATS["q8_0"], Fraction(1)),)},
)

_ROLE = re.compile(r"^(?:blk\.\d+\.)?([a-z_]+)\.weight$")


def gguf_quantization(tensors: Iterable[tuple[str, str, int]]) -> Quantization:
    """A GGUF file's mix from its tensors (``(name, type name, elements)``): per role, the share of its weights
    in each type ``quantization=gguf`` keeps in blocks; other types load in the dtype."""
    weights: dict[str, Counter[str]] = {}
    for name, kind, elements in tensors:
        m = _ROLE.match(name)
        if m and m.group(1) in (*MATMUL_ROLES, "token_embd"):
            weights.setdefault(m.group(1), Counter())[kind if kind in GGUF_TYPES else "float"] += elements
    roles: dict[str, Mix] = {}
    for role, kinds in weights.items():
        total = sum(kinds.values())
        roles[role] = tuple((GGUF_TYPES.get(kind, FLOAT), Fraction(n, total)) for kind, n in sorted(kinds.items()))
    mix = Counter[str]()
    for kinds in weights.values():
        mix.update(kinds)
    whole = sum(mix.values()) or 1
    parts = ", ".join(f"{kind} {100 * n / whole:.1f}%" for kind, n in mix.most_common())
    return Quantization("gguf", f"gguf, from the file: {parts} of the matrices' weights", roles)


def expert_share(num_experts: int, top_k: int, tokens: int | None) -> float:
    """The expected share of a MoE layer's experts that ``tokens`` tokens run, ``1 - (1 - k/E)^B``: each
    expert is missed by a token with probability ``1 - k/E``. An approximation: it takes routing as uniform and
    independent across tokens (real routers are skewed, so fewer distinct experts); None: every expert."""
    if tokens is None or not num_experts:
        return 1.0
    return 1.0 - (1.0 - top_k / num_experts) ** tokens


def _matrices(cfg: ModelConfig) -> list[tuple[str, int, int, int]]:
    """Every matmul weight of the decoder layers: ``(role, n, k, how many)``, experts counted once each."""
    h, i, e = cfg.hidden_size, cfg.intermediate_size, cfg.expert_intermediate_size
    moe = sum(cfg.is_moe_layer(n) for n in range(cfg.num_layers))
    dense, experts = cfg.num_layers - moe, moe * cfg.num_experts
    return [("attn_q", cfg.q_size, h, cfg.num_layers), ("attn_k", cfg.kv_size, h, cfg.num_layers),
            ("attn_v", cfg.kv_size, h, cfg.num_layers), ("attn_output", h, cfg.q_size, cfg.num_layers),
            ("ffn_gate", i, h, dense), ("ffn_up", i, h, dense), ("ffn_down", h, i, dense),
            ("ffn_gate_inp", cfg.num_experts, h, moe), ("ffn_gate_exps", e, h, experts),
            ("ffn_up_exps", e, h, experts), ("ffn_down_exps", h, e, experts)]


def _head_role(q: Quantization, cfg: ModelConfig) -> str:
    """A tied LM head is the token embedding: a GGUF names it ``token_embd`` (it has no ``output``)."""
    return "token_embd" if cfg.tie_word_embeddings and "output" not in q.roles else "output"


def streamed_bytes(cfg: ModelConfig, dtype: str, q: Quantization = NONE, tokens: int | None = None) -> int:
    """Bytes of the matmul weights a forward step of ``tokens`` tokens reads: the layers' linear layers and the
    LM head, and of a MoE layer's experts the :func:`expert_share` those tokens run (None: all of them)."""
    dense = sum((count * q.role_bytes(role, n, k, dtype) for role, n, k, count in _matrices(cfg)
                 if role not in EXPERT_ROLES), Fraction(0))
    experts = sum((count * q.role_bytes(role, n, k, dtype) for role, n, k, count in _matrices(cfg)
                   if role in EXPERT_ROLES), Fraction(0))
    head = q.role_bytes(_head_role(q, cfg), cfg.vocab_size, cfg.hidden_size, dtype)
    share = Fraction(expert_share(cfg.num_experts, cfg.num_experts_per_tok, tokens))
    return int(-(-(dense + head + experts * share) // 1))


def total_bytes(cfg: ModelConfig, dtype: str, q: Quantization = NONE) -> int:
    """Memory every weight takes: the matmul weights, an untied embedding, and the norms and biases in the dtype."""
    h, v = cfg.hidden_size, cfg.vocab_size
    matmul = sum(count * n * k for _, n, k, count in _matrices(cfg)) + v * h
    embedding = 0 if cfg.tie_word_embeddings else v * h
    rest = (cfg.num_parameters() - matmul - embedding) * dtype_bytes(dtype)
    embed_bytes = q.role_bytes("token_embd", v, h, dtype) if embedding else Fraction(0)
    return streamed_bytes(cfg, dtype, q) + int(-(-embed_bytes // 1)) + rest


def as_quantization(q: Quantization | str | None) -> Quantization:
    """A :class:`Quantization` from a flag's value; ``gguf`` without its file is :data:`GGUF_APPROXIMATION`
    (:func:`iterserve.planner.quantization_for` reads the file's mix)."""
    if isinstance(q, Quantization):
        return q
    if q is None or q.lower() in ("", "none"):
        return NONE
    return GGUF_APPROXIMATION if q.lower() == "gguf" else uniform(q)

"""llama.cpp's LoRA adapters: a GGUF file as ``convert_lora_to_gguf.py`` writes it (``general.type`` "adapter",
``adapter.type`` "lora", ``adapter.lora.alpha``), with ``blk.N.<tensor>.weight.lora_a`` ``[rank, in]`` and
``.lora_b`` ``[out, rank]`` for the base model's tensors (``attn_q``, ``ffn_up``, ...).

Read here into a PEFT adapter's names and numbers, so the rest of :mod:`iterserve.lora.adapter` serves both
formats alike. As for the base model's own weights, llama.cpp interleaves the rotary halves of a llama's Q and K
output rows, which here means the rows of ``lora_b``: they are put back as the model's loader puts back Q and K.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from iterserve.config import ModelConfig
from iterserve.formats.gguf.reader import gguf_field, interleaves_rope, open_gguf
from iterserve.formats.gguf.tensors import dequantized, gguf_to_hf_name, unpermute_rope
from iterserve.lora.request import LoRARequest


def is_gguf_adapter(lora: LoRARequest) -> bool:
    return Path(lora.lora_path).suffix.lower() == ".gguf"


def read_gguf_adapter(lora: LoRARequest, config: ModelConfig) -> tuple[int, float, dict[str, torch.Tensor]]:
    """The adapter's rank, scaling (``alpha / rank``, as llama.cpp applies it) and tensors under PEFT's names
    (``layers.N.self_attn.q_proj.lora_A.weight``); raises ValueError naming what is wrong with the file."""
    path = Path(lora.lora_path)
    if not path.is_file():
        raise ValueError("the adapter file does not exist")
    reader = open_gguf(path)
    kind = (gguf_field(reader, "general.type"), gguf_field(reader, "adapter.type"))
    if kind != ("adapter", "lora"):
        raise ValueError(f"the GGUF file is not a LoRA adapter (general.type {kind[0]!r}, adapter.type {kind[1]!r})")
    permute = interleaves_rope(reader)
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        base, _, side = t.name.rpartition(".")
        if side not in ("lora_a", "lora_b"):
            raise ValueError(f"tensor {t.name!r} is neither a lora_a nor a lora_b")
        try:
            name, heads = gguf_to_hf_name(base, config, permute)
        except ValueError as e:
            raise ValueError(f"tensor {t.name!r}: {e}") from None
        w = np.asarray(dequantized(t), dtype=np.float32)  # a ValueError that names the tensor
        if side == "lora_b" and heads is not None:
            w = unpermute_rope(w, heads)
        module = name.removesuffix(".weight")
        tensors[f"{module}.lora_{side[-1].upper()}.weight"] = torch.from_numpy(np.array(w))
    ranks = {w.shape[0] for name, w in tensors.items() if name.endswith("lora_A.weight")}
    if len(ranks) != 1:
        raise ValueError(f"the adapter's tensors have ranks {sorted(ranks)}; one rank is served" if ranks
                         else "the GGUF file holds no lora_a tensors")
    rank = ranks.pop()
    alpha = float(gguf_field(reader, "adapter.lora.alpha", rank) or rank)
    return rank, alpha / rank, tensors

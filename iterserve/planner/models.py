"""Which model a plan is for: a preset name (or a common spelling of one), a config.json, a folder, a GGUF."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from iterserve.config import PRESETS, ModelConfig, get_preset

_NAME_SUFFIXES = ("-hf", "-instruct", "-chat", "-base", "-it", "-v0.1")


def _norm_model_name(name: str) -> str:
    key = name.strip().lower().rsplit("/", 1)[-1].replace("_", "-").replace(" ", "-")
    changed = True
    while changed:
        changed = False
        for suffix in _NAME_SUFFIXES:
            if key.endswith(suffix):
                key, changed = key[: -len(suffix)], True
    key = key.removeprefix("meta-")
    return re.sub(r"[^a-z0-9.]", "", key)


def find_preset(name: str) -> str | None:
    """The preset key for a preset name or a common spelling of it, or None.

    ``"Llama-2-7B"``, ``"meta-llama/Llama-2-7b-hf"``, ``"llama2-7b"`` and
    ``"Meta-Llama-3-8B-Instruct"`` all resolve; matching ignores case, an ``org/`` prefix, a
    ``meta-`` prefix, ``-hf``/``-instruct``/``-chat`` suffixes and punctuation.
    """
    if name.lower() in PRESETS:
        return name.lower()
    target = _norm_model_name(name)
    for key, cfg in PRESETS.items():
        if target in (_norm_model_name(key), _norm_model_name(cfg.name)):
            return key
    return None


def config_from_gguf(path: str | os.PathLike[str]) -> ModelConfig:
    """Model shapes from a GGUF file's metadata (no tensor data is read)."""
    from iterserve.models.gguf_file import open_gguf
    from iterserve.models.loader import gguf_config

    return gguf_config(open_gguf(path), name=Path(path).stem)


def _config_from_json(path: Path) -> ModelConfig:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read model config {str(path)!r}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"model config {str(path)!r} is not a JSON object")
    try:
        return ModelConfig.from_hf_config(data, name=data.get("_name_or_path") or path.parent.name)
    except KeyError as e:
        raise ValueError(f"model config {str(path)!r} lacks the field {e.args[0]!r}") from None


def load_model_config(model: str | os.PathLike[str] | ModelConfig) -> ModelConfig:
    """A ModelConfig from a preset name (or common spelling), a config.json, a folder, a GGUF."""
    if isinstance(model, ModelConfig):
        return model
    spec = str(model)
    path = Path(spec).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return _config_from_json(path / "config.json")
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return config_from_gguf(ggufs[0])
        raise ValueError(f"folder {spec!r} holds no config.json (nor a single .gguf file)")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return config_from_gguf(path)
        return _config_from_json(path)
    key = find_preset(spec)
    if key is None:
        raise ValueError(
            f"unknown model {spec!r}: not a preset ({', '.join(PRESETS)}) "
            "nor an existing config.json, model folder or .gguf file"
        )
    cfg = get_preset(key)
    return cfg.replace(name=cfg.name or key)

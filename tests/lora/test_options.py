"""The LoRA engine options: checked when the config is built, and the command line's flags under vLLM's names."""

from __future__ import annotations

import argparse

import pytest

from iterserve.cli.flags import add_config_args, config_from_args
from iterserve.config import EngineConfig, ServerConfig


def test_options_are_checked():
    with pytest.raises(ValueError, match="tensor_parallel_size=1 only"):
        EngineConfig(enable_lora=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="max_loras must be an integer >= 1"):
        EngineConfig(max_loras=0)
    with pytest.raises(ValueError, match="max_lora_rank must be an integer >= 1"):
        EngineConfig(max_lora_rank=0)
    assert EngineConfig(enable_lora=True, max_loras=3).scheduler_config(None).max_loras == 3
    assert EngineConfig(max_loras=3).scheduler_config(None).max_loras is None  # LoRA off: no limit to keep


def test_vllm_flags():
    parser = argparse.ArgumentParser()
    add_config_args(parser, EngineConfig)
    add_config_args(parser, ServerConfig)
    args = parser.parse_args(["--enable-lora", "--max-loras", "3", "--max-lora-rank", "64",
                              "--lora-modules", "a=/x", "b=/y"])
    engine = config_from_args(EngineConfig, args)
    assert (engine.enable_lora, engine.max_loras, engine.max_lora_rank) == (True, 3, 64)
    assert config_from_args(ServerConfig, args).lora_paths() == {"a": "/x", "b": "/y"}
    with pytest.raises(ValueError, match="given twice"):
        ServerConfig(lora_modules=("a=/x", "a=/y"))

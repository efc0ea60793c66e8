"""The weights are counted on stderr while a model loads, where stderr is a terminal and the flag allows it."""

from __future__ import annotations

import io
import sys

import gguf
import pytest

from iterserve.cli.flags import config_from_args
from iterserve.cli.main import build_parser
from iterserve.config import EngineConfig
from iterserve.models.checkpoint import tensor_progress
from iterserve.models.linear import dense_chooser
from iterserve.models.loader import load_model
from iterserve.models.sources import embedded_model_path


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def use_terminal(monkeypatch) -> Terminal:
    """stderr as a terminal, set in the test itself (pytest sets its own capture back between fixture and test)."""
    stream = Terminal()
    monkeypatch.setattr(sys, "stderr", stream)
    return stream


def test_a_terminal_sees_every_tensor_counted(monkeypatch):
    terminal = use_terminal(monkeypatch)
    assert list(tensor_progress(iter("abc"), 3, enabled=True)) == ["a", "b", "c"]
    assert "Loading weights" in terminal.getvalue() and "3/3" in terminal.getvalue()


def test_no_bar_off_a_terminal_or_when_disabled(monkeypatch):
    terminal = use_terminal(monkeypatch)
    items = ["a", "b"]
    assert tensor_progress(items, 2, enabled=False) is items
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert tensor_progress(items, 2, enabled=True) is items
    assert terminal.getvalue() == ""


def test_loading_the_embedded_model_counts_its_tensors(monkeypatch):
    terminal = use_terminal(monkeypatch)
    total = len(gguf.GGUFReader(embedded_model_path()).tensors)
    load_model(dtype="float32", device="cpu", progress=True, linear=dense_chooser)  # no per-shape timing
    assert f"{total}/{total}" in terminal.getvalue()


@pytest.mark.parametrize("command", [["serve"], ["generate", "hello"]])
def test_the_flag_turns_it_off(command):
    parser = build_parser()
    assert config_from_args(EngineConfig, parser.parse_args(command)).load_progress is True
    assert config_from_args(EngineConfig, parser.parse_args([*command, "--no-load-progress"])).load_progress is False

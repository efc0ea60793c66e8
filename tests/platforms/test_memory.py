"""Host memory comes from psutil, which knows every OS, not from a Linux-only file."""

from __future__ import annotations

from types import SimpleNamespace

import psutil

from iterserve.platforms import memory


def test_memory_is_what_the_os_reports(monkeypatch):
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=16 * 2**30, available=5 * 2**30))
    assert memory.physical_memory_bytes() == 16 * 2**30
    assert memory.available_memory_bytes() == 5 * 2**30


def test_available_is_within_installed():
    assert 0 < memory.available_memory_bytes() <= memory.physical_memory_bytes()

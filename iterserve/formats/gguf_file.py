"""The one place a GGUF file is opened: the loader, the tokenizer and the planner all read through here."""

from __future__ import annotations

import os
from typing import Any

import gguf


def open_gguf(path: str | os.PathLike[str]) -> gguf.GGUFReader:
    """A memory-mapped reader (tensor data stays unread until used).

    A missing file raises :class:`OSError` as usual; gguf's assorted parse errors on a damaged file
    (ValueError, numpy reshape or struct errors) become one ValueError that names the file.
    """
    try:
        return gguf.GGUFReader(path)
    except OSError:
        raise
    except Exception as exc:
        raise ValueError(f"cannot read GGUF file {os.fspath(path)!r}: it is corrupt or truncated ({exc})") from None


def gguf_field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """The value of one metadata key, or ``default`` when the file lacks it."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()

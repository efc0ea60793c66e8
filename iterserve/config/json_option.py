"""vLLM's options that take a JSON object (``--speculative-config``, ``--kv-events-config``), read one way."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any


def json_object(value: Mapping[str, Any] | str, option: str, known: Iterable[str]) -> Mapping[str, Any] | None:
    """``value`` as a dictionary: given as one, or as its JSON text (the command line's); None for JSON null.
    Raises ValueError naming ``option`` for text that is not JSON, a value that is not an object, or a key
    not in ``known``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{option} is not valid JSON: {e}") from None
        if value is None:
            return None
    if not isinstance(value, Mapping):
        raise ValueError(f"{option} must be a dict (or its JSON), got {type(value).__name__}")
    names = set(known)
    unknown = sorted(set(value) - names)
    if unknown:
        raise ValueError(f"{option}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
    return value

"""Text a request body can carry but nothing downstream can use: lone surrogates, found cheaply."""

from __future__ import annotations

import json
from typing import Any


def first_lone_surrogate(value: Any) -> tuple[str, int] | None:
    """The first string in a validated field value holding a lone surrogate, with its index.

    Costs little even on lists of millions: a validated list holds one type, so a list of numbers
    or models (a token-id prompt, the messages) is not walked, and other lists and dicts are
    checked by encoding them as JSON at C speed; only one that fails is searched.
    """
    if isinstance(value, str):
        return find_lone_surrogate(value)
    if isinstance(value, list) and value and isinstance(value[0], list):
        return next(filter(None, map(first_lone_surrogate, value)), None)
    if not isinstance(value, (list, dict)) or (value and isinstance(value, list) and
                                                not isinstance(value[0], (str, dict))):
        return None
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
        return None
    except (UnicodeEncodeError, TypeError, ValueError):
        return find_lone_surrogate(value)


def find_lone_surrogate(value: Any) -> tuple[str, int] | None:
    """Search strings, lists and dicts (keys too) of any shape for a lone surrogate."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return value, e.start
        return None
    items = [*value, *value.values()] if isinstance(value, dict) else value if isinstance(value, list) else []
    return next(filter(None, map(find_lone_surrogate, items)), None)

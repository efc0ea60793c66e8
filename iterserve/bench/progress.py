"""A spinner on stderr for the silent stretches: loading a model (6-30 s here) and timing decode steps.

The model loader is shared with the server and prints nothing itself, so the commands that load a
model wrap the call; on a terminal the spinner shows what is happening, elsewhere it stays silent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console


@contextmanager
def status(message: str) -> Iterator[Callable[[str], None]]:
    """Show ``message`` with a spinner until the block ends; yields a function that replaces the message."""
    with Console(stderr=True).status(message) as live:
        yield lambda text: live.update(text)


def load_model_with_status(name: str, *args: Any, **kwargs: Any) -> Any:
    """:func:`iterserve.models.loader.load_model` behind a spinner naming the model."""
    from iterserve.models.loader import load_model

    with status(f"loading {name} ..."):
        return load_model(name, *args, **kwargs)

"""The one renderer of tables in command output (bench, plan): rich tables rendered to text.

The first column (labels) is left-aligned and the rest right-aligned; ``None`` shows as ``-`` and
floats get thousands separators. Cells are plain text, never rich markup.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.2f}" if abs(v) < 1e5 else f"{v:,.0f}"
    return str(v)


def render_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """The table as text, as wide as its contents need (never wrapped), under an optional title line."""
    cells = [[_cell(v) for v in row] for row in rows]
    table = Table()
    for i, h in enumerate(headers):
        table.add_column(Text(h), justify="left" if i == 0 else "right")
    for row in cells:
        table.add_row(*(Text(c) for c in row))
    width = max(100, 4 + sum(max(len(c) for c in col) + 3 for col in zip(headers, *cells)))
    buf = io.StringIO()
    console = Console(file=buf, width=width, highlight=False, color_system=None)
    if title:
        console.print(Text(title))
    console.print(table)
    return buf.getvalue().rstrip("\n")

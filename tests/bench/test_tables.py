"""The one table renderer: labels left, numbers right, plain text cells, never wrapped."""

from __future__ import annotations

from iterserve.bench.tables import render_table


def test_numbers_are_right_aligned_and_missing_values_dashed():
    text = render_table(["mode", "tok/s", "note"], [["continuous", 1234.5, None], ["static", 12.0, "[bold]x[/bold]"]],
                        title="runs")
    lines = text.splitlines()
    assert lines[0] == "runs"
    row = next(line for line in lines if "continuous" in line)
    other = next(line for line in lines if "static" in line)
    assert "1,234.50" in row and " -" in row
    assert row.index("1,234.50") + len("1,234.50") == other.index("12.00") + len("12.00")  # right-aligned
    assert "[bold]x[/bold]" in other  # cells are text, not rich markup


def test_wide_tables_are_not_wrapped():
    headers = [f"column number {i}" for i in range(12)]
    text = render_table(headers, [[f"value {i} " * 3 for i in range(12)]])
    assert sum("value 0" in line for line in text.splitlines()) == 1
    assert all(h in text for h in headers)

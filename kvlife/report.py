"""Plain-text tables for the terminal (no dependency; aligned columns)."""

from __future__ import annotations

from collections.abc import Sequence


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns left-aligned for text and right-aligned for numbers."""
    cols = len(headers)
    widths = [len(h) for h in headers]
    for row in rows:
        for i in range(cols):
            widths[i] = max(widths[i], len(row[i]) if i < len(row) else 0)

    def numeric(text: str) -> bool:
        t = text.replace(",", "").replace("%", "").replace("x", "").strip()
        try:
            float(t.split()[0] if t else "x")
        except ValueError:
            return False
        return True

    def line(cells: Sequence[str]) -> str:
        out = []
        for i in range(cols):
            cell = cells[i] if i < len(cells) else ""
            out.append(cell.rjust(widths[i]) if numeric(cell) else cell.ljust(widths[i]))
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])

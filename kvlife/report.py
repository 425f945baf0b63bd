"""A small plain-text table printer for terminal reports (CLI, demo, benchmarks).

Benchmarks print their results for people and write JSON for machines; this renders the
human half as aligned columns without pulling in a formatting dependency. Text columns
are left-aligned, numeric-looking cells right-aligned.
"""

from __future__ import annotations

from collections.abc import Sequence


def _numeric(cell: str) -> bool:
    text = cell.strip().removesuffix("%").removeprefix("≤").removeprefix("≥").strip()
    try:
        float(text)
    except ValueError:
        return False
    return True


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, gap: int = 2) -> str:
    """Render ``rows`` under ``headers`` as aligned columns separated by ``gap`` spaces.

    Every row must have as many cells as there are headers. A column is right-aligned
    when every non-empty cell in it parses as a number (``≥``/``≤`` prefixes and ``%``
    suffixes allowed), else left-aligned.
    """
    ncol = len(headers)
    for i, row in enumerate(rows):
        if len(row) != ncol:
            raise ValueError(f"row {i} has {len(row)} cells for {ncol} headers")
    widths = [len(h) for h in headers]
    for row in rows:
        for j, cell in enumerate(row):
            widths[j] = max(widths[j], len(cell))
    right = [
        all(_numeric(r[j]) for r in rows if r[j].strip() and r[j] != "-") and bool(rows)
        for j in range(ncol)
    ]
    sep = " " * gap

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.rjust(widths[j]) if right[j] else c.ljust(widths[j]) for j, c in enumerate(cells)
        ]
        return sep.join(parts).rstrip()

    rule = sep.join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def format_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit below it: ``"512 B"``, ``"1.5 GiB"``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")

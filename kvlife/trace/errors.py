"""Typed errors of trace reading: each names the file, the line and the field."""

from __future__ import annotations

from pathlib import Path

from kvlife.core.errors import KVLifeError


class TraceError(KVLifeError, ValueError):
    """A trace or event file that cannot be used (missing, unreadable, wrong version)."""


class TraceFormatError(TraceError):
    """A malformed record: the message names the file, the line (1-based) and the field."""

    def __init__(self, path: str | Path, line: int, field: str, detail: str) -> None:
        self.path = str(path)
        self.line = line
        self.field = field
        where = f"{self.path}:{line}"
        what = f"field {field!r}: " if field else ""
        super().__init__(f"{where}: {what}{detail}")

"""Event files: JSON lines and Parquet, read and written with one schema (v1).

:class:`ParquetSink` buffers events and writes them as Parquet row groups (pyarrow), so a
run can be analysed with pandas or DuckDB (``SELECT kind, count(*) FROM 'run.parquet'
GROUP BY kind``). :func:`read_events` reads either format back into
:class:`~kvlife.core.events.LifecycleEvent` records and refuses another schema version.
The JSON-lines writer is :class:`kvlife.core.events.JsonlSink`.
"""

from __future__ import annotations

import json
import threading
from dataclasses import fields
from pathlib import Path
from typing import Any

from kvlife.core.events import EVENT_SCHEMA_VERSION, EventSink, JsonlSink, LifecycleEvent
from kvlife.trace.errors import TraceError, TraceFormatError

FIELDS = [f.name for f in fields(LifecycleEvent)]
_INT = {"seq", "nbytes"}

__all__ = [
    "JsonlSink",
    "ParquetSink",
    "open_event_file",
    "read_events",
    "read_events_jsonl",
    "read_events_parquet",
]


def _arrow_schema() -> Any:
    import pyarrow as pa  # type: ignore[import-untyped]

    cols = [pa.field("v", pa.int16())]
    for name in FIELDS:
        typ = pa.float64() if name == "time" else pa.int64() if name in _INT else pa.string()
        cols.append(pa.field(name, typ))
    return pa.schema(cols, metadata={"kvlife.event_schema": str(EVENT_SCHEMA_VERSION)})


class ParquetSink(EventSink):
    """Writes events to a Parquet file, ``row_group`` events per row group."""

    def __init__(self, path: str | Path, row_group: int = 65536) -> None:
        import pyarrow.parquet as pq  # type: ignore[import-untyped]

        self.path = Path(path)
        self._schema = _arrow_schema()
        self._writer = pq.ParquetWriter(str(self.path), self._schema)
        self._rows: list[LifecycleEvent] = []
        self._row_group = row_group
        self._lock = threading.Lock()
        self._closed = False

    def emit(self, event: LifecycleEvent) -> None:
        with self._lock:
            self._rows.append(event)
            if len(self._rows) >= self._row_group:
                self._write()

    def _write(self) -> None:
        import pyarrow as pa

        if not self._rows:
            return
        rows, self._rows = self._rows, []
        cols: dict[str, list[Any]] = {"v": [EVENT_SCHEMA_VERSION] * len(rows)}
        for name in FIELDS:
            cols[name] = [getattr(e, name) for e in rows]
        self._writer.write_table(pa.Table.from_pydict(cols, schema=self._schema))

    def flush(self) -> None:
        with self._lock:
            if not self._closed:
                self._write()

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._write()
                self._writer.close()
                self._closed = True


def open_event_file(path: str | Path, *, append: bool = False) -> EventSink:
    """A sink writing an event file: ``.parquet`` is Parquet (always written anew: a
    Parquet file cannot be appended to), anything else JSON lines, appended to when
    ``append`` (an engine restarted on the same store continues its log), else
    written anew."""
    p = Path(path)
    if p.name.endswith(".parquet"):
        return ParquetSink(p)
    if not append:
        p.unlink(missing_ok=True)
    return JsonlSink(p)


def _event(d: dict[str, Any], where: str) -> LifecycleEvent:
    v = d.pop("v", None)
    if v != EVENT_SCHEMA_VERSION:
        raise TraceError(f"{where}: event schema version {v!r}, this kvlife reads version 1")
    try:
        return LifecycleEvent(**d)
    except TypeError as e:
        raise TraceError(f"{where}: not a lifecycle event: {e}") from e


def read_events_jsonl(path: str | Path) -> list[LifecycleEvent]:
    p = Path(path)
    out = []
    with p.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceFormatError(p, lineno, "", f"not JSON: {e.msg}") from e
            out.append(_event(d, f"{p}:{lineno}"))
    return out


def read_events_parquet(path: str | Path) -> list[LifecycleEvent]:
    import pyarrow.parquet as pq

    table = pq.read_table(str(path))
    return [_event(d, str(path)) for d in table.to_pylist()]


def read_events(path: str | Path) -> list[LifecycleEvent]:
    """Read an event file; ``.parquet`` is Parquet, anything else JSON lines."""
    if str(path).endswith(".parquet"):
        return read_events_parquet(path)
    return read_events_jsonl(path)

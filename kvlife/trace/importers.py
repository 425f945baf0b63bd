"""Importers of public request traces into :class:`~kvlife.trace.model.Trace`.

- Mooncake (FAST'25 release), JSON lines: ``timestamp`` (ms), ``input_length``,
  ``output_length``, ``hash_ids`` (one prefix-chained id per 512-token block). Ids are kept
  as they are, so replay figures match the trace's own (288,500 touches, 182,790 blocks).
- Azure LLM inference trace (2023), CSV ``TIMESTAMP,ContextTokens,GeneratedTokens``:
  arrivals and lengths, no prefix information; every block gets a fresh id (no reuse).
- Alibaba bailian (Qwen) traces, JSON lines: ``chat_id``, ``parent_chat_id``,
  ``timestamp`` (s), ``input_length``, ``output_length``, ``type``, ``turn``, ``hash_ids``
  (16-token blocks). Ids are re-chained with their parent block, so sharing is by prefix
  even if a release hashes blocks independently; ``type`` becomes the request category.

A malformed record raises :class:`~kvlife.trace.errors.TraceFormatError` naming the file,
the line and the field. Files are read once into arrays; nothing is cached on disk.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from kvlife.trace.errors import TraceError, TraceFormatError
from kvlife.trace.model import Trace, TraceBuilder

FORMATS = ("mooncake", "azure", "bailian")
MOONCAKE_BLOCK_TOKENS = 512
BAILIAN_BLOCK_TOKENS = 16


def _lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    try:
        fh = path.open("r", encoding="utf-8")
    except OSError as e:
        raise TraceError(f"cannot open trace {path}: {e}") from e
    with fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceFormatError(path, lineno, "", f"not JSON: {e.msg}") from e
            if not isinstance(rec, dict):
                raise TraceFormatError(path, lineno, "", "expected a JSON object")
            yield lineno, rec


def _int(path: Path, lineno: int, rec: dict[str, Any], name: str) -> int:
    v = rec.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise TraceFormatError(path, lineno, name, f"must be an integer >= 0, got {v!r}")
    return v


def _number(path: Path, lineno: int, rec: dict[str, Any], name: str) -> float:
    v = rec.get(name)
    if isinstance(v, bool) or not isinstance(v, int | float) or not v >= 0:
        raise TraceFormatError(path, lineno, name, f"must be a number >= 0, got {v!r}")
    return float(v)


def _ids(path: Path, lineno: int, rec: dict[str, Any]) -> list[int]:
    ids = rec.get("hash_ids")
    if not isinstance(ids, list):
        raise TraceFormatError(path, lineno, "hash_ids", f"must be a list, got {ids!r}")
    for h in ids:
        if isinstance(h, bool) or not isinstance(h, int):
            raise TraceFormatError(path, lineno, "hash_ids", f"holds a non-integer {h!r}")
    return ids


def _check_time(path: Path, lineno: int, name: str, t: float, last: float) -> None:
    if t < last:
        raise TraceFormatError(path, lineno, name, f"goes backwards ({t} after {last})")


def read_mooncake(path: str | Path, max_requests: int | None = None) -> Trace:
    """A Mooncake JSON-lines trace (timestamps in ms become seconds)."""
    p = Path(path)
    b = TraceBuilder(p.name, MOONCAKE_BLOCK_TOKENS)
    last = 0.0
    for lineno, rec in _lines(p):
        if max_requests is not None and len(b) >= max_requests:
            break
        ts = _number(p, lineno, rec, "timestamp")
        _check_time(p, lineno, "timestamp", ts, last)
        last = ts
        inp = _int(p, lineno, rec, "input_length")
        out = _int(p, lineno, rec, "output_length")
        b.add(ts / 1000.0, inp, out, _ids(p, lineno, rec), category="chat")
    return b.build()


def read_bailian(path: str | Path, max_requests: int | None = None) -> Trace:
    """An Alibaba bailian JSON-lines trace (16-token blocks, timestamps in seconds)."""
    p = Path(path)
    b = TraceBuilder(p.name, BAILIAN_BLOCK_TOKENS)
    chain: dict[tuple[int, int], int] = {}
    last = 0.0
    for lineno, rec in _lines(p):
        if max_requests is not None and len(b) >= max_requests:
            break
        for name in ("chat_id", "parent_chat_id", "turn"):
            v = rec.get(name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TraceFormatError(p, lineno, name, f"must be an integer, got {v!r}")
        kind = rec.get("type")
        if not isinstance(kind, str) or not kind:
            raise TraceFormatError(p, lineno, "type", f"must be a non-empty string, got {kind!r}")
        ts = _number(p, lineno, rec, "timestamp")
        _check_time(p, lineno, "timestamp", ts, last)
        last = ts
        inp = _int(p, lineno, rec, "input_length")
        out = _int(p, lineno, rec, "output_length")
        parent = -1
        blocks: list[int] = []
        for h in _ids(p, lineno, rec):
            parent = chain.setdefault((parent, h), len(chain))
            blocks.append(parent)
        b.add(ts, inp, out, blocks, category=kind)
    return b.build()


def _azure_time(path: Path, lineno: int, text: str) -> float:
    head, _, frac = text.strip().partition(".")
    try:
        base = datetime.fromisoformat(head)
        return base.timestamp() + (float("0." + frac) if frac else 0.0)
    except ValueError as e:
        raise TraceFormatError(path, lineno, "TIMESTAMP", f"not a timestamp: {text!r}") from e


def read_azure(
    path: str | Path, max_requests: int | None = None, block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> Trace:
    """An Azure LLM inference CSV: arrivals and lengths; blocks are all distinct."""
    p = Path(path)
    b = TraceBuilder(p.name, block_tokens)
    try:
        fh = p.open("r", encoding="utf-8", newline="")
    except OSError as e:
        raise TraceError(f"cannot open trace {p}: {e}") from e
    with fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        want = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
        if header is None or [h.strip() for h in header] != want:
            raise TraceFormatError(p, 1, "", f"header must be {','.join(want)}, got {header}")
        t0: float | None = None
        last = 0.0
        next_block = 0
        for lineno, row in enumerate(reader, start=2):
            if max_requests is not None and len(b) >= max_requests:
                break
            if not row:
                continue
            if len(row) != 3:
                raise TraceFormatError(p, lineno, "", f"expected 3 columns, got {len(row)}")
            t = _azure_time(p, lineno, row[0])
            t0 = t if t0 is None else t0
            rel = t - t0
            _check_time(p, lineno, "TIMESTAMP", rel, last)
            last = rel
            vals = []
            for name, cell in zip(want[1:], row[1:], strict=True):
                try:
                    v = int(cell)
                except ValueError:
                    v = -1
                if v < 0:
                    raise TraceFormatError(p, lineno, name, f"must be an integer >= 0: {cell!r}")
                vals.append(v)
            nblocks = -(-vals[0] // block_tokens)
            b.add(rel, vals[0], vals[1], list(range(next_block, next_block + nblocks)))
            next_block += nblocks
    return b.build(reuse_info=False)


def read_trace(path: str | Path, fmt: str, max_requests: int | None = None) -> Trace:
    """Read a trace file in one of :data:`FORMATS`."""
    if fmt == "mooncake":
        return read_mooncake(path, max_requests)
    if fmt == "bailian":
        return read_bailian(path, max_requests)
    if fmt == "azure":
        return read_azure(path, max_requests)
    raise TraceError(f"unknown trace format {fmt!r}; known: {', '.join(FORMATS)}")

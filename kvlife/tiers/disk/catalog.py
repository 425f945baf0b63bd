"""SQLite catalog of the disk tier: which replica lives where, durable, atomic, self-proving.

One row per committed replica. The database runs in WAL mode with ``synchronous=FULL``,
so a committed transaction survives a process kill and a power cut. The commit order of
the tier is: payload written and fdatasync'ed, then the rows inserted in one
transaction, then the replicas made visible in memory. A row therefore never names bytes
that were not durable when it was written.

Rows prove themselves: each carries ``rowsum``, an xxh3-128 over all its fields (key,
segment, offset, length, payload checksum, dtype, shape, transform, info), and every
field is parsed strictly (:meth:`Catalog.scan`), so a row changed after it was written is
found and quarantined (its ``quarantine`` column says why; it is never served) rather
than trusted. Nothing here deletes a row except :meth:`Catalog.delete` (the store
dropped the replica) and :meth:`Catalog.delete_quarantined` (``check --fix``).

The catalog also carries a *generation*, bumped by every transaction that deletes rows;
after such a commit it is recorded in the tier's
:class:`~kvlife.tiers.disk.superblock.Superblock` before the delete returns, so a
catalog rolled back by a damaged write-ahead log is recognised at open.

Every sqlite3 error becomes a kvlife error naming the file (:class:`CatalogCorrupt` for
damage, :class:`~kvlife.core.errors.StorePathError` for an unwritable or failing file,
:class:`~kvlife.core.errors.StorageFullError` for a full device). One connection serves
every thread; a re-entrant lock keeps it inside one transaction at a time.

Format versions: 4 (this one) adds the ``born`` column: the store's opaque record of
the global invalidation epoch the object's KV was created under, covered by the row
checksum when it is not empty (an empty one checksums exactly as a version-3 row, so
version-3 rows stay valid as they are). A version-3 catalog gets the column (empty:
unknown, every global rule covers the object) on the first writable open. Version 3
added the ``form`` column: the store's opaque record of a replica's representation (its
transform descriptor), covered by the row checksum when it is not empty (an empty form
checksums exactly as a version-2 row, so version-2 rows stay valid as they are). A
version-2 catalog gets the column (empty: every version-2 replica is exact) on the first
writable open. A version-1 catalog (no row checksums, no
generation) is migrated in place too, in one transaction: its rows are parsed strictly
and checksummed as they are (version 1 trusted them the same way, and every frame is
still verified against them), rows that fail parsing are quarantined. A newer version
is refused unchanged (so a reader that predates transforms never serves a transformed
replica as raw bytes).
"""

from __future__ import annotations

import contextlib
import math
import re
import sqlite3
import threading
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import xxhash

from kvlife.core.errors import KVLifeError, StorageFullError, StoreFormatError, StorePathError
from kvlife.tiers.disk.frame import (
    HEADER_BYTES,
    HEADER_USED,
    MAX_NDIM,
    TRANSFORM_BYTES,
    FrameHeader,
    pack_header,
    parts_checksum,
    verify_frame,
)
from kvlife.tiers.disk.superblock import Superblock

CATALOG_VERSION = 4

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS replicas (
    key BLOB PRIMARY KEY,
    seg INTEGER NOT NULL,
    off INTEGER NOT NULL,
    nbytes INTEGER NOT NULL,
    checksum BLOB NOT NULL,
    dtype TEXT NOT NULL,
    shape TEXT NOT NULL,
    transform TEXT NOT NULL,
    info BLOB NOT NULL,
    rowsum BLOB,
    quarantine TEXT,
    form BLOB NOT NULL DEFAULT x'',
    born BLOB NOT NULL DEFAULT x''
);
CREATE INDEX IF NOT EXISTS replicas_seg ON replicas (seg);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS edges (child BLOB PRIMARY KEY, parent BLOB NOT NULL, sum BLOB NOT NULL);
"""
_EDGES_TABLE = (
    "CREATE TABLE IF NOT EXISTS edges "
    "(child BLOB PRIMARY KEY, parent BLOB NOT NULL, sum BLOB NOT NULL)"
)
_EDGE_TAG = b"kvlife-catalog-edge-v1"
_COLUMNS = "key, seg, off, nbytes, checksum, dtype, shape, transform, info, form, born"
_FORM_COLUMN = "ALTER TABLE replicas ADD COLUMN form BLOB NOT NULL DEFAULT x''"
_BORN_COLUMN = "ALTER TABLE replicas ADD COLUMN born BLOB NOT NULL DEFAULT x''"

_SHAPE_RE = re.compile(r"^(0|[1-9][0-9]{0,18})(,(0|[1-9][0-9]{0,18}))*$")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.:+-]+$")
_GEN_RE = re.compile(r"^(0|[1-9][0-9]{0,18}):([0-9a-f]{16})$")
_ROW_TAG = b"kvlife-catalog-row-v2"
_GEN_TAG = b"kvlife-catalog-generation:"
_DTYPE_KINDS = frozenset("biufc")
_ADVICE = (
    "Nothing was served from it and the segment files are untouched. Run `kvlife check "
    "--fix {store}` to repair what can be repaired, or move the catalog (and its "
    "-wal/-shm files) and the segments away to start the store empty."
)


class CatalogCorrupt(KVLifeError):
    """The catalog database cannot be read, or what it holds is not a valid catalog."""

    def __init__(self, path: Path, exc: Exception | str) -> None:
        self.path = path
        advice = _ADVICE.format(store=path.parent.parent)
        super().__init__(f"catalog {path} is damaged ({exc}). {advice}")


class CatalogMissing(KVLifeError):
    """Segment files hold data but the catalog that says which frames are committed is
    gone (or empty). Frames alone cannot tell committed from invalidated data, so kvlife
    refuses to guess (and refuses to delete the segments)."""

    def __init__(self, path: Path, segments: Path, state: str = "missing") -> None:
        self.path = path
        super().__init__(
            f"catalog {path} is {state} but {segments} holds segment files. Without the "
            "catalog no frame can be trusted to be committed and not invalidated; the "
            f"segments were left untouched. Restore the catalog, or move {segments} away "
            "to start the store empty."
        )


@dataclass(slots=True)
class CatalogRow:
    """Where one replica's frame lives and what it must verify to."""

    key: bytes
    seg: int
    off: int
    nbytes: int
    checksum: bytes
    dtype: str
    shape: tuple[int, ...]
    transform: str
    info: bytes
    form: bytes = b""
    """The store's representation record (transform descriptor); empty for exact."""
    born: bytes = b""
    """The store's record of the epoch the KV was created under; empty: unknown."""
    _header: bytes = field(default=b"", init=False, compare=False, repr=False)
    """The header bytes a frame of this row has (made on first use: :meth:`header`)."""

    def header(self) -> bytes:
        """The used bytes of the header a frame written for this row holds, byte for
        byte: a read whose header equals them verified every field of it at the cost
        of one comparison (:meth:`verify`)."""
        if not self._header:
            head = FrameHeader(
                self.key, self.nbytes, self.checksum, self.dtype, self.shape, self.transform
            )
            buf = bytearray(HEADER_BYTES)
            try:
                pack_header(head, memoryview(buf))
            except (ValueError, UnicodeEncodeError):
                buf = bytearray()
            del buf[HEADER_USED:]
            # a row whose own header would not verify field by field (a name longer
            # than its header field) gets one that no read matches: the slow check
            # answers for it, as it always did
            ok = buf and not verify_frame(bytes(buf), None, **self._expect())
            self._header = bytes(buf) if ok else b"\0"
        return self._header

    def _expect(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "nbytes": self.nbytes,
            "checksum": self.checksum,
            "dtype": self.dtype,
            "shape": self.shape,
            "transform": self.transform,
        }

    def fields(self) -> tuple[bytes, int, int, int, bytes, str, str, str, bytes, bytes, bytes]:
        """The persisted fields, in column order (the shape as its text)."""
        return (
            self.key,
            self.seg,
            self.off,
            self.nbytes,
            self.checksum,
            self.dtype,
            shape_text(self.shape),
            self.transform,
            self.info,
            self.form,
            self.born,
        )

    def verify(self, header: memoryview | bytes, payload: list[np.ndarray] | None) -> str:
        """Empty string if a frame's header (and payload, when given) matches this row
        in every field, else what differs.

        The header is first compared with the one this row's frame was written with
        (:meth:`header`): equal, every field and the header checksum are as the row
        says, and only the payload is left to hash; different (a frame of another
        format version, or damage), the field by field check says what differs."""
        if header[:HEADER_USED] == self.header():
            if payload is not None and parts_checksum(payload) != self.checksum:
                return "payload checksum mismatch"
            return ""
        return verify_frame(header, payload, **self._expect())


@dataclass(frozen=True, slots=True)
class ScannedRow:
    """One row as :meth:`Catalog.scan` found it."""

    rowid: int
    """SQLite rowid: names the row even when its key is damaged."""
    key: bytes
    """The key field as stored (possibly damaged; for reports)."""
    seg: int | None
    """The segment the row names, when that field parses."""
    row: CatalogRow | None
    """The parsed row; None when a field does not parse."""
    problem: str
    """Empty when every field parses and the row checksum matches, else what is wrong."""
    quarantine: str | None
    """Why an earlier open quarantined the row (None: not quarantined)."""


def shape_text(shape: tuple[int, ...]) -> str:
    return ",".join(str(d) for d in shape)


def row_checksum(
    key: bytes,
    seg: int,
    off: int,
    nbytes: int,
    checksum: bytes,
    dtype: str,
    shape: str,
    transform: str,
    info: bytes,
    form: bytes = b"",
    born: bytes = b"",
) -> bytes:
    """xxh3-128 over every field of a row, each length-prefixed (no two rows collide by
    moving bytes between fields). An empty ``form`` and ``born`` add nothing (a
    version-2 row's checksum); a non-empty form is one more length-prefixed part, and a
    non-empty born two more (the form, even empty, then born)."""
    h = xxhash.xxh3_128(_ROW_TAG)
    for part in (
        key,
        seg.to_bytes(8, "little"),
        off.to_bytes(8, "little"),
        nbytes.to_bytes(8, "little"),
        checksum,
        dtype.encode(),
        shape.encode(),
        transform.encode(),
        info,
        *((form, born) if born else (form,) if form else ()),
    ):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return bytes(h.digest())


class _BadField(Exception):
    pass


def _int_field(name: str, v: object) -> int:
    if type(v) is not int or v < 0 or v >= 1 << 63:
        raise _BadField(f"field {name!r} is {v!r}, not a non-negative integer")
    return v


def _bytes_field(name: str, v: object, size: int | None = None) -> bytes:
    if type(v) is not bytes or (size is not None and len(v) != size):
        want = "bytes" if size is None else f"{size} bytes"
        raise _BadField(f"field {name!r} is {_short(v)}, not {want}")
    return v


def _text_field(name: str, v: object) -> str:
    if type(v) is not str:
        raise _BadField(f"field {name!r} is {_short(v)}, not text")
    return v


def _short(v: object) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_shape(text: str) -> tuple[int, ...]:
    """Strict shape text: comma-separated non-negative decimal integers, or empty."""
    if text == "":
        return ()
    if not _SHAPE_RE.match(text):
        raise _BadField(f"field 'shape' is {_short(text)}, not comma-separated dimensions")
    shape = tuple(int(x) for x in text.split(","))
    if len(shape) > MAX_NDIM:
        raise _BadField(f"field 'shape' has {len(shape)} dimensions, at most {MAX_NDIM}")
    return shape


def parse_dtype(name: str) -> np.dtype[np.generic]:
    """Strict dtype name: a numeric numpy dtype spelt as numpy names it."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a deprecated alias is not a name we wrote
            dt = np.dtype(name)
    except (TypeError, ValueError, SyntaxError, Warning) as exc:
        raise _BadField(f"field 'dtype' is {_short(name)}, not a numpy dtype ({exc})") from exc
    if dt.name != name or dt.kind not in _DTYPE_KINDS:
        raise _BadField(f"field 'dtype' is {_short(name)}, not a numeric numpy dtype name")
    return dt


def _parse_row(r: tuple[object, ...], verify_sum: bool) -> CatalogRow:
    key = _bytes_field("key", r[0], 32)
    seg = _int_field("seg", r[1])
    off = _int_field("off", r[2])
    nbytes = _int_field("nbytes", r[3])
    checksum = _bytes_field("checksum", r[4], 16)
    dtype = _text_field("dtype", r[5])
    shape_t = _text_field("shape", r[6])
    transform = _text_field("transform", r[7])
    info = _bytes_field("info", r[8])
    form = _bytes_field("form", r[9])
    born = _bytes_field("born", r[10])
    dt = parse_dtype(dtype)
    shape = parse_shape(shape_t)
    if not _NAME_RE.match(transform) or len(transform.encode()) > TRANSFORM_BYTES:
        raise _BadField(f"field 'transform' is {_short(transform)}, not a transform name")
    want = dt.itemsize * math.prod(shape)
    if want != nbytes:
        raise _BadField(f"field 'nbytes' is {nbytes} but {dtype}{list(shape)} holds {want} bytes")
    if verify_sum:
        rowsum = r[11]
        if rowsum is None:
            raise _BadField("field 'rowsum' is missing")
        rowsum = _bytes_field("rowsum", rowsum, 16)
        want_sum = row_checksum(
            key, seg, off, nbytes, checksum, dtype, shape_t, transform, info, form, born
        )
        if rowsum != want_sum:
            raise _BadField("row checksum mismatch (the row changed after it was written)")
    return CatalogRow(key, seg, off, nbytes, checksum, dtype, shape, transform, info, form, born)


def _gen_text(generation: int) -> str:
    tag = xxhash.xxh3_64_hexdigest(_GEN_TAG + str(generation).encode())
    return f"{generation}:{tag}"


class Catalog:
    """The replicas table plus format metadata, the generation and persistent counters.

    ``create``: initialise an empty database (a store with no data yet); without it a
    database that holds no catalog is :class:`CatalogMissing`. ``readonly``: open with a
    SQLite ``mode=ro`` URI and write nothing, ever (``kvlife check``).
    """

    def __init__(
        self,
        path: Path,
        *,
        create: bool = False,
        readonly: bool = False,
        superblock: Superblock | None = None,
        initial_generation: int = 0,
    ) -> None:
        self.path = path
        self.readonly = readonly
        self.created = False
        self.migrated_from: int | None = None
        self._superblock = superblock
        self._lock = threading.RLock()
        self._created: list[Path] = []
        self.version = CATALOG_VERSION
        self.generation = 0
        """Generation of the last committed deleting transaction."""
        try:
            if readonly:
                # SQLite creates -wal/-shm beside a WAL database even for a read-only
                # reader; remove the ones this reader created. Without a log to read the
                # database file is the whole state: open it immutable (creates nothing).
                wal, shm = (path.with_name(path.name + x) for x in ("-wal", "-shm"))
                self._created = [p for p in (wal, shm) if not p.exists()]
                uri = f"file:{quote(str(path))}?mode=ro"
                if wal in self._created or wal.stat().st_size == 0:
                    uri += "&immutable=1"
                self._db = sqlite3.connect(
                    uri, uri=True, isolation_level=None, check_same_thread=False
                )
            else:
                self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise StorePathError(f"cannot open catalog {path}: {exc}") from exc
        try:
            self._open(create, initial_generation)
        except BaseException:
            self.close()
            raise

    def _open(self, create: bool, initial_generation: int) -> None:
        path = self.path
        # Read before anything writes: a refused open must leave the file as it was.
        try:
            tables = {
                str(r[0])
                for r in self._db.execute(
                    "SELECT name FROM sqlite_master WHERE type = 'table'"
                ).fetchall()
            }
        except sqlite3.Error as exc:
            raise CatalogCorrupt(path, exc) from exc
        if "meta" not in tables:
            if not create or self.readonly:
                state = "empty" if not tables else "not a kvlife catalog (no meta table)"
                raise CatalogMissing(path, path.parent / "segments", state)
            self._init_schema(initial_generation)
            self.created = True
            return
        version_text = self.get_meta("catalog_version")
        if version_text is None or not re.fullmatch(r"[0-9]{1,9}", version_text):
            raise CatalogCorrupt(path, f"field 'catalog_version' is {version_text!r}")
        version = int(version_text)
        if version > CATALOG_VERSION:
            raise StoreFormatError(
                f"catalog {path} has format version {version}; this kvlife reads up to "
                f"{CATALOG_VERSION}. Open it with a newer kvlife."
            )
        if version < 1:
            raise CatalogCorrupt(path, f"field 'catalog_version' is {version}")
        self.version = version
        if self.readonly:
            self.generation = self._read_generation() if version >= 2 else 0
            return
        self._exec("PRAGMA synchronous=FULL")
        mode = self._one("PRAGMA journal_mode=WAL")
        if mode is None or str(mode[0]).lower() != "wal":
            raise StorePathError(f"catalog {path} cannot use a write-ahead log (got {mode})")
        if version < CATALOG_VERSION:
            self._migrate(version, initial_generation)
        self.generation = self._read_generation()
        # A write now, so that a read-only file or directory fails the open, not a flush.
        with self._transaction():
            self._exec(
                "INSERT OR REPLACE INTO meta (k, v) VALUES ('catalog_version', ?)",
                (str(CATALOG_VERSION),),
            )
            self._exec(_EDGES_TABLE)  # catalogs written before edges were kept

    def _init_schema(self, generation: int) -> None:
        self._exec("PRAGMA synchronous=FULL")
        mode = self._one("PRAGMA journal_mode=WAL")
        if mode is None or str(mode[0]).lower() != "wal":
            raise StorePathError(f"catalog {self.path} cannot use a write-ahead log")
        with self._transaction():
            for stmt in _SCHEMA.split(";"):
                if stmt.strip():
                    self._exec(stmt)
            self._exec(
                "INSERT OR REPLACE INTO meta (k, v) VALUES ('catalog_version', ?)",
                (str(CATALOG_VERSION),),
            )
            self._exec(
                "INSERT OR REPLACE INTO meta (k, v) VALUES ('generation', ?)",
                (_gen_text(generation),),
            )
        self.version = CATALOG_VERSION
        self.generation = generation

    def _migrate(self, version: int, generation: int) -> None:
        with self._transaction():
            cols = {str(r[1]) for r in self._exec("PRAGMA table_info(replicas)")}
            if "rowsum" not in cols:
                self._exec("ALTER TABLE replicas ADD COLUMN rowsum BLOB")
            if "quarantine" not in cols:
                self._exec("ALTER TABLE replicas ADD COLUMN quarantine TEXT")
            if "form" not in cols:
                self._exec(_FORM_COLUMN)  # version 2: every replica was exact
            if "born" not in cols:
                self._exec(_BORN_COLUMN)  # version 3: every epoch is unknown
            todo = self._exec(f"SELECT rowid, {_COLUMNS} FROM replicas WHERE rowsum IS NULL")
            for r in todo:
                try:
                    row = _parse_row(tuple(r[1:]), verify_sum=False)
                except _BadField as exc:
                    self._exec(
                        "UPDATE replicas SET quarantine = ? WHERE rowid = ?",
                        (f"migration: {exc}", r[0]),
                    )
                    continue
                self._exec("UPDATE replicas SET rowsum = ? WHERE rowid = ?", (_rowsum(row), r[0]))
            if self.get_meta("generation") is None:
                self._exec(
                    "INSERT INTO meta (k, v) VALUES ('generation', ?)", (_gen_text(generation),)
                )
            self._exec(
                "INSERT OR REPLACE INTO meta (k, v) VALUES ('catalog_version', ?)",
                (str(CATALOG_VERSION),),
            )
        self.migrated_from = version
        self.version = CATALOG_VERSION

    def _read_generation(self) -> int:
        text = self.get_meta("generation")
        m = _GEN_RE.match(text or "")
        if m is None or _gen_text(int(m.group(1))) != text:
            raise CatalogCorrupt(self.path, f"field 'generation' is {text!r}")
        return int(m.group(1))

    # ------------------------------------------------------------------ plumbing

    def _exec(self, sql: str, params: Iterable[object] = ()) -> list[Any]:
        """Run one statement and fetch every row (a damaged page can fail the fetch as
        well as the execute; both become kvlife errors)."""
        try:
            return self._db.execute(sql, tuple(params)).fetchall()
        except sqlite3.Error as exc:
            raise self._error(exc, sql.split(None, 1)[0].lower()) from exc

    def _one(self, sql: str, params: Iterable[object] = ()) -> Any:
        rows = self._exec(sql, params)
        return rows[0] if rows else None

    def _error(self, exc: sqlite3.Error, doing: str) -> KVLifeError:
        text = str(exc)
        if "no such" in text or "malformed" in text:
            return CatalogCorrupt(self.path, exc)
        if isinstance(exc, sqlite3.OperationalError) or "readonly" in text:
            if "full" in text:
                return StorageFullError(f"device full while writing catalog {self.path}: {exc}")
            return StorePathError(f"catalog {self.path} failed ({doing}): {exc}")
        return CatalogCorrupt(self.path, exc)

    def _transaction(self) -> _Txn:
        return _Txn(self)

    def get_meta(self, k: str) -> str | None:
        with self._lock:
            row = self._one("SELECT v FROM meta WHERE k = ?", (k,))
        return None if row is None else str(row[0])

    # ------------------------------------------------------------------ reading rows

    def scan(self) -> list[ScannedRow]:
        """Every row, fields parsed strictly and the row checksum verified (all rows are
        read first, so a damaged database fails before any is used)."""
        with self._lock:
            quarantine = "quarantine" if self.version >= 2 else "NULL"
            rowsum = "rowsum" if self.version >= 2 else "NULL"
            cols = _COLUMNS if self.version >= 4 else _COLUMNS.replace(", born", ", x''")
            if self.version < 3:
                cols = cols.replace(", form", ", x''")
            data = self._exec(f"SELECT rowid, {cols}, {rowsum}, {quarantine} FROM replicas")
        out: list[ScannedRow] = []
        for r in data:
            raw_key = r[1] if isinstance(r[1], bytes) else repr(r[1]).encode()
            seg = r[2] if type(r[2]) is int else None
            q = r[13]
            try:
                row: CatalogRow | None = _parse_row(tuple(r[1:13]), verify_sum=self.version >= 2)
                problem = ""
            except _BadField as exc:
                row, problem = None, f"{self.path.name} row {r[0]}: {exc}"
            out.append(
                ScannedRow(int(r[0]), raw_key, seg, row, problem, None if q is None else str(q))
            )
        return out

    def quarantined(self) -> list[tuple[int, bytes, str]]:
        """(rowid, key as stored, why) of every quarantined row."""
        with self._lock:
            rows = self._exec(
                "SELECT rowid, key, quarantine FROM replicas WHERE quarantine IS NOT NULL"
            )
        return [
            (int(r[0]), r[1] if isinstance(r[1], bytes) else repr(r[1]).encode(), str(r[2]))
            for r in rows
        ]

    def integrity(self) -> list[str]:
        """SQLite's own ``PRAGMA integrity_check``: empty when the database is sound."""
        with self._lock:
            try:
                rows = self._db.execute("PRAGMA integrity_check").fetchall()
            except sqlite3.Error as exc:
                return [str(exc)]
        msgs = [str(r[0]) for r in rows]
        return [] if msgs == ["ok"] else msgs

    @contextlib.contextmanager
    def settled(self) -> Iterator[int]:
        """Hold transactions off and yield the generation of the last committed one,
        recorded in the superblock (an audit compares the two without racing a delete
        between its commit and its superblock write)."""
        with self._lock:
            yield self.generation

    def snapshot(self) -> CatalogSnapshot:
        """A second, read-only connection for an audit beside serving (close it)."""
        return CatalogSnapshot(self.path)

    # ------------------------------------------------------------------ writes

    def insert(self, rows: Iterable[CatalogRow], edges: Iterable[tuple[bytes, bytes]] = ()) -> None:
        """Insert (or replace) rows in one durable transaction, with the prefix links
        (child, parent) ``edges`` that must be durable with them (the rows' own links and
        their ancestors': so that invalidating a prefix reaches them after a restart
        whatever of their chain was never stored here)."""
        data = [(*f, row_checksum(*f)) for f in (r.fields() for r in rows)]
        links = _links(edges)
        with self._transaction() as txn:
            if links:
                txn.many(_KEEP_EDGE, links)
            txn.many(
                f"INSERT OR REPLACE INTO replicas ({_COLUMNS}, rowsum, quarantine) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, NULL)",
                data,
            )

    def delete(
        self,
        keys: Iterable[bytes],
        edges: Iterable[tuple[bytes, bytes]] = (),
        forget: Iterable[bytes] = (),
    ) -> None:
        """Delete rows by key, bump the generation, then record it in the superblock
        (nothing at all for no keys: compaction calls this with none most times).

        In the same transaction, ``edges`` (child, parent) are kept and the links of
        ``forget`` dropped (prefix links that lead to nothing stored any more)."""
        data = [(k,) for k in keys]
        if not data:
            return
        links = _links(edges)
        gone = [(c,) for c in forget]
        with self._lock:
            with self._transaction() as txn:
                if links:
                    txn.many(_KEEP_EDGE, links)
                if gone:
                    txn.many("DELETE FROM edges WHERE child = ?", gone)
                txn.many("DELETE FROM replicas WHERE key = ?", data)
                gen = txn.bump()
            self._acknowledge(gen)

    def keep_edges(self, edges: Iterable[tuple[bytes, bytes]]) -> None:
        """Make prefix links (child, parent) durable in one transaction."""
        links = _links(edges)
        if links:
            with self._transaction() as txn:
                txn.many(_KEEP_EDGE, links)

    def edges(self) -> list[tuple[bytes, bytes]]:
        """Kept prefix links (child, parent); a link that fails its checksum is skipped
        (it could only widen an invalidation, never serve anything)."""
        with self._lock:
            try:
                rows = self._exec("SELECT child, parent, sum FROM edges")
            except KVLifeError:
                return []  # a catalog from before edges were kept, opened read-only
        out: list[tuple[bytes, bytes]] = []
        for child, parent, digest in rows:
            if (
                type(child) is bytes
                and type(parent) is bytes
                and len(child) == len(parent) == 32
                and digest == _edge_sum(child, parent)
            ):
                out.append((child, parent))
        return out

    def forget_edges(self, children: Iterable[bytes]) -> None:
        """Drop kept links that lead to no stored chunk any more."""
        data = [(c,) for c in children]
        if data:
            with self._transaction() as txn:
                txn.many("DELETE FROM edges WHERE child = ?", data)

    def delete_quarantined(self, rowids: Iterable[int]) -> None:
        """Delete quarantined rows by rowid (``check --fix``: works for a row whose key is
        damaged; a row that is no longer quarantined, e.g. replaced by a new put, stays)."""
        data = [(i,) for i in rowids]
        if not data:
            return
        with self._lock:
            with self._transaction() as txn:
                txn.many("DELETE FROM replicas WHERE rowid = ? AND quarantine IS NOT NULL", data)
                gen = txn.bump()
            self._acknowledge(gen)

    def drop_all(self, at_least: int) -> int:
        """Delete every row; the generation moves past ``at_least``. Returns rows dropped."""
        with self._lock:
            with self._transaction() as txn:
                (n,) = self._one("SELECT count(*) FROM replicas")
                self._exec("DELETE FROM replicas")
                gen = max(self.generation, at_least) + 1
                self._exec(
                    "INSERT OR REPLACE INTO meta (k, v) VALUES ('generation', ?)",
                    (_gen_text(gen),),
                )
                txn.generation = gen
            self._acknowledge(gen)
        return int(n)

    def _acknowledge(self, gen: int) -> None:
        self.generation = gen
        if self._superblock is not None:
            self._superblock.write(gen)

    def quarantine(self, marks: Iterable[tuple[int, str]]) -> None:
        """Mark rows (by rowid) as not to be served, with why. Nothing is deleted."""
        data = [(why, rowid) for rowid, why in marks]
        if not data:
            return
        with self._transaction() as txn:
            txn.many("UPDATE replicas SET quarantine = ? WHERE rowid = ?", data)

    def relocate(self, moves: Iterable[tuple[bytes, int, int]]) -> None:
        """Point rows at new (segment, offset) places in one transaction (row checksums
        recomputed from the stored fields, which must verify first)."""
        with self._lock, self._transaction():
            for key, seg, off in moves:
                r = self._one(
                    f"SELECT rowid, {_COLUMNS}, rowsum FROM replicas WHERE key = ?", (key,)
                )
                if r is None:
                    raise CatalogCorrupt(self.path, f"row {key.hex()[:16]}… vanished")
                try:
                    row = _parse_row(tuple(r[1:]), verify_sum=True)
                except _BadField as exc:
                    raise CatalogCorrupt(self.path, f"row {r[0]}: {exc}") from None
                row.seg, row.off = seg, off
                self._exec(
                    "UPDATE replicas SET seg = ?, off = ?, rowsum = ? WHERE rowid = ?",
                    (seg, off, _rowsum(row), r[0]),
                )

    def reindex(self) -> None:
        """Rebuild every index from the table (``check --fix`` after integrity errors)."""
        with self._lock:
            self._exec("REINDEX")

    def load_counters(self) -> dict[str, int]:
        with self._lock:
            rows = self._exec("SELECT name, value FROM counters")
        out: dict[str, int] = {}
        for name, value in rows:
            if type(name) is not str or type(value) is not int:
                raise CatalogCorrupt(
                    self.path, f"counters row {_short(name)}: value {_short(value)}"
                )
            out[name] = value
        return out

    def save_counters(self, counters: dict[str, int]) -> None:
        with self._transaction() as txn:
            txn.many(
                "INSERT OR REPLACE INTO counters (name, value) VALUES (?, ?)",
                list(counters.items()),
            )

    def rows(self) -> Iterator[CatalogRow]:
        """Every row that parses and verifies and is not quarantined."""
        for s in self.scan():
            if s.row is not None and not s.problem and s.quarantine is None:
                yield s.row

    def close(self) -> None:
        with self._lock:
            self._db.close()
            for p in self._created:
                with contextlib.suppress(OSError):
                    p.unlink()


class CatalogSnapshot:
    """A read-only connection to a catalog a store has open, for an audit that runs
    beside serving: each read is one read transaction on its own connection (a
    consistent snapshot under WAL), so neither side waits for the other's I/O."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._db = sqlite3.connect(
                f"file:{quote(str(path))}?mode=ro",
                uri=True,
                isolation_level=None,
                check_same_thread=False,
            )
        except sqlite3.Error as exc:
            raise StorePathError(f"cannot open catalog {path} for an audit: {exc}") from exc

    def integrity(self) -> list[str]:
        """``PRAGMA integrity_check``: empty when the database is sound."""
        try:
            rows = self._db.execute("PRAGMA integrity_check").fetchall()
        except sqlite3.Error as exc:
            return [str(exc)]
        msgs = [str(r[0]) for r in rows]
        return [] if msgs == ["ok"] else msgs

    def quarantined(self) -> list[tuple[int, bytes, str]]:
        """(rowid, key as stored, why) of every quarantined row."""
        try:
            rows = self._db.execute(
                "SELECT rowid, key, quarantine FROM replicas WHERE quarantine IS NOT NULL"
            ).fetchall()
        except sqlite3.Error as exc:
            raise CatalogCorrupt(self.path, exc) from exc
        return [
            (int(r[0]), r[1] if isinstance(r[1], bytes) else repr(r[1]).encode(), str(r[2]))
            for r in rows
        ]

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> CatalogSnapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _rowsum(r: CatalogRow) -> bytes:
    return row_checksum(*r.fields())


def _edge_sum(child: bytes, parent: bytes) -> bytes:
    return xxhash.xxh3_128_digest(_EDGE_TAG + child + parent)


def _links(edges: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes, bytes]]:
    return [(c, p, _edge_sum(c, p)) for c, p in edges]


_KEEP_EDGE = "INSERT OR REPLACE INTO edges (child, parent, sum) VALUES (?, ?, ?)"


class _Txn:
    """One ``BEGIN IMMEDIATE`` .. ``COMMIT`` under the catalog's lock."""

    def __init__(self, cat: Catalog) -> None:
        self._cat = cat
        self.generation: int | None = None

    def many(self, sql: str, data: Sequence[tuple[object, ...]]) -> None:
        try:
            self._cat._db.executemany(sql, data)
        except sqlite3.Error as exc:
            raise self._cat._error(exc, sql.split(None, 1)[0].lower()) from exc

    def bump(self) -> int:
        gen = self._cat.generation + 1
        self._cat._exec(
            "INSERT OR REPLACE INTO meta (k, v) VALUES ('generation', ?)", (_gen_text(gen),)
        )
        self.generation = gen
        return gen

    def __enter__(self) -> _Txn:
        if self._cat.readonly:
            raise StorePathError(f"catalog {self._cat.path} was opened read-only")
        self._cat._lock.acquire()
        try:
            self._cat._exec("BEGIN IMMEDIATE")
        except BaseException:
            self._cat._lock.release()
            raise
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            if exc_type is None:
                try:
                    self._cat._exec("COMMIT")
                except BaseException:
                    with contextlib.suppress(sqlite3.Error):
                        self._cat._db.execute("ROLLBACK")
                    raise
            else:  # the original error is what the caller must see
                with contextlib.suppress(sqlite3.Error):
                    self._cat._db.execute("ROLLBACK")
        finally:
            self._cat._lock.release()

"""SQLite catalog of the disk tier: which replica lives where, durable and atomic.

One row per committed replica. The database runs in WAL mode with ``synchronous=FULL``,
so a committed transaction survives a process kill and a power cut. The commit order of
the tier is: payload written and fdatasync'ed, then the rows inserted in one
transaction, then the replicas made visible in memory. A row therefore never names bytes
that were not durable when it was written.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvlife.core.errors import KVLifeError, StoreFormatError, StorePathError

CATALOG_VERSION = 1

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
    info BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS replicas_seg ON replicas (seg);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""


class CatalogCorrupt(KVLifeError):
    """The catalog database cannot be read."""

    def __init__(self, path: Path, exc: Exception) -> None:
        self.path = path
        super().__init__(
            f"catalog {path} is damaged ({exc}). Nothing was served from it. The segment "
            "files are untouched; move the catalog (and its -wal/-shm files) away to start "
            "the store empty."
        )


class CatalogMissing(KVLifeError):
    """Segment files hold data but the catalog that says which frames are committed is
    gone. Frames alone cannot tell committed from invalidated data, so kvlife refuses to
    guess (and refuses to delete the segments)."""

    def __init__(self, path: Path, segments: Path) -> None:
        self.path = path
        super().__init__(
            f"catalog {path} is missing but {segments} holds segment files. Without the "
            "catalog no frame can be trusted to be committed and not invalidated. Restore "
            f"the catalog, or move {segments} away to start the store empty."
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


def _shape_text(shape: tuple[int, ...]) -> str:
    return ",".join(str(d) for d in shape)


def _shape_parse(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",")) if text else ()


class Catalog:
    """The replicas table plus format metadata and persistent counters."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise StorePathError(f"cannot open catalog {path}: {exc}") from exc
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
            version = self.get_meta("catalog_version")
        except sqlite3.DatabaseError as exc:
            self._db.close()
            raise CatalogCorrupt(path, exc) from exc
        if version is None:
            self.set_meta("catalog_version", str(CATALOG_VERSION))
        elif int(version) > CATALOG_VERSION:
            self._db.close()
            raise StoreFormatError(
                f"catalog {path} has format version {version}; this kvlife reads up to "
                f"{CATALOG_VERSION}. Open it with a newer kvlife."
            )

    def get_meta(self, k: str) -> str | None:
        row = self._db.execute("SELECT v FROM meta WHERE k = ?", (k,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, k: str, v: str) -> None:
        self._db.execute("INSERT OR REPLACE INTO meta (k, v) VALUES (?, ?)", (k, v))

    def rows(self) -> Iterator[CatalogRow]:
        """Every row (read fully first, so a damaged database fails before any is used)."""
        try:
            data = self._db.execute(
                "SELECT key, seg, off, nbytes, checksum, dtype, shape, transform, info "
                "FROM replicas"
            ).fetchall()
        except sqlite3.DatabaseError as exc:
            raise CatalogCorrupt(self.path, exc) from exc
        for r in data:
            yield CatalogRow(r[0], r[1], r[2], r[3], r[4], r[5], _shape_parse(r[6]), r[7], r[8])

    def insert(self, rows: Iterable[CatalogRow]) -> None:
        """Insert (or replace) rows in one durable transaction."""
        data = [
            (
                r.key,
                r.seg,
                r.off,
                r.nbytes,
                r.checksum,
                r.dtype,
                _shape_text(r.shape),
                r.transform,
                r.info,
            )
            for r in rows
        ]
        with self._transaction():
            self._db.executemany(
                "INSERT OR REPLACE INTO replicas "
                "(key, seg, off, nbytes, checksum, dtype, shape, transform, info) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                data,
            )

    def delete(self, keys: Iterable[bytes]) -> None:
        with self._transaction():
            self._db.executemany("DELETE FROM replicas WHERE key = ?", [(k,) for k in keys])

    def relocate(self, moves: Iterable[tuple[bytes, int, int]]) -> None:
        """Point rows at new (segment, offset) places in one transaction."""
        with self._transaction():
            self._db.executemany(
                "UPDATE replicas SET seg = ?, off = ? WHERE key = ?",
                [(seg, off, key) for key, seg, off in moves],
            )

    def load_counters(self) -> dict[str, int]:
        return {str(n): int(v) for n, v in self._db.execute("SELECT name, value FROM counters")}

    def save_counters(self, counters: dict[str, int]) -> None:
        with self._transaction():
            self._db.executemany(
                "INSERT OR REPLACE INTO counters (name, value) VALUES (?, ?)",
                list(counters.items()),
            )

    def close(self) -> None:
        self._db.close()

    def _transaction(self) -> _Txn:
        return _Txn(self._db)


class _Txn:
    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self._db.execute("COMMIT")
        else:
            self._db.execute("ROLLBACK")

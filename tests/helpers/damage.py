"""Damaging a store's files from outside, the way a bad disk, an operator or a crash does.

Shared by the catalog-integrity, read-only-check and fuzz tests. Stores are disk-only
(every served chunk is a verified disk read) and built from the deterministic workload
of :mod:`tests.helpers.workload`, so every served byte can be compared with what was put.
A *crash image* is a copy of a store's files taken while the store is open and idle:
what a power cut or a kill would leave (the WAL not yet checkpointed into the catalog).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kvlife.core.identity import ChunkKey, Namespace
from kvlife.store import KVStore
from tests.helpers.workload import (
    USERS,
    ChunkRef,
    KiB,
    MiB,
    Prompt,
    chunk_refs,
    kv_for_key,
    load_chunk,
    make_prompt,
    put,
    same_bytes,
)

SEED = 9090
SEGMENT_BYTES = 64 * KiB
"""Eight 8 KiB frames per segment: a few prompts span several segments."""


def open_store(path: Path) -> KVStore:
    return KVStore.open(path, dram_bytes=0, disk_bytes=64 * MiB, segment_bytes=SEGMENT_BYTES)


def disk_dir(path: Path) -> Path:
    return path / "disk"


def catalog_file(path: Path) -> Path:
    return path / "disk" / "catalog.sqlite"


def segment_files(path: Path) -> list[Path]:
    return sorted((path / "disk" / "segments").glob("seg-*.kvs"))


@dataclass(slots=True)
class Workload:
    """A store holding known prompts, some of them invalidated."""

    path: Path
    prompts: list[Prompt]
    refs: dict[ChunkKey, ChunkRef] = field(default_factory=dict)
    invalidated: set[ChunkKey] = field(default_factory=set)
    """Keys an acknowledged invalidation removed: never to be served again."""

    @property
    def live(self) -> set[ChunkKey]:
        return set(self.refs) - self.invalidated


def build(path: Path, prompts: int = 8, invalidate: Namespace | None = None) -> Workload:
    """Put ``prompts`` prompts (and invalidate ``invalidate``), then close cleanly."""
    w = _fill(path, prompts)
    store = open_store(path)
    try:
        if invalidate is not None:
            _invalidate(store, w, invalidate)
    finally:
        store.close()
    return w


def build_crash_image(
    path: Path, image: Path, prompts: int = 8, more: int = 0, invalidate: Namespace = USERS[0]
) -> Workload:
    """Put prompts, close, reopen, put ``more`` prompts, invalidate ``invalidate``, and
    copy the files while the store is still open (the last puts and the invalidation
    live only in the write-ahead log)."""
    w = _fill(path, prompts)
    store = open_store(path)
    try:
        for i in range(more):
            p = make_prompt(SEED + 2, i, USERS[i % len(USERS)])
            put(store, p)
            w.prompts.append(p)
            for ref in chunk_refs(p):
                w.refs.setdefault(ref.key, ref)
        _invalidate(store, w, invalidate)
        copy_crash_image(path, image)
    finally:
        store.close()
    return Workload(image, w.prompts, w.refs, w.invalidated)


def build_wal_only_puts(
    path: Path, image: Path, prompts: int = 6
) -> tuple[Workload, set[ChunkKey]]:
    """Put prompts and close (rows checkpointed), reopen, put more and copy the files
    while open: the second batch's rows live only in the write-ahead log (returned)."""
    w = _fill(path, prompts)
    first = set(w.refs)
    more = [make_prompt(SEED + 1, i, USERS[i % len(USERS)]) for i in range(prompts)]
    store = open_store(path)
    try:
        for p in more:
            put(store, p)
        copy_crash_image(path, image)
    finally:
        store.close()
    for p in more:
        w.prompts.append(p)
        for ref in chunk_refs(p):
            w.refs.setdefault(ref.key, ref)
    w.path = image
    return w, set(w.refs) - first


def _fill(path: Path, prompts: int) -> Workload:
    written = [make_prompt(SEED, i, USERS[i % len(USERS)]) for i in range(prompts)]
    store = open_store(path)
    try:
        for p in written:
            put(store, p)
    finally:
        store.close()
    w = Workload(path, written)
    for p in written:
        for ref in chunk_refs(p):
            w.refs.setdefault(ref.key, ref)
    return w


def _invalidate(store: KVStore, w: Workload, ns: Namespace) -> None:
    gone = {k for k, r in w.refs.items() if r.namespace == ns}
    assert gone, "the workload has no chunk in that namespace"
    assert store.invalidate(namespace=ns) == len(gone)
    w.invalidated |= gone


def copy_crash_image(src: Path, dst: Path) -> None:
    """Every file of an open, idle store except the SQLite shared-memory index and the lock."""
    for f in sorted(src.rglob("*")):
        if f.is_file() and not f.name.endswith("-shm") and f.name != "LOCK":
            target = dst / f.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, target)


@dataclass(slots=True)
class Served:
    served: set[ChunkKey] = field(default_factory=set)
    missed: set[ChunkKey] = field(default_factory=set)


def serve_all(store: KVStore, w: Workload) -> Served:
    """Load every chunk on its own; fail on any wrong byte or any invalidated chunk served."""
    out = Served()
    indexed = set(store.indexed_keys())
    assert not indexed & w.invalidated, "an invalidated chunk is indexed again"
    for key, ref in w.refs.items():
        got = load_chunk(store, ref)
        assert got.loaded == len(got.arrays) <= 1
        if got.loaded:
            assert key not in w.invalidated, f"invalidated chunk {key.hex()[:16]} served"
            assert same_bytes(got.arrays[0], kv_for_key(key)), f"wrong bytes for {key.hex()}"
            out.served.add(key)
        else:
            out.missed.add(key)
    return out


def snapshot(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path`` but the lock and SQLite's -shm index."""
    out: dict[str, str] = {}
    for f in sorted(path.rglob("*")):
        if f.is_file() and f.name != "LOCK" and not f.name.endswith("-shm"):
            out[str(f.relative_to(path))] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def all_segment_names(path: Path) -> set[str]:
    """Names of segment files in segments/ or set aside in quarantine/."""
    names = {p.name for p in segment_files(path)}
    q = path / "disk" / "quarantine"
    if q.is_dir():
        names |= {p.name.split(".kvs")[0] + ".kvs" for p in q.iterdir()}
    return names


def flip(path: Path, offset: int, length: int = 1) -> None:
    """Invert ``length`` bytes at ``offset`` (so they surely change)."""
    with path.open("r+b") as fh:
        fh.seek(offset)
        old = fh.read(length)
        fh.seek(offset)
        fh.write(bytes(b ^ 0xFF for b in old))


def sql(path: Path, stmt: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    """Run one statement on a closed store's catalog, as an operator with sqlite3 would."""
    db = sqlite3.connect(catalog_file(path))
    try:
        with db:
            return [tuple(r) for r in db.execute(stmt, params).fetchall()]
    finally:
        db.close()


def reseal_row(path: Path, rowid: int) -> None:
    """Recompute a row's checksum from its fields: what a buggy writer would leave, so
    that the strict field parsing, not the row checksum, must catch the bad field."""
    from kvlife.tiers.disk.catalog import row_checksum  # new in catalog v2

    ((key, seg, off, nbytes, checksum, dtype, shape, transform, info),) = sql(
        path,
        "SELECT key, seg, off, nbytes, checksum, dtype, shape, transform, info "
        "FROM replicas WHERE rowid = ?",
        (rowid,),
    )
    assert isinstance(key, bytes) and isinstance(checksum, bytes) and isinstance(info, bytes)
    assert isinstance(seg, int) and isinstance(off, int) and isinstance(nbytes, int)
    assert isinstance(dtype, str) and isinstance(shape, str) and isinstance(transform, str)
    rowsum = row_checksum(key, seg, off, nbytes, checksum, dtype, shape, transform, info)
    sql(path, "UPDATE replicas SET rowsum = ? WHERE rowid = ?", (rowsum, rowid))


def row_of(path: Path, key: ChunkKey) -> int:
    ((rowid,),) = sql(path, "SELECT rowid FROM replicas WHERE key = ?", (key,))
    assert isinstance(rowid, int)
    return rowid


@contextmanager
def read_only(path: Path) -> Iterator[None]:
    """Make a file unwritable, even for root (``chattr +i``); skip where that is impossible."""
    import pytest

    if os.geteuid() != 0:
        path.chmod(0o444)
        try:
            yield
        finally:
            path.chmod(0o644)
        return
    done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot make {path} read-only as root: {done.stderr!r}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True, check=False)

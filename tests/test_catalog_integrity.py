"""Issue 9: a catalog that proves itself, and recovery that never destroys or rolls back.

Each test reproduces one case the issue found with the public API plus direct damage to
the store's files, and fails on the code before the fix:

- recovery deleted data (a zero-byte catalog, a lost write-ahead log, swapped or
  unreferenced segment files made it unlink segments);
- a damaged write-ahead log silently rolled the catalog back, so invalidated chunks
  were served again;
- catalog rows were covered by no checksum (a flipped namespace, weights digest or
  key made invalidation miss a chunk or left a row that could never be removed);
- damaged metadata escaped as ValueError / TypeError / sqlite3 errors;
- the catalog connection could be entered by two threads at once.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from pathlib import Path

import numpy as np
import pytest

from kvlife.core.errors import StorePathError
from kvlife.tiers.disk.catalog import (
    CATALOG_VERSION,
    Catalog,
    CatalogCorrupt,
    CatalogMissing,
    CatalogRow,
)
from kvlife.tiers.disk.superblock import CatalogRolledBack, SuperblockError
from tests.helpers.damage import (
    all_segment_names,
    build,
    build_crash_image,
    build_wal_only_puts,
    catalog_file,
    disk_dir,
    flip,
    open_store,
    read_only,
    reseal_row,
    row_of,
    segment_files,
    serve_all,
    snapshot,
    sql,
)
from tests.helpers.workload import IDENTITY, USERS, disk_of, load_chunk


def segment_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in segment_files(path)}


# ------------------------------------------------------------------ nothing deleted at open


def test_zero_byte_catalog_is_refused_and_segments_kept(tmp_path: Path) -> None:
    w = build(tmp_path / "s", prompts=6)
    before = segment_bytes(w.path)
    catalog_file(w.path).write_bytes(b"")
    with pytest.raises(CatalogMissing, match=r"catalog\.sqlite is empty.*segments"):
        open_store(w.path)
    assert segment_bytes(w.path) == before, "a refused open touched the segments"


def test_catalog_replaced_by_an_empty_database_is_refused(tmp_path: Path) -> None:
    w = build(tmp_path / "s", prompts=6)
    before = segment_bytes(w.path)
    for f in disk_dir(w.path).glob("catalog.sqlite*"):
        f.unlink()
    sqlite3.connect(catalog_file(w.path)).execute("CREATE TABLE other (x)").connection.close()
    with pytest.raises(CatalogMissing, match="not a kvlife catalog"):
        open_store(w.path)
    assert segment_bytes(w.path) == before


def test_lost_wal_sets_segments_aside_instead_of_deleting_them(tmp_path: Path) -> None:
    """Rows that lived only in the -wal vanish with it; their segments are moved to
    quarantine/ byte for byte, never unlinked, and nothing wrong is served."""
    w, wal_only = build_wal_only_puts(tmp_path / "s", tmp_path / "img")
    before = {n: b for n, b in segment_bytes(w.path).items() if b}
    (disk_dir(w.path) / "catalog.sqlite-wal").unlink()
    store = open_store(w.path)
    try:
        got = serve_all(store, w)
        assert got.served == set(w.refs) - wal_only
        assert set(before) <= all_segment_names(w.path), "a segment file was deleted"
        quarantined = disk_dir(w.path) / "quarantine"
        for name, data in before.items():
            where = disk_dir(w.path) / "segments" / name
            kept = where if where.exists() else quarantined / name
            assert kept.read_bytes()[: len(data)] == data
        assert disk_of(store).check().quarantined_files, "the set-aside segments are not listed"
    finally:
        store.close()


def test_swapped_segment_files_delete_nothing(tmp_path: Path) -> None:
    w = build(tmp_path / "s", prompts=10)
    segs = segment_files(w.path)
    assert len(segs) >= 3
    a, b = segs[0], segs[-1]
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db)
    b.write_bytes(da)
    names = {p.name for p in segs}
    store = open_store(w.path)
    try:
        serve_all(store, w)
        assert names <= all_segment_names(w.path), "recovery deleted segment files"
        assert store.counters.recovery_dropped > 0
    finally:
        store.close()


def test_unreferenced_segment_is_quarantined_not_deleted(tmp_path: Path) -> None:
    w = build(tmp_path / "s", prompts=4)
    stray = disk_dir(w.path) / "segments" / "seg-00000099.kvs"
    stray.write_bytes(b"committed? nobody knows" * 500)
    store = open_store(w.path)
    try:
        assert not stray.exists()
        kept = disk_dir(w.path) / "quarantine" / stray.name
        assert kept.read_bytes() == b"committed? nobody knows" * 500
        report = disk_of(store).check()
        assert report.quarantined_files == [stray.name]
        assert serve_all(store, w).served == set(w.refs)
    finally:
        store.close()


def test_bad_rows_are_quarantined_not_deleted_and_counted_once(tmp_path: Path) -> None:
    w = build(tmp_path / "s", prompts=4)
    victim = next(iter(w.refs))
    rowid = row_of(w.path, victim)
    sql(w.path, "UPDATE replicas SET off = off + 4096 WHERE rowid = ?", (rowid,))
    for _ in range(2):
        store = open_store(w.path)
        try:
            assert victim not in store.indexed_keys()
            assert sql(w.path, "SELECT count(*) FROM replicas WHERE rowid = ?", (rowid,)) == [
                (1,)
            ], "open deleted the bad row"
        finally:
            store.close()
    store = open_store(w.path)
    try:
        assert store.counters.recovery_dropped == 0, "the quarantined row was counted again"
        assert serve_all(store, w).served == set(w.refs) - {victim}
    finally:
        store.close()


# ------------------------------------------------------------------ no silent rollback


@pytest.mark.parametrize("how", ["flip-frame", "flip-header", "truncate", "delete"])
def test_damaged_wal_after_invalidate_is_refused_not_rolled_back(tmp_path: Path, how: str) -> None:
    w = build_crash_image(tmp_path / "s", tmp_path / "img")
    wal = disk_dir(w.path) / "catalog.sqlite-wal"
    size = wal.stat().st_size
    assert size > 32
    if how == "flip-frame":
        flip(wal, size - 100)  # inside the last frame: the invalidation's commit
    elif how == "flip-header":
        flip(wal, 20)  # WAL header salt: SQLite ignores the whole log
    elif how == "truncate":
        os.truncate(wal, size // 2)
    else:
        wal.unlink()
    before = snapshot(w.path)
    with pytest.raises(CatalogRolledBack, match="generation"):
        open_store(w.path)
    after = snapshot(w.path)
    assert {k: v for k, v in after.items() if "catalog.sqlite" not in k} == {
        k: v for k, v in before.items() if "catalog.sqlite" not in k
    }, "a refused open changed the segments or the superblock"


def test_intact_crash_image_keeps_the_invalidation(tmp_path: Path) -> None:
    w = build_crash_image(tmp_path / "s", tmp_path / "img")
    store = open_store(w.path)
    try:
        assert serve_all(store, w).served == w.live
    finally:
        store.close()


def test_lost_superblock_after_deletions_is_refused(tmp_path: Path) -> None:
    w = build(tmp_path / "s", prompts=6, invalidate=USERS[0])
    (disk_dir(w.path) / "superblock").unlink()
    with pytest.raises(SuperblockError, match="missing"):
        open_store(w.path)


def test_one_damaged_superblock_copy_is_survived_and_repaired(tmp_path: Path) -> None:
    w = build(tmp_path / "s", prompts=6, invalidate=USERS[0])
    sb = disk_dir(w.path) / "superblock"
    flip(sb, 20, 4)
    flip(sb, 4096 + 20, 4)
    with pytest.raises(SuperblockError, match=r"copy 0.*copy 1"):
        open_store(w.path)
    # one copy back: the other still holds the acknowledged generation
    flip(sb, 4096 + 20, 4)
    store = open_store(w.path)
    try:
        assert serve_all(store, w).served == w.live
        assert disk_of(store).check().clean
    finally:
        store.close()


# ------------------------------------------------------------------ rows prove themselves


def _info_offset(row_info: bytes, needle: bytes) -> int:
    at = row_info.find(needle)
    assert at >= 0, f"{needle!r} not in the row's info"
    return at


@pytest.mark.parametrize("field", ["namespace", "weights_digest"])
def test_flipped_identity_text_in_a_row_is_quarantined(tmp_path: Path, field: str) -> None:
    """A flipped byte in the namespace or weights digest a row carries made
    ``invalidate`` miss the object. Now the row fails its checksum at open: never
    indexed, counted, and the invalidation still removes everything it names."""
    w = build(tmp_path / "s", prompts=6)
    victim = next(k for k, r in w.refs.items() if r.namespace == USERS[0])
    ((info,),) = sql(w.path, "SELECT info FROM replicas WHERE key = ?", (victim,))
    assert isinstance(info, bytes)
    needle = USERS[0].name.encode() if field == "namespace" else IDENTITY.weights_digest.encode()
    at = _info_offset(info, needle)
    damaged = bytearray(info)
    damaged[at] ^= 0x01
    sql(w.path, "UPDATE replicas SET info = ? WHERE key = ?", (bytes(damaged), victim))
    store = open_store(w.path)
    try:
        assert victim not in store.indexed_keys()
        assert store.counters.recovery_dropped == 1
        if field == "namespace":
            store.invalidate(namespace=USERS[0])
        else:
            store.invalidate(weights_digest=IDENTITY.weights_digest)
        assert victim not in store.indexed_keys()
        assert load_chunk(store, w.refs[victim]).loaded == 0
    finally:
        store.close()


def test_flipped_key_byte_in_the_catalog_file_is_refused_or_quarantined(tmp_path: Path) -> None:
    w = build(tmp_path / "s", prompts=6)
    cat = catalog_file(w.path)
    data = cat.read_bytes()
    victim = next(iter(w.refs))
    at = data.find(victim)
    assert at >= 0
    flip(cat, at + 5)
    try:
        store = open_store(w.path)
    except CatalogCorrupt as exc:  # SQLite's integrity check sees the broken index
        assert "catalog.sqlite" in str(exc) and "check --fix" in str(exc)
        return
    try:
        assert victim not in store.indexed_keys()
        serve_all(store, w)
    finally:
        store.close()


@pytest.mark.parametrize(
    ("column", "value", "named"),
    [
        ("shape", "2,2,2,16,1v", "shape"),
        ("dtype", "floap16", "dtype"),
        ("shape", "2,2,2,16,17", "nbytes"),
        ("transform", "", "transform"),
    ],
)
def test_malformed_field_is_a_typed_quarantine_not_an_exception(
    tmp_path: Path, column: str, value: str, named: str
) -> None:
    """Even with a matching row checksum (a buggy writer), every persisted field is
    parsed strictly: the row is quarantined with the field named, opens never raise
    ValueError/TypeError, and loads never fail to reshape."""
    w = build(tmp_path / "s", prompts=4)
    victim = next(iter(w.refs))
    rowid = row_of(w.path, victim)
    sql(w.path, f"UPDATE replicas SET {column} = ? WHERE rowid = ?", (value, rowid))
    reseal_row(w.path, rowid)
    store = open_store(w.path)
    try:
        assert victim not in store.indexed_keys()
        assert store.counters.recovery_dropped == 1
        assert serve_all(store, w).served == set(w.refs) - {victim}
        (line,) = disk_of(store).check().quarantined
        assert f"'{named}'" in line and "catalog.sqlite" in line, line
    finally:
        store.close()


def test_damaged_counters_page_is_a_typed_error(tmp_path: Path) -> None:
    w = build(tmp_path / "s", prompts=4)
    ((root,),) = sql(w.path, "SELECT rootpage FROM sqlite_master WHERE name = 'counters'")
    assert isinstance(root, int)
    cat = catalog_file(w.path)
    page = 4096
    with cat.open("r+b") as fh:
        fh.seek((root - 1) * page)
        fh.write(np.random.default_rng(3).bytes(page))
    with pytest.raises(CatalogCorrupt, match=r"catalog\.sqlite"):
        open_store(w.path)


def test_read_only_catalog_is_a_store_path_error_at_open(tmp_path: Path) -> None:
    w = build(tmp_path / "s", prompts=4)
    with read_only(catalog_file(w.path)), pytest.raises(StorePathError, match="catalog"):
        open_store(w.path)


def test_version_1_catalog_is_migrated(tmp_path: Path) -> None:
    w = build(tmp_path / "s", prompts=4)
    sql(w.path, "ALTER TABLE replicas DROP COLUMN rowsum")
    sql(w.path, "ALTER TABLE replicas DROP COLUMN quarantine")
    sql(w.path, "DELETE FROM meta WHERE k = 'generation'")
    sql(w.path, "UPDATE meta SET v = '1' WHERE k = 'catalog_version'")
    (disk_dir(w.path) / "superblock").unlink()
    store = open_store(w.path)
    try:
        assert serve_all(store, w).served == set(w.refs)
        assert disk_of(store).check().clean
    finally:
        store.close()
    assert sql(w.path, "SELECT v FROM meta WHERE k = 'catalog_version'") == [
        (str(CATALOG_VERSION),)
    ]


# ------------------------------------------------------------------ one connection, many threads


def test_catalog_is_safe_to_share_between_threads(tmp_path: Path) -> None:
    cat = Catalog(tmp_path / "catalog.sqlite", create=True)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for i in range(60):
                key = bytes([t, i]) + bytes(30)
                cat.insert(
                    [CatalogRow(key, 1, 4096 * i, 2, bytes(16), "float16", (1,), "exact", b"")]
                )
                list(cat.rows())
                cat.delete([key])
                cat.save_counters({f"c{t}": i})
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    try:
        assert errors == []
        assert list(cat.rows()) == []
        assert cat.generation == 6 * 60
    finally:
        cat.close()


def test_superblock_write_never_touches_the_newest_copy(tmp_path: Path) -> None:
    """A torn superblock write can only damage the older copy: the newest acknowledged
    generation always survives in the other one."""
    from kvlife.tiers.disk.fileio import FileIO
    from kvlife.tiers.disk.superblock import SLOT_BYTES, Superblock, read_superblock

    sb = Superblock(tmp_path / "superblock", FileIO(direct=False))
    try:
        for gen in range(1, 6):
            sb.write(gen)
            state = read_superblock(sb.path)
            assert state.generation == gen
            older = 1 - state.generations.index(gen)
            # tear the copy the next write would use: the newest survives
            with sb.path.open("r+b") as fh:
                fh.seek(older * SLOT_BYTES + 3)
                fh.write(b"\xff")
            assert read_superblock(sb.path).generation == gen
            sb.reread()
    finally:
        sb.close()

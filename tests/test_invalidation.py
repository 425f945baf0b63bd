"""Invalidation against puts in flight (issue 18, hole 5): an invalidation applies to
every put prepared before it returned, whether that put commits before or after."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from kvlife.core.identity import ChunkKey, Namespace, NamespaceKind
from kvlife.store import KVStore
from tests.conftest import prompt_kv, tiny_identity

ALICE = Namespace(NamespaceKind.USER, "alice")
BOB = Namespace(NamespaceKind.USER, "bob")


@pytest.fixture
def store(tmp_path: Path) -> KVStore:
    return KVStore.open(tmp_path / "s", dram_bytes=1 << 20, disk_bytes=4 << 20)


def test_an_invalidation_reaches_a_put_in_flight(store: KVStore) -> None:
    ident = tiny_identity()
    tokens, kv = prompt_kv(1, 32)
    pending = store.prepare_put(ident, ALICE, tokens, kv)
    assert store.invalidate(namespace=ALICE) == 2  # both chunks of the put in flight
    res = store.commit_put(pending)
    assert res.stored == 0 and res.tokens_stored_or_present == 0
    assert store.lookup(ident, ALICE, tokens).hits == []
    again = store.put_prompt(ident, ALICE, tokens, kv)  # prepared after it: stored
    assert again.stored == 2
    assert len(store.lookup(ident, ALICE, tokens).hits) == 2
    store.close()


def test_a_prefix_invalidation_reaches_the_chained_chunks_of_a_put_in_flight(
    store: KVStore,
) -> None:
    ident = tiny_identity()
    tokens, kv = prompt_kv(2, 64)
    pending = store.prepare_put(ident, BOB, tokens, kv)
    other_tokens, other_kv = prompt_kv(3, 32)
    other = store.prepare_put(ident, ALICE, other_tokens, other_kv)
    assert store.invalidate(prefix=ChunkKey(pending.keys[1])) == 3
    assert store.commit_put(pending).stored == 1
    assert store.commit_put(other).stored == 2  # not covered
    assert len(store.lookup(ident, BOB, tokens).hits) == 1
    assert len(store.lookup(ident, ALICE, other_tokens).hits) == 2
    store.close()


def test_a_put_in_flight_invalidated_then_aborted_or_closed(tmp_path: Path) -> None:
    ident = tiny_identity()
    tokens, kv = prompt_kv(4, 32)
    with KVStore.open(tmp_path / "s", dram_bytes=1 << 20, disk_bytes=4 << 20) as store:
        pending = store.prepare_put(ident, ALICE, tokens, kv)
        store.invalidate(namespace=ALICE)
        store.abort_put(pending)  # nothing left to abort: no error
        left = store.prepare_put(ident, ALICE, tokens, kv)
        store.invalidate(namespace=ALICE)
        assert left.keys  # closed below with the put still pending
    with KVStore.open(tmp_path / "s", dram_bytes=1 << 20, disk_bytes=4 << 20) as store:
        assert store.lookup(ident, ALICE, tokens).hits == []


def test_version_3_catalog_is_migrated_to_4_with_unknown_creation_epochs(tmp_path: Path) -> None:
    """Catalog v4 adds the creation epoch (``born``); rows of a v3 catalog keep serving,
    their epoch unknown (every global rule covers them), and checksum as they did."""
    ident = tiny_identity()
    tokens, kv = prompt_kv(5, 32)
    path = tmp_path / "s"
    with KVStore.open(path, dram_bytes=0, disk_bytes=4 << 20) as store:
        store.put_prompt(ident, ALICE, tokens, kv)
    db = sqlite3.connect(path / "disk" / "catalog.sqlite")
    try:
        with db:
            db.execute("ALTER TABLE replicas DROP COLUMN born")
            db.execute("UPDATE meta SET v = '3' WHERE k = 'catalog_version'")
    finally:
        db.close()
    with KVStore.open(path, dram_bytes=0, disk_bytes=4 << 20) as store:
        got = store.load(store.lookup(ident, ALICE, tokens))
        assert got.loaded == 2
        assert store.check().clean
    db = sqlite3.connect(path / "disk" / "catalog.sqlite")
    try:
        (version,) = db.execute("SELECT v FROM meta WHERE k = 'catalog_version'").fetchone()
        borns = db.execute("SELECT born FROM replicas").fetchall()
    finally:
        db.close()
    assert int(version) == 4 and borns == [(b"",), (b"",)]


def test_the_row_checksum_covers_the_creation_epoch() -> None:
    from kvlife.tiers.disk.catalog import row_checksum

    base = (bytes(32), 0, 0, 8, bytes(16), "uint8", "8", "exact", b"info")
    plain = row_checksum(*base)
    assert row_checksum(*base, b"", b"") == plain  # a version-3 row checksums as before
    stamped = row_checksum(*base, b"", b"\x93born")
    assert stamped != plain
    assert row_checksum(*base, b"\x93born", b"") != stamped  # bytes moved between fields

"""DRAM replicas carry the xxh3-128 they were sealed with (issue 18, the defence behind
hole 6): a replica changed in memory, behind every guard numpy offers (a buggy client
writing memory it still maps), is caught where its bytes would leave memory for good
(demotion, flush), by ``check`` and, with ``verify_dram_on_load``, by every load; it is
counted (``corrupt``, ``sealed_mismatch``) and invalidated, never persisted or served as
correct. Seals are computed once: a promotion takes the checksum its disk read verified,
a write-through frame takes the DRAM seal.

The replica is changed the way such a client would: a raw write to its address."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from kvlife.client.handles import RemoteLookup
from kvlife.core.errors import ChecksumMismatch
from kvlife.core.events import MemorySink
from kvlife.core.identity import PUBLIC, ChunkKey, ModelIdentity
from kvlife.store import KVStore, StoreConfig, TierSpec
from kvlife.tiers.base import ReplicaMeta
from kvlife.tiers.disk import DiskTier, DiskTierConfig
from kvlife.tiers.memory import MemoryTier
from tests.conftest import TINY, prompt_kv, tiny_identity
from tests.server.conftest import ServerProc

C = TINY.chunk_nbytes
N = TINY.tokens_per_chunk


def open_store(path: Path, dram_chunks: int = 3, **kw: Any) -> KVStore:
    return KVStore.open(
        path, dram_bytes=dram_chunks * C, disk_bytes=1 << 24, segment_bytes=1 << 20, **kw
    )


def scribble(store: KVStore, key: ChunkKey) -> None:
    """Change a DRAM replica's bytes behind numpy's back (what a stray writer does)."""
    arr = store.tier("dram").read(key)
    ctypes.memset(arr.ctypes.data + 7, 0x5A, 5)


def chunk(kv: np.ndarray, i: int) -> np.ndarray:
    return np.ascontiguousarray(kv[:, :, :, i * N : (i + 1) * N, :])


def test_a_demotion_never_persists_a_replica_changed_in_memory(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    tokens, kv = prompt_kv(1, 3 * N)
    sink = MemorySink()
    with open_store(tmp_path, sink=sink) as store:
        keys = store.put_prompt(identity, PUBLIC, tokens, kv).keys
        store.lookup(identity, PUBLIC, tokens[: 2 * N])  # X2 is the least recent
        scribble(store, keys[2])
        store.evict("dram", C)
        assert store.counters.sealed_mismatch == 1 and store.counters.corrupt == 1
        assert store.counters.demotions == 0
        assert keys[2] not in store.indexed_keys()
        assert keys[2] not in store.tier("disk").replica_keys(), "changed bytes made durable"
        assert keys[2] not in store.tier("dram").replica_keys()
        events = [e for e in sink.take() if e.key == keys[2].hex() and e.kind == "corrupt"]
        assert events and "sealed" in events[0].reason
        res = store.load(store.lookup(identity, PUBLIC, tokens))
        assert res.loaded == 2
    with open_store(tmp_path) as store:
        assert keys[2] not in store.indexed_keys()


def test_a_flush_never_persists_a_replica_changed_in_memory(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    tokens, kv = prompt_kv(2, 3 * N)
    with open_store(tmp_path) as store:
        keys = store.put_prompt(identity, PUBLIC, tokens, kv).keys
        scribble(store, keys[1])
        assert store.flush() == 2
        assert store.counters.sealed_mismatch == 1
        assert set(store.tier("disk").replica_keys()) == {keys[0], keys[2]}
    with open_store(tmp_path) as store:
        assert set(store.indexed_keys()) == {keys[0], keys[2]}
        got = store.load(store.lookup(identity, PUBLIC, tokens[:N]))
        assert got.loaded == 1 and np.array_equal(got.arrays[0], chunk(kv, 0))


def test_check_reports_and_drops_a_changed_dram_replica_and_serves_the_disk_copy(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """Written through, then changed in DRAM: ``check`` (no fix needed) reports it, drops
    the DRAM replica, and the object is served from its intact disk copy."""
    tokens, kv = prompt_kv(3, 3 * N)
    with open_store(tmp_path, write_through=True) as store:
        keys = store.put_prompt(identity, PUBLIC, tokens, kv).keys
        scribble(store, keys[0])
        report = store.check()
        assert not report.clean and report.bad_keys == [keys[0]]
        assert any("sealed" in p for p in report.problems)
        assert store.counters.sealed_mismatch == 1 and store.counters.corrupt == 1
        assert keys[0] not in store.tier("dram").replica_keys()
        res = store.load(store.lookup(identity, PUBLIC, tokens))
        assert res.loaded == 3 and res.tiers == {"disk": 1, "dram": 2}
        for i, a in enumerate(res.arrays):
            assert np.array_equal(a, chunk(kv, i))
        store.drain()
        assert store.check().clean


def test_check_invalidates_an_object_whose_only_replica_changed(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    tokens, kv = prompt_kv(4, 3 * N)
    with open_store(tmp_path) as store:
        keys = store.put_prompt(identity, PUBLIC, tokens, kv).keys
        scribble(store, keys[1])
        assert store.check().bad_keys == [keys[1]]
        assert keys[1] not in store.indexed_keys()
        assert store.lookup(identity, PUBLIC, tokens).tokens == N


def test_verify_dram_on_load_turns_a_changed_replica_into_a_counted_miss(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """Loads with and without buffers, and asynchronous ones: the changed chunk ends the
    result as corrupt (nothing of it copied out), its object is invalidated."""
    with open_store(tmp_path, dram_chunks=9, verify_dram_on_load=True) as store:
        for seed, mode in ((5, "view"), (6, "into"), (7, "async")):
            tokens, kv = prompt_kv(seed, 3 * N)
            keys = store.put_prompt(identity, PUBLIC, tokens, kv).keys
            scribble(store, keys[1])
            hit = store.lookup(identity, PUBLIC, tokens)
            outs = [np.zeros(TINY.chunk_shape, np.float16) for _ in range(3)]
            if mode == "view":
                res = store.load(hit)
            elif mode == "into":
                res = store.load(hit, outs)
                assert not outs[1].any(), "a changed replica was copied out"
            else:
                res = store.load_async(hit).wait(timeout=10)
            assert res.loaded == 1 and res.corrupt == [keys[1]]
            assert np.array_equal(res.arrays[0], chunk(kv, 0))
            assert keys[1] not in store.indexed_keys()
        assert store.counters.sealed_mismatch == 3


def test_seals_are_taken_over_not_recomputed(tmp_path: Path, identity: ModelIdentity) -> None:
    """A write-through frame carries the DRAM seal; a promoted replica's seal is the
    checksum its disk read verified; both are the xxh3-128 of the chunk's bytes."""
    tokens, kv = prompt_kv(6, 3 * N)
    with open_store(tmp_path, write_through=True) as store:
        keys = store.put_prompt(identity, PUBLIC, tokens, kv).keys
        dram, disk = store.tier("dram"), store.tier("disk")
        for i, k in enumerate(keys):
            want = bytes(xxhash.xxh3_128_digest(chunk(kv, i).tobytes()))
            assert dram.meta(k).checksum == disk.meta(k).checksum == want
        store.evict("dram", 3 * C)
        store.load(store.lookup(identity, PUBLIC, tokens))
        store.drain()
        for k in keys:
            assert dram.meta(k).checksum == disk.meta(k).checksum
        assert store.check().clean


def test_a_client_writing_its_extent_after_the_commit_is_caught_by_the_server(
    tmp_path: Path,
) -> None:
    """Through ``kvlife serve``: a put's chunks are adopted from the extents the client
    wrote; a buggy client that writes one again after the commit is caught by the
    server's seal (a load with ``--verify-dram-on-load`` is a corrupt miss, and
    ``check`` through the socket would report it) instead of being served."""
    srv = ServerProc(tmp_path / "store", extra=("--verify-dram-on-load",)).start()
    try:
        remote = srv.client()
        ident = tiny_identity()
        tokens, kv = prompt_kv(7, 3 * N)
        remote.put_prompt(ident, PUBLIC, tokens, kv)
        tokens2, kv2 = prompt_kv(8, 3 * N)
        remote.put_prompt(ident, PUBLIC, tokens2, kv2)  # adopted from staged extents
        hit = remote.lookup(ident, PUBLIC, tokens2)
        assert isinstance(hit, RemoteLookup)
        assert len(hit.hints) == 6 and hit.hints[3]
        arena = Path(remote.info().tiers[0].details["arena"])
        with arena.open("r+b") as fh, mmap.mmap(fh.fileno(), 0) as mm:
            mm[hit.hints[2] + 11] ^= 0xFF  # chunk 1, after its commit
        res = remote.load(hit)
        assert res.loaded == 1 and len(res.corrupt) == 1
        assert remote.info().counters["sealed_mismatch"] == 1
        assert remote.lookup(ident, PUBLIC, tokens2).tokens == N
        good = remote.load(remote.lookup(ident, PUBLIC, tokens))
        assert good.loaded == 3
        for i, a in enumerate(good.arrays):
            assert np.array_equal(a, chunk(kv, i))
        remote.close()
    finally:
        srv.stop()


def test_check_through_the_server_finds_an_extent_written_after_its_commit(
    tmp_path: Path,
) -> None:
    srv = ServerProc(tmp_path / "store").start()
    try:
        remote = srv.client()
        ident = tiny_identity()
        tokens, kv = prompt_kv(9, 2 * N)
        remote.put_prompt(ident, PUBLIC, tokens, kv)
        hit = remote.lookup(ident, PUBLIC, tokens)
        assert isinstance(hit, RemoteLookup)
        arena = Path(remote.info().tiers[0].details["arena"])
        with arena.open("r+b") as fh, mmap.mmap(fh.fileno(), 0) as mm:
            mm[hit.hints[0] + 3] ^= 0x0F
        report = remote.check()
        assert not report.clean and len(report.bad_keys) == 1
        assert remote.lookup(ident, PUBLIC, tokens).tokens == 0
        remote.close()
    finally:
        srv.stop()


def test_a_demotion_into_a_transforming_tier_verifies_the_seal_before_encoding(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """Encoding changes the bytes, so the disk cannot check the seal: it is checked as
    the replica is read, before the encoder sees it."""
    config = StoreConfig(
        tiers=(
            TierSpec("memory", "dram", 3 * C),
            TierSpec(
                "disk", "disk", 1 << 24, options=(("segment_bytes", 1 << 20),), transform="lossless"
            ),
        )
    )
    tokens, kv = prompt_kv(10, 3 * N)
    with KVStore(tmp_path, config) as store:
        keys = store.put_prompt(identity, PUBLIC, tokens, kv).keys
        store.lookup(identity, PUBLIC, tokens[: 2 * N])
        scribble(store, keys[2])
        store.evict("dram", C)
        assert store.counters.sealed_mismatch == 1 and store.counters.encoded == 0
        assert store.tier("disk").replica_keys() == []
        store.evict("dram", 2 * C)  # the intact ones go down encoded
        assert store.counters.encoded == 2 and store.counters.sealed_mismatch == 1


@pytest.mark.parametrize("tier_kind", ["disk", "memory"])
def test_a_tier_checks_a_payload_against_the_checksum_it_is_asked_to_verify(
    tmp_path: Path, tier_kind: str
) -> None:
    """The tiers' side: ``verify_checksum`` makes a write fail (typed, nothing stored)
    when the payload differs from the checksum; without it the checksum is taken as
    given (not hashed again); with none the tier hashes the payload itself."""
    tier: DiskTier | MemoryTier
    if tier_kind == "disk":
        tier = DiskTier(tmp_path / "d", DiskTierConfig(capacity_bytes=1 << 24))
    else:
        tier = MemoryTier(1 << 24)
    try:
        a = np.arange(4096, dtype=np.uint8)
        right = bytes(xxhash.xxh3_128_digest(a.tobytes()))
        wrong = bytes(16)
        k1, k2, k3, k4 = (ChunkKey(bytes([i]) * 32) for i in range(1, 5))
        with pytest.raises(ChecksumMismatch):
            tier.store(
                [ReplicaMeta(k1, "uint8", a.shape, checksum=wrong, verify_checksum=True)], [a]
            )
        assert not tier.contains(k1) and tier.used_bytes == 0
        tier.store([ReplicaMeta(k2, "uint8", a.shape, checksum=right, verify_checksum=True)], [a])
        tier.store([ReplicaMeta(k3, "uint8", a.shape)], [a])
        assert tier.meta(k2).checksum == tier.meta(k3).checksum == right
        tier.store([ReplicaMeta(k4, "uint8", a.shape, checksum=wrong)], [a])  # vouched for
        assert tier.meta(k4).checksum == wrong
        (res,) = tier.read_verified([k4]) if isinstance(tier, MemoryTier) else tier.read_batch([k4])
        assert isinstance(res, ChecksumMismatch), "a wrong checksum taken as given is a miss"
    finally:
        tier.close()


@pytest.mark.parametrize("wrong", ["shape", "dtype"])
def test_a_replica_read_back_in_another_shape_or_dtype_is_never_served(
    tmp_path: Path, identity: ModelIdentity, wrong: str
) -> None:
    """The last check before an array reaches the engine: the bytes a tier hands back
    (the same bytes, so every seal still matches) in a dtype or shape other than the
    object's are a corrupt replica (counted, invalidated, a miss), never written into
    the engine's cache as this chunk."""
    tokens, kv = prompt_kv(1, 2 * N)
    with open_store(tmp_path) as store:
        keys = store.put_prompt(identity, PUBLIC, tokens, kv).keys
        dram = store.tier("dram")
        held = dram._held[keys[1]]  # type: ignore[attr-defined]
        arr = held.array.reshape(-1) if wrong == "shape" else held.array.view(np.uint8)
        dram._held[keys[1]] = type(held)(held.meta, arr, held.owner, None)  # type: ignore[attr-defined]
        got = store.load(store.lookup(identity, PUBLIC, tokens))
        assert got.loaded == 1 and got.corrupt == [keys[1]]
        np.testing.assert_array_equal(got.arrays[0], chunk(kv, 0))
        assert store.counters.corrupt == 1
        again = store.lookup(identity, PUBLIC, tokens)
        assert len(again.hits) == 1  # the object was taken out of service

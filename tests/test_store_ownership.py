"""Who owns the memory (issue 18, hole 6): nothing handed to a caller and no caller
buffer ever becomes a replica; an array a load returns that shares memory with a
replica (a DRAM hit) is read-only from the start and cannot be made writable.

Every path is attacked the way an engine using returned arrays as scratch would: write
into what a call returned, or into the buffers it was given, right after the call (while
the background promotion or demotion it started runs) and later, then check what the
store serves from every tier."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from kvlife.core.identity import PUBLIC, ChunkKey, ModelIdentity
from kvlife.store import Accept, KVStore, StoreConfig, TierSpec
from kvlife.tiers.base import ReplicaMeta
from kvlife.tiers.memory import MemoryTier
from kvlife.tiers.shm import ShmTier
from tests.conftest import TINY, prompt_kv

C = TINY.chunk_nbytes
N = TINY.tokens_per_chunk


def chunks(kv: np.ndarray, n: int) -> list[np.ndarray]:
    return [np.ascontiguousarray(kv[:, :, :, i * N : (i + 1) * N, :]) for i in range(n)]


def open_store(path: Path, dram_chunks: int = 8, **kw: Any) -> KVStore:
    return KVStore.open(
        path, dram_bytes=dram_chunks * C, disk_bytes=1 << 24, segment_bytes=1 << 20, **kw
    )


def on_disk_only(
    path: Path, identity: ModelIdentity, seed: int, n: int = 3
) -> tuple[np.ndarray, np.ndarray]:
    """A store whose chunks are on disk only (put without a DRAM tier)."""
    tokens, kv = prompt_kv(seed, n * N)
    with open_store(path, dram_chunks=0) as store:
        store.put_prompt(identity, PUBLIC, tokens, kv)
    return tokens, kv


def seal_of(a: np.ndarray) -> bytes:
    """The seal a replica of ``a`` must carry: the xxh3-128 of its bytes."""
    return bytes(xxhash.xxh3_128_digest(a.tobytes()))


def attack(arrays: Sequence[np.ndarray]) -> None:
    """Every way numpy offers to write into a returned array must be refused."""
    for a in arrays:
        assert not a.flags.writeable, "a returned array is writable"
        with pytest.raises(ValueError):
            a[...] = 7
        with pytest.raises(ValueError):
            a.flags.writeable = True  # the flag cannot be set back
        with pytest.raises(ValueError):
            a.reshape(-1)[0] = 1
        with pytest.raises(ValueError):
            np.frombuffer(a, np.uint8).flags.writeable = True
        with pytest.raises((ValueError, TypeError)):
            a.reshape(-1).view(np.uint8).data[0] = 0


def served_from(
    store: KVStore, identity: ModelIdentity, tokens: np.ndarray, tier: str
) -> list[np.ndarray]:
    res = store.load(store.lookup(identity, PUBLIC, tokens))
    assert res.tiers == {tier: res.loaded}, f"expected hits from {tier}, got {res.tiers}"
    return res.arrays


def test_a_disk_hit_loaded_without_buffers_never_becomes_a_writable_replica(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """The issue's sequence: a disk hit loaded without output buffers, written into as
    scratch, drained; the next load (from DRAM, promoted) must serve the put's bytes."""
    tokens, kv = on_disk_only(tmp_path, identity, 1)
    with open_store(tmp_path) as store:
        first = store.load(store.lookup(identity, PUBLIC, tokens))
        assert first.tiers == {"disk": 3}
        attack(first.arrays)  # at once: while the background promotion runs
        store.drain()
        attack(first.arrays)  # and after it copied them
        again = served_from(store, identity, tokens, "dram")
        for a, want in zip(again, chunks(kv, 3), strict=True):
            assert np.array_equal(a, want), "the DRAM replica is not what was put"
        attack(again)
        for handed, replica in zip(first.arrays, again, strict=True):
            assert not np.shares_memory(handed, replica), "a returned array became a replica"


def test_an_async_load_hands_out_read_only_chunks(tmp_path: Path, identity: ModelIdentity) -> None:
    tokens, kv = on_disk_only(tmp_path, identity, 2)
    with open_store(tmp_path) as store:
        handle = store.load_async(store.lookup(identity, PUBLIC, tokens), depth=1)
        got = [handle.chunk(i, timeout=10) for i in range(3)]
        assert all(a is not None for a in got)
        attack([a for a in got if a is not None])
        attack(handle.wait(timeout=10).arrays)
        store.drain()
        again = served_from(store, identity, tokens, "dram")
        for a, handed, want in zip(again, got, chunks(kv, 3), strict=True):
            assert np.array_equal(a, want)
            assert not np.shares_memory(a, handed), "a returned chunk became a replica"


def test_a_dram_hit_is_a_view_nobody_can_make_writable(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    tokens, kv = prompt_kv(3, 3 * N)
    with open_store(tmp_path) as store:
        store.put_prompt(identity, PUBLIC, tokens, kv)
        got = served_from(store, identity, tokens, "dram")
        attack(got)
        for a, want in zip(
            served_from(store, identity, tokens, "dram"), chunks(kv, 3), strict=True
        ):
            assert np.array_equal(a, want)


def test_buffers_given_to_a_load_stay_the_callers(tmp_path: Path, identity: ModelIdentity) -> None:
    """A disk hit loaded into the caller's buffers: the buffers are written, never
    adopted; scribbling on them during and after the promotion changes no replica."""
    tokens, kv = on_disk_only(tmp_path, identity, 4)
    with open_store(tmp_path) as store:
        outs = [np.empty(TINY.chunk_shape, np.float16) for _ in range(3)]
        res = store.load(store.lookup(identity, PUBLIC, tokens), outs)
        assert res.loaded == 3 and all(a is o for a, o in zip(res.arrays, outs, strict=True))
        for o in outs:
            o[...] = 7  # while the promotion runs
        store.drain()
        for o in outs:
            o[...] = 9
        for a, want in zip(
            served_from(store, identity, tokens, "dram"), chunks(kv, 3), strict=True
        ):
            assert np.array_equal(a, want)
        # the same for DRAM hits into buffers
        outs2 = [np.empty(TINY.chunk_shape, np.float16) for _ in range(3)]
        store.load(store.lookup(identity, PUBLIC, tokens), outs2)
        for o in outs2:
            o[...] = 5
        for a, want in zip(
            served_from(store, identity, tokens, "dram"), chunks(kv, 3), strict=True
        ):
            assert np.array_equal(a, want)


@pytest.mark.parametrize("write_through", [False, True])
def test_arrays_a_put_was_given_stay_the_callers(
    tmp_path: Path, identity: ModelIdentity, write_through: bool
) -> None:
    """The caller's put arrays are copied: writing into them after the commit changes
    neither the DRAM replica nor the disk replica a demotion later writes."""
    tokens, kv = prompt_kv(5, 3 * N)
    with open_store(tmp_path, write_through=write_through) as store:
        pieces = [c.copy() for c in chunks(kv, 3)]
        pending = store.prepare_put(identity, PUBLIC, tokens, pieces)
        store.commit_put(pending)
        for p in pieces:
            p[...] = 3
        for a, want in zip(
            served_from(store, identity, tokens, "dram"), chunks(kv, 3), strict=True
        ):
            assert np.array_equal(a, want)
        store.evict("dram", 3 * C)  # demoted (or dropped from DRAM when written through)
        for a, want in zip(
            served_from(store, identity, tokens, "disk"), chunks(kv, 3), strict=True
        ):
            assert np.array_equal(a, want)
        store.drain()


def test_a_decoded_frame_is_handed_out_read_only(tmp_path: Path, identity: ModelIdentity) -> None:
    """A disk tier that stores frames (lossless): the decoded array a load returns is
    read-only too, and the promotion that adopts it serves the put's bytes."""
    config = StoreConfig(
        tiers=(
            TierSpec("memory", "dram", 8 * C),
            TierSpec(
                "disk",
                "disk",
                1 << 24,
                options=(("segment_bytes", 1 << 20),),
                transform="lossless",
            ),
        )
    )
    tokens, kv = prompt_kv(6, 3 * N)
    with KVStore(tmp_path, config) as store:
        store.put_prompt(identity, PUBLIC, tokens, kv)
        store.evict("dram", 3 * C)
        res = store.load(store.lookup(identity, PUBLIC, tokens, accept=Accept.LOSSLESS))
        assert res.tiers == {"disk": 3} and res.decoded == 3
        attack(res.arrays)
        store.drain()
        again = store.load(store.lookup(identity, PUBLIC, tokens, accept=Accept.LOSSLESS))
        assert again.tiers == {"dram": 3}
        for a, want in zip(again.arrays, chunks(kv, 3), strict=True):
            assert np.array_equal(a, want)
        # the promoted replicas are sealed with the decoded bytes' checksum, not the frame's
        assert store.check().clean
        store.evict("dram", 3 * C)
        assert store.counters.sealed_mismatch == 0


def test_memory_tier_replicas_are_read_only_exports_and_memory_is_recycled_only_when_free() -> None:
    """The DRAM tier's own contract: a stored replica is sealed, handed out as a view no
    holder can make writable, and its buffer goes back to the pool only once no view of
    it is alive (a live view never sees another replica's bytes)."""
    tier = MemoryTier(1 << 20)
    key, other = ChunkKey(bytes(range(32))), ChunkKey(bytes(range(1, 33)))
    a = np.arange(2048, dtype=np.float16).reshape(4, 512)
    tier.store([ReplicaMeta(key, "float16", a.shape)], [a])
    assert tier.meta(key).checksum == seal_of(a)
    view = tier.read(key)
    attack([view])
    part = view[1]
    tier.delete(key)
    tier.store([ReplicaMeta(other, "float16", a.shape)], [np.zeros_like(a)])
    assert np.array_equal(part, a[1]), "a live view saw its memory reused"
    assert np.array_equal(view, a)


def test_shm_tier_replicas_are_sealed_read_only_exports(tmp_path: Path) -> None:
    tier = ShmTier(1 << 20, "shm", tmp_path / "arena", 1 << 20)
    try:
        key = ChunkKey(bytes(range(32)))
        a = np.arange(2048, dtype=np.float16).reshape(4, 512)
        tier.store([ReplicaMeta(key, "float16", a.shape)], [a])
        assert tier.meta(key).checksum == seal_of(a)
        attack([tier.read(key)])
        assert tier.check().clean
    finally:
        tier.close()

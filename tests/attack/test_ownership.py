"""Attacks on who owns the memory of a load (issue 18, hole 6; README, "Ownership of
returned arrays"): output buffers that alias one another or a replica, buffers of
every layout, and the ``base`` chain of an array a load returned."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvlife.core.errors import InvalidArgument
from kvlife.core.identity import PUBLIC, ModelIdentity
from kvlife.store import KVStore
from tests.conftest import TINY, prompt_kv

C = TINY.chunk_nbytes
N = TINY.tokens_per_chunk


def chunks(kv: np.ndarray, n: int) -> list[np.ndarray]:
    return [np.ascontiguousarray(kv[:, :, :, i * N : (i + 1) * N, :]) for i in range(n)]


def open_store(path: Path) -> KVStore:
    return KVStore.open(path, dram_bytes=8 * C, disk_bytes=1 << 24, segment_bytes=1 << 20)


@pytest.mark.parametrize("tier", ["dram", "disk"])
@pytest.mark.parametrize("asynchronous", [False, True])
def test_output_buffers_that_share_memory_are_refused(
    tmp_path: Path, identity: ModelIdentity, tier: str, asynchronous: bool
) -> None:
    """``load(hit, [buf] * n)`` (one scratch buffer reused for every chunk) reported
    every chunk loaded while ``arrays[0]`` held the last chunk's bytes: wrong KV for
    chunk 0, served as success. Overlapping slices of one array did the same. Now an
    InvalidArgument naming the two buffers, before anything is read or pinned."""
    tokens, kv = prompt_kv(1, 3 * N)
    with open_store(tmp_path) as store:
        store.put_prompt(identity, PUBLIC, tokens, kv)
        if tier == "disk":
            store.evict("dram", 8 * C)
        hit = store.lookup(identity, PUBLIC, tokens)
        assert hit.hits and hit.hits[0].tier == tier
        buf = np.empty(TINY.chunk_shape, np.float16)
        wide = np.empty((*TINY.chunk_shape[:3], 4 * N, TINY.head_dim), np.float16)
        overlapping = [wide[:, :, :, i * (N // 2) : i * (N // 2) + N, :] for i in range(3)]
        for outs in ([buf, buf, buf], overlapping):
            with pytest.raises(InvalidArgument, match="share memory"):
                if asynchronous:
                    store.load_async(hit, outs).wait(10)
                else:
                    store.load(hit, outs)
        store.drain()
        assert not store._core.pinned, "a refused load left pins behind"
        res = store.load(store.lookup(identity, PUBLIC, tokens))
        assert all(np.array_equal(a, w) for a, w in zip(res.arrays, chunks(kv, 3), strict=True))


def test_a_read_only_output_buffer_is_a_typed_error(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """Another prompt's returned DRAM replicas given back as output buffers: numpy's
    untyped ValueError came out of the read (and out of ``wait()`` for an async load);
    bad input is an InvalidArgument, and the replicas are unchanged."""
    t1, kv1 = prompt_kv(2, 3 * N)
    t2, kv2 = prompt_kv(3, 3 * N)
    with open_store(tmp_path) as store:
        store.put_prompt(identity, PUBLIC, t1, kv1)
        store.put_prompt(identity, PUBLIC, t2, kv2)
        replicas = store.load(store.lookup(identity, PUBLIC, t1)).arrays
        with pytest.raises(InvalidArgument, match="read-only"):
            store.load(store.lookup(identity, PUBLIC, t2), replicas)
        with pytest.raises(InvalidArgument, match="read-only"):
            store.load_async(store.lookup(identity, PUBLIC, t2), replicas)
        again = store.load(store.lookup(identity, PUBLIC, t1)).arrays
        assert all(np.array_equal(a, w) for a, w in zip(again, chunks(kv1, 3), strict=True))


@pytest.mark.parametrize("tier", ["dram", "disk"])
def test_strided_and_fortran_buffers_receive_the_right_bytes(
    tmp_path: Path, identity: ModelIdentity, tier: str
) -> None:
    """Held (a near-miss): chunk slices of one wide buffer (not contiguous, disjoint)
    and Fortran-ordered buffers are legal and are filled right, from DRAM and disk."""
    tokens, kv = prompt_kv(4, 3 * N)
    with open_store(tmp_path) as store:
        store.put_prompt(identity, PUBLIC, tokens, kv)
        wide = np.empty((*TINY.chunk_shape[:3], 3 * N, TINY.head_dim), np.float16)
        layouts = [
            [wide[:, :, :, i * N : (i + 1) * N, :] for i in range(3)],
            [np.asfortranarray(np.empty(TINY.chunk_shape, np.float16)) for _ in range(3)],
        ]
        for outs in layouts:
            if tier == "disk":
                store.evict("dram", 8 * C)
            res = store.load(store.lookup(identity, PUBLIC, tokens), outs)
            assert res.loaded == 3 and res.tiers == {tier: 3}
            assert all(np.array_equal(a, w) for a, w in zip(outs, chunks(kv, 3), strict=True))
            store.drain()


def _writable_alias(arr: np.ndarray) -> np.ndarray:
    """Down the ``base`` chain to the memoryview numpy exported the replica through,
    then its ``obj``: the array the memoryview was taken of."""
    b: object = arr
    while b is not None and not isinstance(b, memoryview):
        b = getattr(b, "base", None)
    assert isinstance(b, memoryview)
    obj = b.obj
    assert isinstance(obj, np.ndarray)
    return obj


def test_memory_written_behind_numpys_back_is_caught_by_the_seal(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """The boundary README states: read-only arrays stop ordinary writes, but code in the
    same process that defeats numpy's flag (here two attribute hops, ``arr.base.base.obj``,
    to the array under the export; ctypes would do as well) can write a replica in place:
    no Python-level export stops that. What such a write cannot do is stay unnoticed:
    ``check`` reports and drops the replica (counted), a verified load misses it, and a
    later lookup serves nothing changed."""
    tokens, kv = prompt_kv(5, 3 * N)
    with open_store(tmp_path) as store:
        store.put_prompt(identity, PUBLIC, tokens, kv)
        got = store.load(store.lookup(identity, PUBLIC, tokens)).arrays
        alias = _writable_alias(got[0])
        assert alias.flags.writeable and np.shares_memory(alias, got[0])
        alias.reshape(-1).view(np.uint8)[:8] ^= 0xFF
        del got, alias
        before = store.counters.sealed_mismatch
        report = store.check()
        assert not report.clean
        assert store.counters.sealed_mismatch == before + 1
        res = store.load(store.lookup(identity, PUBLIC, tokens))
        want = chunks(kv, 3)
        assert res.loaded == 0 or np.array_equal(res.arrays[0], want[0])
        assert all(np.array_equal(a, w) for a, w in zip(res.arrays, want, strict=False))

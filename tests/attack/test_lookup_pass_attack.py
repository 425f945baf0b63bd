"""Attacks on the lookup in one pass (issue 28: ``Reader._leading_hits``, the hit record a
replica keeps in ``Replica.served``): after every way a chunk's replicas can change
under a kept hit record (invalidated, re-put with other bytes, demoted into a lossy
tier, promoted back decoded, evicted, invalidated by another thread between lookup and
load), a lookup answers what the general path answers, hit for hit, and a load never
returns bytes other than the chunk's own (a miss is fine)."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvlife.core.identity import PUBLIC, ChunkKey
from kvlife.results import LookupResult
from kvlife.store import KVStore
from kvlife.store.config import StoreConfig
from kvlife.store.core import StoreCore
from kvlife.tiers.spec import TierSpec
from kvlife.transforms.contract import Accept
from tests.conftest import TINY, prompt_kv, tiny_identity
from tests.test_store_lookup_pass import general_path

IDENT = tiny_identity()
N = TINY.tokens_per_chunk
CHUNK = TINY.chunk_nbytes
DISK_OPTS = (("segment_bytes", 1 << 20),)
INT4 = (("key_group", 16), ("value_group", 8))
ACCEPTS = (
    Accept.EXACT,
    Accept.LOSSLESS,
    Accept.lossy(),
    Accept.lossy(transforms=["int8"]),  # int8-only: refuses int4, takes exact
)


def chunk_of(kv: np.ndarray, i: int) -> np.ndarray:
    return np.ascontiguousarray(kv[:, :, :, i * N : (i + 1) * N, :])


def core_of(store: KVStore) -> StoreCore:
    return store._reader.core


def answers_as_general_path(
    store: KVStore, tokens: np.ndarray, accept: Accept, keys: list[ChunkKey], offset: int = 0
) -> LookupResult:
    """Look up twice (the second reuses the hit records of the first) and check both
    against the general path; returns the second."""
    got: LookupResult | None = None
    for _ in range(2):
        got = store.lookup(
            IDENT,
            PUBLIC,
            tokens[offset * N :],
            start=offset * N,
            parent=keys[offset - 1] if offset else bytes(32),  # type: ignore[arg-type]
            accept=accept,
        )
        core = core_of(store)
        with core.lock:
            want, refusal = general_path(core, keys[offset:], offset * N, accept)
        assert got.hits == want and got.refusal == refusal
    assert got is not None
    return got


def exact_chunks(got: list[np.ndarray], kv: np.ndarray, first: int = 0) -> None:
    for i, arr in enumerate(got):
        assert np.array_equal(arr, chunk_of(kv, first + i)), f"chunk {first + i}: wrong KV"


def lossy_store(path: Path) -> KVStore:
    """DRAM (exact) over a disk tier that stores int4 frames."""
    return KVStore(
        path,
        StoreConfig(
            tiers=(
                TierSpec("memory", "dram", 8 * CHUNK),
                TierSpec(
                    "disk",
                    "disk",
                    1 << 24,
                    options=DISK_OPTS,
                    transform="int4",
                    transform_params=INT4,
                ),
            )
        ),
    )


def test_a_chunk_re_put_with_other_bytes_serves_its_new_bytes(tmp_path: Path) -> None:
    """Hit records kept on the replicas of a prompt's chunks, the chunks invalidated and
    the same prompt stored again with other KV: the lookup names the new replicas and
    the load returns the new bytes (an old lookup's load too)."""
    tokens, kv = prompt_kv(21, 4 * N)
    _, other = prompt_kv(22, 4 * N)
    with KVStore.open(tmp_path, dram_bytes=1 << 22, disk_bytes=1 << 24) as store:
        keys = store.put_prompt(IDENT, PUBLIC, tokens, kv).keys
        for offset in (0, 2, 0):  # another prompt start, then back
            answers_as_general_path(store, tokens, Accept.EXACT, keys, offset)
        old = store.lookup(IDENT, PUBLIC, tokens)
        assert store.invalidate(prefix=keys[0]) == 4
        gone = answers_as_general_path(store, tokens, Accept.EXACT, keys)
        assert gone.hits == [] and store.load(old).loaded == 0
        assert store.put_prompt(IDENT, PUBLIC, tokens, other).stored == 4
        new = answers_as_general_path(store, tokens, Accept.EXACT, keys)
        assert len(new.hits) == 4
        exact_chunks(store.load(new).arrays, other)
        exact_chunks(store.load(old).arrays, other)  # by key: the chunk stored now


def test_demoted_into_a_lossy_tier_no_exact_hit_survives(tmp_path: Path) -> None:
    """Exact hit records kept on DRAM replicas, then DRAM evicted so that only int4
    frames are left: no Accept that refuses int4 hits, an old exact lookup's load is a
    miss (never int4 values as exact), and after a lossy load promotes the decoded
    values into DRAM (a READY DRAM replica again, not exact) still no exact hit."""
    tokens, kv = prompt_kv(23, 4 * N)
    with lossy_store(tmp_path) as store:
        keys = store.put_prompt(IDENT, PUBLIC, tokens, kv).keys
        assert store.flush() == 4
        for accept in ACCEPTS:
            hit = answers_as_general_path(store, tokens, accept, keys)
            assert [h.tier for h in hit.hits] == ["dram"] * 4
        old = store.lookup(IDENT, PUBLIC, tokens)
        store.evict("dram", 8 * CHUNK)
        for accept in ACCEPTS:
            got = answers_as_general_path(store, tokens, accept, keys)
            assert len(got.hits) == (4 if accept is ACCEPTS[2] else 0)
        assert store.load(old).loaded == 0
        lossy = answers_as_general_path(store, tokens, Accept.lossy(), keys)
        res = store.load(lossy)
        assert res.loaded == 4 and res.representations == {"int4": 4}
        store.drain()  # the promotion into DRAM ran
        core = core_of(store)
        with core.lock:
            recs = [core.index.get(k) for k in keys]
            assert all(r is not None and "dram" in r.replicas for r in recs)
        for accept in ACCEPTS:
            got = answers_as_general_path(store, tokens, accept, keys)
            assert all(h.transform == "int4" for h in got.hits)
            assert len(got.hits) == (4 if accept is ACCEPTS[2] else 0)
        assert store.load(old).loaded == 0


@pytest.mark.parametrize("asynchronous", [False, True])
def test_an_invalidation_between_lookup_and_load_is_a_miss(
    tmp_path: Path, asynchronous: bool
) -> None:
    """Another thread invalidates the prompt between a lookup that reused its hit
    records and the load: nothing is served."""
    tokens, kv = prompt_kv(24, 4 * N)
    with KVStore.open(tmp_path, dram_bytes=1 << 22, disk_bytes=1 << 24) as store:
        keys = store.put_prompt(IDENT, PUBLIC, tokens, kv).keys
        hit = answers_as_general_path(store, tokens, Accept.EXACT, keys)
        t = threading.Thread(target=store.invalidate, kwargs={"prefix": keys[0]})
        t.start()
        t.join()
        res = store.load_async(hit).wait() if asynchronous else store.load(hit)
        assert res.loaded == 0 and res.arrays == [] and res.vanished == 4


def test_an_evicted_chunk_answers_from_its_new_tier(tmp_path: Path) -> None:
    """DRAM hit records kept, DRAM evicted (demoted to disk): the lookup says disk, the
    load returns the chunk's bytes; promoted back, it says DRAM again."""
    tokens, kv = prompt_kv(25, 4 * N)
    with KVStore.open(tmp_path, dram_bytes=8 * CHUNK, disk_bytes=1 << 24) as store:
        keys = store.put_prompt(IDENT, PUBLIC, tokens, kv).keys
        first = answers_as_general_path(store, tokens, Accept.EXACT, keys)
        assert [h.tier for h in first.hits] == ["dram"] * 4
        store.evict("dram", 8 * CHUNK)
        hit = answers_as_general_path(store, tokens, Accept.EXACT, keys)
        assert [h.tier for h in hit.hits] == ["disk"] * 4
        exact_chunks(store.load(hit).arrays, kv)
        store.drain()
        back = answers_as_general_path(store, tokens, Accept.EXACT, keys)
        assert [h.tier for h in back.hits] == ["dram"] * 4
        exact_chunks(store.load(back).arrays, kv)


def test_a_kept_hit_record_is_shared_but_no_caller_can_change_it(tmp_path: Path) -> None:
    """Two lookups of one prompt hand out the same hit records (kept on the replicas):
    frozen, so a caller cannot change what the next caller gets; each answer's list is
    its own."""
    tokens, kv = prompt_kv(26, 4 * N)
    with KVStore.open(tmp_path, dram_bytes=1 << 22, disk_bytes=0) as store:
        keys = store.put_prompt(IDENT, PUBLIC, tokens, kv).keys
        a = store.lookup(IDENT, PUBLIC, tokens)
        b = store.lookup(IDENT, PUBLIC, tokens)
        assert a.hits[0] is b.hits[0]  # the kept record
        for field, value in (("key", keys[1]), ("index", 3), ("tier", "disk"), ("start", 0)):
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(a.hits[0], field, value)
        a.hits.reverse()
        a.hits.pop()
        c = store.lookup(IDENT, PUBLIC, tokens)
        assert [h.key for h in b.hits] == [h.key for h in c.hits] == keys
        exact_chunks(store.load(c).arrays, kv)


def test_concurrent_re_puts_and_evictions_never_mix_or_swap_bytes(tmp_path: Path) -> None:
    """One thread looks up (reusing the kept hit records) and loads, in a loop; another
    invalidates the prompt and stores it again with the other of two KV versions, and
    evicts DRAM, in a loop. Every load returns a leading run of one version's chunks,
    in order (a shorter run or a miss is fine)."""
    tokens, _ = prompt_kv(30, 4 * N)
    versions = [prompt_kv(31, 4 * N)[1], prompt_kv(32, 4 * N)[1]]
    stop = threading.Event()
    errors: list[BaseException] = []
    with KVStore.open(tmp_path, dram_bytes=8 * CHUNK, disk_bytes=1 << 24) as store:
        keys = store.put_prompt(IDENT, PUBLIC, tokens, versions[0]).keys

        def churn() -> None:
            try:
                v = 0
                rounds = 0
                while not stop.is_set():
                    store.invalidate(prefix=keys[0])
                    v = 1 - v
                    store.put_prompt(IDENT, PUBLIC, tokens, versions[v])
                    rounds += 1
                    # let the reader find the prompt stored: a longer window every eighth
                    # round, so that a slow (busy) machine's reader still gets some loads
                    time.sleep(0.001 if rounds % 8 else 0.01)
                    store.evict("dram", 2 * CHUNK)
                    time.sleep(0.001)
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        t = threading.Thread(target=churn)
        t.start()
        loaded = 0
        deadline = time.monotonic() + 60
        try:
            i = 0
            # 300 rounds, and on until some chunk loaded (none would make it vacuous)
            while i < 300 or (not loaded and time.monotonic() < deadline):
                i += 1
                hit = store.lookup(IDENT, PUBLIC, tokens)
                got = (store.load_async(hit).wait() if i % 2 else store.load(hit)).arrays
                loaded += len(got)
                if got:
                    v = next(
                        (
                            j
                            for j, kv in enumerate(versions)
                            if np.array_equal(got[0], chunk_of(kv, 0))
                        ),
                        None,
                    )
                    assert v is not None, "chunk 0 is neither version"
                    exact_chunks(got, versions[v])
        finally:
            stop.set()
            t.join()
        assert not errors, errors
        assert loaded > 0

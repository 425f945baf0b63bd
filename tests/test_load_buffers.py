"""A load whose replica vanished between the lookup and the read keeps none of the
caller's buffers once the caller drops its result: the miss is kept without its
traceback, whose frames held the load's items and buffers in a reference cycle that only
the collector freed (in ``kvlife serve`` the buffers are arena extents and clients'
shared memory; found 2026-12-06). Checked with the collector off, by weak references."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvlife.core.identity import PUBLIC
from kvlife.store import KVStore
from kvlife.tiers.spec import TierSpec
from tests.conftest import TINY, prompt_kv, tiny_identity

N = TINY.tokens_per_chunk


@pytest.fixture
def store(tmp_path: Path) -> Iterator[KVStore]:
    s = KVStore.open(
        tmp_path / "s",
        tiers=(TierSpec("memory", "dram", 1 << 20), TierSpec("disk", "disk", 8 << 20)),
    )
    yield s
    s.close(flush=False)  # a replica deleted under the store: nothing to flush from it


@pytest.mark.parametrize("how", ["load", "load_async"])
def test_a_load_with_a_vanished_replica_holds_no_buffer_after_it(store: KVStore, how: str) -> None:
    tokens, kv = prompt_kv(3, 3 * N)
    store.put_prompt(tiny_identity(), PUBLIC, tokens, kv)
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        res = store.lookup(tiny_identity(), PUBLIC, tokens)
        assert len(res.hits) == 3
        gone = res.hits[1]
        store.tier(gone.tier).delete(gone.key)  # as an eviction racing the load
        outs = [np.empty(TINY.chunk_shape, np.float16) for _ in range(3)]
        refs = [weakref.ref(o) for o in outs]
        got = store.load(res, outs) if how == "load" else store.load_async(res, outs).wait()
        assert got.loaded == 1 and got.vanished == 1  # a miss, counted
        assert np.array_equal(got.arrays[0].view(np.uint16), kv[:, :, :, :N].view(np.uint16))
        del got, outs, res, gone
        assert [r() for r in refs] == [None, None, None]
    finally:
        if was:
            gc.enable()

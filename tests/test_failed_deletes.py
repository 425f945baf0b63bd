"""An invalidation whose physical deletes fail (kvlife/store/deletes.py): the disk tier's
catalog cannot be written when the invalidated chunks' frames are deleted. The
invalidation holds in the process (nothing it covers is served), the caller gets a
typed ``StorePathError`` saying the replicas are still on disk, the replicas are
counted in ``deletes_failed``, and the close deletes them, so the next open does not
serve them again; where the close's delete fails too, the next open finds them (what
the error said), each with its own bytes. Real files, a real store reopened."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvlife.core.errors import StorePathError
from kvlife.core.identity import PUBLIC, ModelIdentity
from kvlife.faults.damage import flip, scan_frames
from kvlife.store import KVStore
from kvlife.tiers.disk.frame import HEADER_BYTES
from tests.conftest import TINY, prompt_kv
from tests.helpers.failing_deletes import fail_deletes
from tests.helpers.store_threads import assert_loads_exactly, wait_until
from tests.helpers.workload import disk_of

N = TINY.tokens_per_chunk
CHUNKS = 6


def _on_disk(path: Path, identity: ModelIdentity) -> tuple[KVStore, np.ndarray, np.ndarray]:
    store = KVStore.open(path, dram_bytes=1 << 20, disk_bytes=16 << 20)
    tokens, kv = prompt_kv(40, CHUNKS * N)
    assert store.put_prompt(identity, PUBLIC, tokens, kv).stored == CHUNKS
    store.flush()
    return store, tokens, kv


@pytest.mark.parametrize("how", ["namespace", "prefix"])
def test_an_invalidation_whose_delete_fails_is_a_typed_error_and_the_close_deletes_them(
    tmp_path: Path, identity: ModelIdentity, how: str
) -> None:
    store, tokens, _kv = _on_disk(tmp_path / "s", identity)
    try:
        failed = fail_deletes(store, 1)
        first = store.lookup(identity, PUBLIC, tokens).hits[0].key
        with pytest.raises(StorePathError, match="deleting their replicas failed"):
            if how == "namespace":
                store.invalidate(namespace=PUBLIC)
            else:
                store.invalidate(prefix=first)
        assert failed == [CHUNKS]
        assert store.lookup(identity, PUBLIC, tokens).tokens == 0  # it holds here
        assert store.counters.as_dict()["deletes_failed"] == CHUNKS  # the disk replicas
    finally:
        store.close()  # deletes them now
    with KVStore.open(tmp_path / "s", dram_bytes=1 << 20, disk_bytes=16 << 20) as again:
        assert again.lookup(identity, PUBLIC, tokens).tokens == 0


def test_a_delete_that_fails_at_close_too_leaves_the_chunks_for_the_next_open(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """What the error said: the next open finds them again, each with its own bytes."""
    store, tokens, kv = _on_disk(tmp_path / "s", identity)
    try:
        fail_deletes(store, 2)
        with pytest.raises(StorePathError, match="the next open"):
            store.invalidate(namespace=PUBLIC)
        assert store.lookup(identity, PUBLIC, tokens).tokens == 0
    finally:
        store.close()
    with KVStore.open(tmp_path / "s", dram_bytes=1 << 20, disk_bytes=16 << 20) as again:
        assert again.lookup(identity, PUBLIC, tokens).tokens == CHUNKS * N
        assert_loads_exactly(again, identity, tokens, kv, CHUNKS)


def test_the_close_leaves_a_chunk_put_again_since_its_delete_failed(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """The prompt's first two chunks put again after the failed delete: the close deletes
    only the four no record names, and the next open serves the two, exact."""
    store, tokens, kv = _on_disk(tmp_path / "s", identity)
    try:
        fail_deletes(store, 1)
        with pytest.raises(StorePathError):
            store.invalidate(namespace=PUBLIC)
        head_tokens, head_kv = tokens[: 2 * N], kv[:, :, :, : 2 * N, :]
        assert store.put_prompt(identity, PUBLIC, head_tokens, head_kv).stored == 2
        store.flush()
    finally:
        store.close()
    with KVStore.open(tmp_path / "s", dram_bytes=1 << 20, disk_bytes=16 << 20) as again:
        assert again.lookup(identity, PUBLIC, tokens).tokens == 2 * N
        assert_loads_exactly(again, identity, head_tokens, head_kv, 2)


def test_a_background_delete_that_fails_is_counted_not_lost(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """A load finds a disk frame damaged: the chunk is a counted miss, and the delete of
    its replica runs on the store's background thread. That delete failing was lost
    with its job; now it is counted, and the close deletes the frame."""
    store, tokens, _kv = _on_disk(tmp_path / "s", identity)
    try:
        store.evict("dram", 1 << 40)
        keys = [h.key for h in store.lookup(identity, PUBLIC, tokens).hits]
        frames = {f.key: f for f in scan_frames(tmp_path / "s")}
        bad = frames[keys[2]]
        flip(bad.segment, bad.offset + HEADER_BYTES + 5, 1)
        failed = fail_deletes(store, 1)
        got = store.get(identity, PUBLIC, tokens)
        assert got.loaded == 2 and got.corrupt
        store.drain()
        store.lookup(identity, PUBLIC, tokens)  # reaps what the load found lost
        wait_until(lambda: failed == [1], what="the background delete")
        wait_until(lambda: store.counters.as_dict()["deletes_failed"] == 1, what="counted")
    finally:
        store.close()
    with KVStore.open(tmp_path / "s", dram_bytes=1 << 20, disk_bytes=16 << 20) as again:
        assert again.lookup(identity, PUBLIC, tokens).tokens == 2 * N
        assert not disk_of(again).contains(keys[2])  # its row deleted by the close

"""An event sink that fails never stops the store. An event file on a full disk (a real
``JsonlSink`` on ``/dev/full``), or a subscriber that raises on one kind of event, used
to raise out of the store's ledger in the middle of a move. A put then left its chunks
TENTATIVE for good: a later put of the same prompt saw them in flight and stored
nothing. Now every move happens, the event is dropped and counted in
``events_dropped``, and the store serves, invalidates, flushes, closes and reopens as
if the sink were healthy."""

from __future__ import annotations

import errno
from pathlib import Path

import numpy as np
import pytest

from kvlife.core.events import EventSink, JsonlSink, LifecycleEvent
from kvlife.core.identity import PUBLIC, ModelIdentity
from kvlife.core.lifecycle import Move
from kvlife.store import KVStore
from tests.conftest import prompt_kv

N = 16
PROMPTS = 6


class _FailsOn(EventSink):
    """A subscriber that raises on every event of one kind (and counts the others)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.taken = 0

    def emit(self, event: LifecycleEvent) -> None:
        if event.kind == self.kind:
            raise RuntimeError(f"subscriber bug on {event.kind}")
        self.taken += 1


def _workload(store: KVStore, identity: ModelIdentity) -> list[tuple[np.ndarray, np.ndarray]]:
    """Puts (one twice), loads with promotions and demotions (a small DRAM), an
    invalidation of one prompt, a flush; returns the prompts still owed."""
    prompts = [prompt_kv(100 + i, 4 * N) for i in range(PROMPTS)]
    for tokens, kv in prompts:
        res = store.put_prompt(identity, PUBLIC, tokens, kv)
        assert res.tokens_stored_or_present == 4 * N, res
    again = store.put_prompt(identity, PUBLIC, *prompts[0])
    assert again.already_present == 4 and again.tokens_stored_or_present == 4 * N
    for tokens, kv in prompts:
        got = store.get(identity, PUBLIC, tokens)
        assert got.loaded == 4
        assert np.array_equal(np.concatenate(got.arrays, axis=3), kv)
    gone_key = store.lookup(identity, PUBLIC, prompts[-1][0]).hits[0].key
    assert store.invalidate(prefix=gone_key) == 4
    store.flush()
    info = store.info()
    assert info.objects_by_state["tentative"] == 0, info.objects_by_state
    assert store.check().problems == []
    return prompts[:-1]


def _reopened(
    path: Path, identity: ModelIdentity, owed: list[tuple[np.ndarray, np.ndarray]]
) -> None:
    with KVStore.open(path, dram_bytes=1 << 20, disk_bytes=16 << 20) as again:
        for tokens, kv in owed:
            got = again.get(identity, PUBLIC, tokens)
            assert got.loaded == 4
            assert np.array_equal(np.concatenate(got.arrays, axis=3), kv)
        assert again.check().problems == []


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_an_event_file_on_a_full_disk_drops_events_not_the_store(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    sink = JsonlSink("/dev/full")  # every write that reaches the device: ENOSPC
    store = KVStore.open(tmp_path, dram_bytes=16 * 2048, disk_bytes=16 << 20, sink=sink)
    try:
        owed = _workload(store, identity)
        assert store.counters.events_dropped > 0
    finally:
        dropped = store.counters.events_dropped
        store.close()  # the sink's failing flush is counted, never raised
    assert store.counters.events_dropped == dropped + 1, "the flush's loss counted"
    _reopened(tmp_path, identity, owed)


class _FlushFails(JsonlSink):
    """An event file whose flush fails (a disk that filled, a file system gone)."""

    def flush(self) -> None:
        raise OSError(errno.EIO, "the event log's device failed")


def test_a_sink_whose_flush_fails_at_close_loses_its_events_counted_not_the_store(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """Close flushes the sink last: its failure is the event log's, counted in
    ``events_dropped`` and logged, and close raises nothing for it (every tier is closed,
    the lock released: the store reopens with every prompt)."""
    sink = _FlushFails(tmp_path / "events.jsonl")
    store = KVStore.open(tmp_path / "s", dram_bytes=16 * 2048, disk_bytes=16 << 20, sink=sink)
    owed = _workload(store, identity)
    assert store.counters.events_dropped == 0
    store.close()
    assert store.counters.events_dropped == 1
    sink.close()
    _reopened(tmp_path / "s", identity, owed)


@pytest.mark.parametrize(
    "kind",
    [
        m.value
        for m in (
            Move.PUT,
            Move.WRITE,
            Move.SEAL,
            Move.COMMIT,
            Move.INDEX,
            Move.LOAD,
            Move.OFFLOAD,
            Move.EVICT,
            Move.INVALIDATE,
            Move.DELETE,
        )
    ],
)
def test_a_subscriber_failing_on_one_kind_of_event_never_wedges_a_move(
    tmp_path: Path, identity: ModelIdentity, kind: str
) -> None:
    sink = _FailsOn(kind)
    with KVStore.open(tmp_path, dram_bytes=16 * 2048, disk_bytes=16 << 20, sink=sink) as store:
        owed = _workload(store, identity)
        dropped = store.counters.events_dropped
        assert dropped > 0, f"the workload made no {kind} event"
        assert sink.taken > 0  # the other kinds went on reaching it
    _reopened(tmp_path, identity, owed)

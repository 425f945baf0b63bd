"""Red team of frame loads (issue 28, commit 3447e6b and its follow-ups 375ec65, 844cbab):
``KVStore.load_frames`` finds the leading disk hits under the store's lock, the
extension reads their frames into the caller's buffers without pins, ``FrameLoad.wait``
publishes under the lock (re-checking each chunk INDEXED) and the rest goes through the
store's own load; ``kvlife serve`` uses it for its disk loads into shared buffers and
arena extents.

Attacked here with a real embedded store, real ``kvlife serve`` processes and real
segment files: changes made between the lock and the reads (a wrapped
``native.start_direct``: invalidations, re-puts of other KV, evictions, compaction, a
segment flipped, truncated, swapped, unlinked or replaced by another file) and between
the reads and the publication; a store closed under an open load; buffers of every kind
the run cannot fill; the handle used out of order, closed, dropped, waited twice; many
loads for descriptors and threads; a hammer of loads against invalidations, re-puts,
evictions and flushes with every count checked against the ledger; and on served loads
(a server parked at one point of a frame load, :mod:`tests.attack.frame_loads_rig`):
another client invalidating, re-putting, evicting or damaging frames meanwhile, the
loading client killed, the server killed and restarted, a shared buffer truncated.

Found by this red team (each kept as a strict xfail until mended in c58969a's
successor; the tests below now hold the mended behaviour):
- wrong KV served: a chunk handed out by ``chunk()`` (a served load streams it to the
  client) whose record an invalidation and a re-put with other KV replaced before the
  publication is not counted from its frame, but the store's load of the rest reads it
  again, the new put's bytes, into the same buffer, and counts it. A served load into
  arena extents then keeps the client's streamed copies of the old put's bytes under
  the new records' LOADs; a shared buffer is rewritten after its chunk was handed out
  (a pinned load counts such a chunk vanished and ends there);
- a store that promotes disk hits: a chunk whose disk replica was evicted after the load
  started while the chunk stayed INDEXED in DRAM (promoted meanwhile by another load)
  makes ``wait()`` raise KeyError from ``core.pin`` in ``_promote_later``, after the
  publication already counted the chunks; the disk replicas pinned before it are never
  unpinned (evictions can no longer take them). A default (promoting) ``kvlife serve``
  answers such a load with an internal error;
- a load published by ``wait()`` after the store closed: it counts into a closed store
  (its counts are missing from the lifetime figures at the next open), and on a store
  that promotes it starts a new background thread that nothing ever stops;
- a frame load whose later buffer does not fit its replica raises InvalidArgument after
  the publication counted the leading chunks as loaded (LOAD in the ledger, the tier's
  ``loaded``, ``frame_loads``); the store's own load of the same buffers counts none;
- ``chunk(i)`` for a hit past the frame-read ones makes every later ``chunk(j)`` of a
  frame-read chunk return None (a miss) though that chunk verifies and is loaded.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import random
import resource
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvlife.client import RemoteStore
from kvlife.core.errors import InvalidArgument, KVLifeError, RemoteError, StoreClosedError
from kvlife.core.events import MemorySink
from kvlife.core.identity import PUBLIC
from kvlife.core.lifecycle import Move
from kvlife.faults.damage import Frame, flip, scan_frames, swap_frames, truncate
from kvlife.native import frames as native
from kvlife.results import LoadResult, StoreCounters
from kvlife.store import KVStore
from kvlife.tiers.buffers import aligned_empty
from kvlife.tiers.disk import DiskTier
from kvlife.tiers.disk.frame import frame_room
from tests.attack.frame_loads_rig import GatedServer, gated_server
from tests.conftest import prompt_kv
from tests.server import test_frame_loads_served as served
from tests.server.conftest import ClientProc, MiB, quiet, wait_for
from tests.server.direct_rig import disk_server
from tests.test_frame_loads import (
    CHUNKS,
    IDENT,
    PAGE,
    _chunks,
    _kv,
    _lookup,
    _on_disk,
    _open,
    _outs,
)

pytestmark = pytest.mark.skipif(
    not native.available(), reason="the extension is not built (KVLIFE_NATIVE=0 or no compiler)"
)

N = PAGE.tokens_per_chunk
BIG = 1 << 40


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


def _frames_of(root: Path, keys: list[Any]) -> list[Frame]:
    by_key = {f.key: f for f in scan_frames(root)}
    return [by_key[k] for k in keys]


@contextlib.contextmanager
def _around_reads(
    monkeypatch: pytest.MonkeyPatch,
    before: Callable[[], object] | None = None,
    after: Callable[[], object] | None = None,
) -> Iterator[None]:
    """``native.start_direct`` wrapped (the module attribute ``frame_loads`` calls): run
    ``before`` once the load found its chunks under the lock and released it, before the
    segment files are opened; ``after`` once the run started (files open, reads on)."""
    real = native.start_direct

    def wrapped(frames: list[native.DirectFrame], depth: int) -> native.DirectRun:
        if before is not None:
            before()
        run = real(frames, depth)
        if after is not None:
            after()
        return run

    monkeypatch.setattr(native, "start_direct", wrapped)
    try:
        yield
    finally:
        monkeypatch.setattr(native, "start_direct", real)


def _loads_of(sink: MemorySink, request_id: str) -> list[str]:
    return [e.key for e in sink.take() if e.kind == Move.LOAD.value and e.request_id == request_id]


def _held_to(
    res: LoadResult,
    keys: list[Any],
    stored: list[bytes],
    before: StoreCounters,
    after: StoreCounters,
    events: list[str],
) -> None:
    """Invariants of any load: its arrays are the live bytes of its leading chunks, every
    count moved once per counted chunk, a miss ends it and is counted once."""
    assert res.loaded == len(res.arrays)
    for i, a in enumerate(res.arrays):
        assert a.tobytes() == stored[i], f"chunk {i} counted with other bytes"
    assert sorted(events) == sorted(k.hex() for k in keys[: res.loaded]), "LOADs in the ledger"
    assert after.loads - before.loads == 1
    assert after.tier("disk").loaded - before.tier("disk").loaded == res.loaded
    assert after.bytes_loaded - before.bytes_loaded == res.loaded * PAGE.chunk_nbytes
    assert 0 <= after.frame_loads - before.frame_loads <= res.loaded
    assert after.corrupt - before.corrupt == len(res.corrupt)
    if res.loaded == len(keys):
        assert not res.corrupt
    else:
        assert res.corrupt in ([], [keys[res.loaded]]), "a corrupt miss ends the load"


# --------------------------------------------------------------------------- embedded

MUTATIONS = (
    "invalidate_tail",
    "reput_other",
    "evict_disk",
    "flip_payload",
    "flip_header",
    "truncate",
    "swap_whole",
    "swap_payloads",
    "unlink_segment",
    "replace_segment",
)

EXPECT: dict[str, tuple[int, int | None, int]] = {
    # mutation: (loaded, the corrupt chunk or None, frame_loads) made before the reads
    # (the same after the files opened for the record-level ones)
    "invalidate_tail": (2, None, 2),
    # the first chunk out of service since the lock ends the result as vanished, as in a
    # pinned load's publication: none of the new put's bytes, none of the old counted
    "reput_other": (0, None, 0),
    "evict_disk": (0, None, 0),  # only on disk: dropped, vanished
    "flip_payload": (2, 2, 2),
    "flip_header": (2, 2, 2),
    "truncate": (2, 2, 2),
    "swap_whole": (1, 1, 1),
    "swap_payloads": (1, 1, 1),
    "unlink_segment": (CHUNKS, None, 0),  # the store's own descriptor still reads it
    "replace_segment": (CHUNKS, None, 0),  # another file at the path: the store's reads
}
RECORD_LEVEL = {"invalidate_tail", "reput_other", "evict_disk"}


@pytest.mark.parametrize("when", ["before_reads", "after_open"])
@pytest.mark.parametrize("mutation", MUTATIONS)
def test_a_change_between_the_lock_and_the_reads_never_counts_other_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mutation: str, when: str
) -> None:
    """A change made right after ``start`` released the store's lock (wrapped
    ``native.start_direct``): before the segment files are opened, or once they are open
    and the reads are under way. Record changes give the same result either way; damage
    to a file after its frames may already have been read gives one of the results the
    two orders allow. Every result is held to the live bytes and to the ledger."""
    root = tmp_path / "s"
    sink = MemorySink()
    store = _open(root, sink=sink)
    try:
        tokens, first = _on_disk(store, 11)
        _, kv_b = _kv(12)
        second = _chunks(kv_b)
        lk = _lookup(store, tokens)
        keys = [h.key for h in lk.hits]
        frames = _frames_of(root, keys)

        def change() -> None:
            f = frames
            if mutation == "invalidate_tail":
                assert store.invalidate(prefix=keys[2]) == 2
            elif mutation == "reput_other":
                store.invalidate(namespace=PUBLIC)
                store.put_prompt(IDENT, PUBLIC, tokens, kv_b)
                store.flush()
                store.evict("dram", BIG)
            elif mutation == "evict_disk":
                store.evict("disk", BIG)
            elif mutation == "flip_payload":
                flip(f[2].segment, f[2].payload_offset + 64, 1)
            elif mutation == "flip_header":
                flip(f[2].segment, f[2].offset + 40, 1)
            elif mutation == "truncate":
                truncate(f[2].segment, f[2].payload_offset + 10)
            elif mutation == "swap_whole":
                swap_frames(f[1], f[2], "whole-frames")
            elif mutation == "swap_payloads":
                swap_frames(f[1], f[2], "payloads")
            elif mutation == "unlink_segment":
                os.unlink(f[0].segment)
            else:  # a copy with frames 0 and 1 swapped renamed over the segment
                tmp = f[0].segment.with_name("swapped.tmp")
                shutil.copyfile(f[0].segment, tmp)
                a, b = (Frame(tmp, g.offset, g.key, g.payload_len) for g in f[:2])
                swap_frames(a, b, "whole-frames")
                os.replace(tmp, f[0].segment)

        assert len({fr.segment for fr in frames}) == 1  # one segment: the cases mean it
        sink.take()
        before = copy.deepcopy(store.counters)
        outs = _outs()
        hooks = {"before": change} if when == "before_reads" else {"after": change}
        with _around_reads(monkeypatch, **hooks):
            handle = store.load_frames(lk, outs, request_id="r")
            assert handle is not None
            res = handle.wait()
        live = second if mutation == "reput_other" else first
        _held_to(res, keys, live, before, store.counters, _loads_of(sink, "r"))
        loaded, bad, framed = EXPECT[mutation]
        got = (res.loaded, keys.index(res.corrupt[0]) if res.corrupt else None)
        if when == "before_reads" or mutation in RECORD_LEVEL:
            assert got == (loaded, bad), res
            assert store.counters.frame_loads - before.frame_loads == framed
        else:  # the reads and the damage raced: all of it, or up to a corrupt miss
            assert got == (CHUNKS, None) or got[1] == got[0], res
        if mutation in ("evict_disk", "reput_other"):
            assert res.vanished == 1  # the first gone ends it
        if mutation in RECORD_LEVEL:
            assert store.check().problems == []
    finally:
        store.close()


@pytest.mark.parametrize("when", ["before_reads", "after_open"])
def test_compaction_between_the_lock_and_the_reads_counts_only_stored_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """A disk-only store with room for ten frames: the loaded prompt's frames share
    segments with invalidated ones, and a put made between the lock and the reads (or
    once the files are open) compacts them: the live frames copied to another segment,
    the old segment unlinked. The load counts the stored bytes, from the old file (open
    already) or through the store's load (the file gone before the open)."""
    room = frame_room(PAGE.chunk_nbytes)
    store = KVStore.open(
        tmp_path / "s",
        dram_bytes=0,
        disk_bytes=10 * room,
        segment_bytes=4 * room,
        promote_on_hit=False,
    )
    rng = np.random.default_rng(21)

    def prompt(n: int) -> tuple[np.ndarray, np.ndarray]:
        t = rng.integers(0, 50_000, n * N)
        shape = (PAGE.num_layers, 2, PAGE.num_kv_heads, n * N, PAGE.head_dim)
        return t, rng.standard_normal(shape).astype(np.float16)

    try:
        g0, target, g1, later = prompt(2), prompt(CHUNKS), prompt(2), prompt(CHUNKS)
        for p in (g0, target, g1):
            store.put_prompt(IDENT, PUBLIC, *p)
        for g in (g0, g1):  # garbage beside the target's frames, in both segments
            store.invalidate(prefix=store.lookup(IDENT, PUBLIC, g[0]).hits[0].key)
        lk = store.lookup(IDENT, PUBLIC, target[0])
        assert lk.tiers() == {"disk": CHUNKS}
        disk = store.tier("disk")
        assert isinstance(disk, DiskTier)
        copied = disk.stats.compaction_bytes_written

        def compact() -> None:
            store.put_prompt(IDENT, PUBLIC, *later)

        stored = _chunks(target[1])
        before = copy.deepcopy(store.counters)
        outs = _outs()
        hooks = {"before": compact} if when == "before_reads" else {"after": compact}
        with _around_reads(monkeypatch, **hooks):
            handle = store.load_frames(lk, outs)
            assert handle is not None
            res = handle.wait()
        assert disk.stats.compaction_bytes_written > copied  # the case means it
        assert res.loaded == CHUNKS and not res.corrupt
        assert [a.tobytes() for a in res.arrays] == stored
        assert store.counters.tier("disk").loaded - before.tier("disk").loaded == CHUNKS
        assert store.check().problems == []
        assert store.lookup(IDENT, PUBLIC, later[0]).tiers() == {"disk": CHUNKS}
    finally:
        store.close()


def test_a_disk_replica_evicted_while_the_chunk_stays_in_dram_fails_nothing(
    tmp_path: Path,
) -> None:
    """A store that promotes: a frame load reads the prompt's disk frames; before its
    publication another load promotes the chunks into DRAM and an eviction takes the
    coldest disk replica (the chunk stays INDEXED, in DRAM). wait() must return the
    verified bytes and leave no pin behind: every disk replica can be evicted after."""
    store = _open(tmp_path / "s", promote=True)
    try:
        tokens, stored = _on_disk(store, 13)
        lk = _lookup(store, tokens)
        outs = _outs()
        handle = store.load_frames(lk, outs)
        assert handle is not None
        assert all(handle.chunk(i) is not None for i in range(CHUNKS))
        store.load(store.lookup(IDENT, PUBLIC, tokens), _outs())  # promotes into DRAM
        store.drain()
        assert store.lookup(IDENT, PUBLIC, tokens).tiers() == {"dram": CHUNKS}
        assert store.evict("disk", 1) > 0  # one disk replica goes; its chunk stays in DRAM
        res: LoadResult | None = None
        try:
            res = handle.wait()
        finally:
            store.drain()
            left = dict(store._core.pinned)
        assert res is not None and 0 < res.loaded <= CHUNKS
        assert [a.tobytes() for a in res.arrays] == stored[: res.loaded]
        assert not left, f"{len(left)} disk replica(s) left pinned"
        store.evict("disk", BIG)
        recs = [store._core.index.get(k) for k in (h.key for h in lk.hits)]
        assert all(r is not None and set(r.replicas) == {"dram"} for r in recs)
    finally:
        store.close()


@pytest.mark.parametrize("promote", [False, True])
def test_a_load_waited_after_the_store_closed_counts_nothing_lost(
    tmp_path: Path, promote: bool
) -> None:
    """The frames read and verified, then the store closed, then wait(): either it
    raises StoreClosedError, or what it counted is in the lifetime figures at the next
    open; and no thread is left running."""
    path = tmp_path / "s"
    store = _open(path, promote=promote)
    tokens, _ = _on_disk(store, 14)
    store.close()
    store = _open(path, promote=promote)
    lk = _lookup(store, tokens)
    outs = _outs()
    threads = _tasks()
    # process-wide pools started before (the lossless transform's, by another test) stay
    pools = {t.name for t in threading.enumerate() if t.name.startswith("kvlife")}
    handle = store.load_frames(lk, outs)
    assert handle is not None
    assert all(handle.chunk(i) is not None for i in range(CHUNKS))
    store.close()
    res: LoadResult | None = None
    with contextlib.suppress(StoreClosedError):
        res = handle.wait()
    time.sleep(0.2)  # a promotion submitted by the publication runs meanwhile
    left = [
        t.name for t in threading.enumerate() if t.name.startswith("kvlife") and t.name not in pools
    ]
    store = _open(path)
    try:
        life = store.info().lifetime_counters
    finally:
        store.close()
    assert _tasks() <= threads and not left, f"threads left running: {left}"
    counted = 0 if res is None else res.loaded
    assert life.get("frame_loads", 0) == counted
    assert life.get("tier.disk.loaded", 0) == counted


def test_a_load_that_raises_counts_no_chunk_loaded(tmp_path: Path) -> None:
    sink = MemorySink()
    store = _open(tmp_path / "s", sink=sink)
    try:
        tokens, _ = _on_disk(store, 15)
        lk = _lookup(store, tokens)
        outs: list[np.ndarray | None] = list(_outs())
        outs[1] = aligned_empty(PAGE.chunk_nbytes)  # uint8, flat: does not fit chunk 1
        sink.take()
        before = copy.deepcopy(store.counters)
        with pytest.raises(InvalidArgument):
            store.load(lk, outs)  # type: ignore[arg-type]
        plain = copy.deepcopy(store.counters)
        assert plain.tier("disk").loaded == before.tier("disk").loaded
        assert _loads_of(sink, "") == []
        # a buffer that does not fit its chunk: no frame load (the pinned load refuses
        # it before reading into any buffer of its run), nothing counted
        assert store.load_frames(lk, outs) is None
        after = store.counters
        assert _loads_of(sink, "") == [], "a LOAD in the ledger for a load that raised"
        assert after.tier("disk").loaded == plain.tier("disk").loaded
        assert after.frame_loads == plain.frame_loads
    finally:
        store.close()


def test_chunk_reports_no_miss_for_a_chunk_that_loads(tmp_path: Path) -> None:
    """Chunk 2 has no buffer (read by the store's load at wait()). Asking for chunk 3
    first (None: it comes with wait()), then chunk 0: chunk 0 is read from its frame,
    verifies and is loaded, so chunk(0) must hand out its buffer (LoadProgress: None
    only when it or a chunk before it is a miss), as a pinned load's handle does."""
    store = _open(tmp_path / "s")
    try:
        tokens, _ = _on_disk(store, 16)
        lk = _lookup(store, tokens)
        outs: list[np.ndarray | None] = list(_outs())
        outs[2] = None
        handle = store.load_frames(lk, outs)
        assert handle is not None
        # not read from a frame: waits for the whole load, which the store completes
        got = handle.chunk(3)
        assert got is not None and handle.done()
        first = handle.chunk(0)
        res = handle.wait()
        assert res.loaded == CHUNKS and res.arrays[0] is outs[0]
        pinned = store.load_async(lk, _outs())
        pinned.wait()
        assert pinned.chunk(0) is not None  # what the other handle says
        assert first is outs[0], "chunk 0 reported a miss, yet loaded"
    finally:
        store.close()


def test_a_rewrite_after_the_reads_serves_none_of_the_old_bytes(tmp_path: Path) -> None:
    """Every frame read (none handed out yet); then the prompt is invalidated and put
    again with other KV (same keys, new frames). The publication finds the first
    chunk's record out of service: the result ends there as vanished, as a pinned
    load's does, and counts nothing, neither the old bytes nor the new."""
    sink = MemorySink()
    store = _open(tmp_path / "s", sink=sink)
    try:
        tokens, _ = _on_disk(store, 17)
        _, kv_b = _kv(18)
        lk = _lookup(store, tokens)
        outs = _outs()
        handle = store.load_frames(lk, outs, request_id="rw")
        assert handle is not None
        time.sleep(0.01)  # the reads land in the old frames meanwhile
        store.invalidate(namespace=PUBLIC)
        store.put_prompt(IDENT, PUBLIC, tokens, kv_b)
        store.flush()
        store.evict("dram", BIG)
        before = copy.deepcopy(store.counters)
        sink.take()
        res = handle.wait()
        assert res.loaded == 0 and res.vanished == 1
        assert store.counters.frame_loads == before.frame_loads  # none from the old frames
        assert store.counters.vanished == before.vanished + 1
        assert _loads_of(sink, "rw") == []
        # the next lookup and load serve the new put, whole
        again = _outs()
        res = store.load(_lookup(store, tokens), again)
        assert [a.tobytes() for a in res.arrays] == _chunks(kv_b)
    finally:
        store.close()


def test_a_chunk_handed_out_is_never_written_again(tmp_path: Path) -> None:
    """chunk() handed out every chunk (verified in its frame: the caller may use it
    now); then the prompt is invalidated and put again with other KV. Whatever wait()
    counts, a buffer already handed out keeps the bytes it was handed out with, and a
    chunk counted holds the bytes of the record counted: so the re-put chunks end the
    result (vanished), as a pinned load's publication ends it."""
    store = _open(tmp_path / "s")
    try:
        tokens, first = _on_disk(store, 27)
        _, kv_b = _kv(28)
        lk = _lookup(store, tokens)
        outs = _outs()
        handle = store.load_frames(lk, outs)
        assert handle is not None
        assert all(handle.chunk(i) is outs[i] for i in range(CHUNKS))
        handed = [o.tobytes() for o in outs]
        assert handed == first
        store.invalidate(prefix=lk.hits[1].key)
        store.put_prompt(IDENT, PUBLIC, tokens, kv_b)  # chunks 1-3 anew, other KV
        store.flush()
        store.evict("dram", BIG)
        res = handle.wait()
        assert [o.tobytes() for o in outs] == handed, "a handed-out buffer rewritten"
        assert res.loaded == 1 and res.vanished == 1, res  # the first gone ends it
    finally:
        store.close()


def _unfillable(kind: str) -> list[np.ndarray]:
    outs = _outs()
    if kind == "unaligned":
        raw = aligned_empty(PAGE.chunk_nbytes + 4096)
        outs[0] = raw[64 : 64 + PAGE.chunk_nbytes].view(np.float16).reshape(PAGE.chunk_shape)
    elif kind == "strided":
        raw = aligned_empty(2 * PAGE.chunk_nbytes).view(np.float16)
        outs[1] = raw[::2].reshape(PAGE.chunk_shape)
    elif kind == "wrong_dtype":
        outs[0] = aligned_empty(PAGE.chunk_nbytes).view(np.int16).reshape(PAGE.chunk_shape)
    elif kind == "wrong_shape":
        outs[0] = aligned_empty(PAGE.chunk_nbytes).view(np.float16)
    elif kind == "read_only":
        outs[2].flags.writeable = False
    elif kind == "overlapping":
        raw = aligned_empty(2 * PAGE.chunk_nbytes + 4096).view(np.float16)
        half = PAGE.chunk_nbytes // 2 // 2  # elements: chunk 1 starts inside chunk 0
        size = PAGE.chunk_nbytes // 2
        outs[0] = raw[:size].reshape(PAGE.chunk_shape)
        outs[1] = raw[half : half + size].reshape(PAGE.chunk_shape)
    elif kind == "self_overlapping":
        base = aligned_empty(PAGE.chunk_nbytes).view(np.float16)
        outs[3] = np.lib.stride_tricks.as_strided(base, PAGE.chunk_shape, (0, 0, 0, 0, 2))
    return outs


@pytest.mark.parametrize(
    "kind",
    [
        "unaligned",
        "strided",
        "wrong_dtype",
        "wrong_shape",
        "read_only",
        "overlapping",
        "self_overlapping",
    ],
)
def test_buffers_the_run_cannot_fill_read_nothing_and_count_nothing(
    tmp_path: Path, kind: str
) -> None:
    """Each is refused (InvalidArgument) or not this way (None) before any read: the
    buffers keep their bytes and no count moves."""
    store = _open(tmp_path / "s")
    try:
        tokens, _ = _on_disk(store, 19)
        lk = _lookup(store, tokens)
        outs = _unfillable(kind)
        for o in outs:
            if o.flags.writeable:
                o[...] = 3
        marks = [o.tobytes() for o in outs]
        before = copy.deepcopy(store.counters)
        fds, tasks = _fds(), _tasks()
        handle = None
        with contextlib.suppress(InvalidArgument):
            handle = store.load_frames(lk, outs)
        assert handle is None
        assert [o.tobytes() for o in outs] == marks
        assert store.counters == before
        assert _fds() <= fds and _tasks() <= tasks
    finally:
        store.close()


def test_the_handle_misused_counts_nothing_and_writes_nothing_after(tmp_path: Path) -> None:
    """close() before wait() ends the reads (threads joined, files closed) and counts
    nothing; chunk() out of range is InvalidArgument; wait() after close() raises and
    counts nothing; close() twice, and close() after wait(), are no-ops; wait() twice
    is one result; a handle dropped mid-load stops its reads."""
    store = _open(tmp_path / "s")
    try:
        tokens, stored = _on_disk(store, 20)
        lk = _lookup(store, tokens)
        fds, tasks = _fds(), _tasks()
        before = copy.deepcopy(store.counters)
        outs = _outs()
        handle = store.load_frames(lk, outs)
        assert handle is not None
        for bad in (-1, CHUNKS, 10**9):
            with pytest.raises(InvalidArgument):
                handle.chunk(bad)
        assert handle.chunk(0) is outs[0]
        handle.close()
        snap = [o.tobytes() for o in outs]
        time.sleep(0.05)
        assert [o.tobytes() for o in outs] == snap, "a buffer written after close()"
        handle.close()
        with pytest.raises((KVLifeError, RuntimeError)):
            handle.wait()
        assert store.counters == before
        assert _fds() <= fds and _tasks() <= tasks
        # wait() twice, close() after it, chunk() after it
        outs = _outs()
        handle = store.load_frames(lk, outs)
        assert handle is not None
        res = handle.wait()
        assert handle.wait() is res and res.loaded == CHUNKS
        handle.close()
        assert [a.tobytes() for a in res.arrays] == stored
        assert _fds() <= fds and _tasks() <= tasks
        assert store.counters.loads == before.loads + 1
        # dropped without wait() or close(): its reads end, its files close
        for _ in range(20):
            h = store.load_frames(lk, _outs())
            assert h is not None
            h.chunk(1)
            del h
        gc.collect()
        assert _fds() <= fds and _tasks() <= tasks
        assert store.counters.loads == before.loads + 1
    finally:
        store.close()


def test_many_loads_of_every_outcome_leak_no_descriptor_or_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loads that succeed, loads closed early, dropped, racing an invalidation, whose
    frame fails (a corrupt frame found, retired, then put again), and whose segment file
    cannot be opened: the process's descriptors and threads come back to where they
    were after each round."""
    path = tmp_path / "s"
    store = _open(path)
    try:
        tokens, stored = _on_disk(store, 22)
        _, kv = _kv(22)
        lk = _lookup(store, tokens)
        fds = tasks = 0  # counted after the first round (the store's background thread)
        real = native.start_direct

        def gone(frames: list[native.DirectFrame], depth: int) -> native.DirectRun:
            moved = [(p + ".gone", *rest) for p, *rest in frames]
            return real(moved, depth)  # type: ignore[arg-type]

        for round_ in range(6):
            for _ in range(10):
                h = store.load_frames(lk, _outs())
                assert h is not None
                assert h.wait().loaded == CHUNKS
            for _ in range(5):
                h = store.load_frames(lk, _outs())
                assert h is not None
                h.chunk(0)
                h.close()
                h = store.load_frames(lk, _outs())
                del h
            gc.collect()
            # a corrupt frame: retired, counted, then the prompt is put again
            f = _frames_of(path, [lk.hits[1].key])[0]
            flip(f.segment, f.payload_offset + 8, 1)
            h = store.load_frames(lk, _outs())
            assert h is not None
            assert h.wait().corrupt == [lk.hits[1].key]
            store.put_prompt(IDENT, PUBLIC, tokens, kv)
            store.flush()
            store.evict("dram", BIG)
            lk = _lookup(store, tokens)
            # files that cannot be opened: the run reads nothing, the store's load does
            monkeypatch.setattr(native, "start_direct", gone)
            h = store.load_frames(lk, _outs())
            assert h is not None
            res = h.wait()
            monkeypatch.setattr(native, "start_direct", real)
            assert res.loaded == CHUNKS and [a.tobytes() for a in res.arrays] == stored
            gc.collect()
            if round_ == 0:
                fds, tasks = _fds(), _tasks()
            assert _fds() <= fds, f"round {round_}: descriptors leaked"
            assert _tasks() <= tasks, f"round {round_}: threads leaked"
    finally:
        store.close()


def test_descriptors_running_out_mid_open_leave_the_rest_to_the_store(tmp_path: Path) -> None:
    """A load of 120 chunks, each in a segment of its own, with the process's descriptor
    limit 40 above what it holds: the run opens what it can, the frames from the first
    file it cannot open go through the store's load (its own descriptors). Every chunk
    is exact, some were frame loads, and every descriptor comes back."""
    n = 120
    room = frame_room(PAGE.chunk_nbytes)
    store = KVStore.open(
        tmp_path / "s",
        dram_bytes=0,
        disk_bytes=2 * n * room,
        segment_bytes=room,
        promote_on_hit=False,
    )
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        rng = np.random.default_rng(29)
        tokens = rng.integers(0, 50_000, n * N)
        shape = (PAGE.num_layers, 2, PAGE.num_kv_heads, n * N, PAGE.head_dim)
        kv = rng.standard_normal(shape).astype(np.float16)
        store.put_prompt(IDENT, PUBLIC, tokens, kv)
        stored = [
            np.ascontiguousarray(kv[:, :, :, i * N : (i + 1) * N, :]).tobytes() for i in range(n)
        ]
        lk = store.lookup(IDENT, PUBLIC, tokens)
        assert lk.tiers() == {"disk": n}
        disk = store.tier("disk")
        assert isinstance(disk, DiskTier) and disk.segment_count >= n
        outs = [
            aligned_empty(PAGE.chunk_nbytes).view(np.float16).reshape(PAGE.chunk_shape)
            for _ in range(n)
        ]
        before = copy.deepcopy(store.counters)
        fds = _fds()
        resource.setrlimit(resource.RLIMIT_NOFILE, (fds + 40, hard))
        try:
            handle = store.load_frames(lk, outs)
            assert handle is not None
            res = handle.wait()
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert res.loaded == n and not res.read_errors and not res.corrupt
        assert [a.tobytes() for a in res.arrays] == stored
        framed = store.counters.frame_loads - before.frame_loads
        assert 0 < framed < n
        assert store.counters.tier("disk").loaded - before.tier("disk").loaded == n
        assert _fds() <= fds
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        store.close()


def test_loads_racing_every_mutation_count_exactly_what_the_ledger_says(
    tmp_path: Path,
) -> None:
    """A disk-only store (every hit a disk hit: DRAM replicas pinned by the loads would
    never be evicted). Two threads load the prompt by frame loads (each load its request
    id) while a third invalidates it and puts it again with one of two KVs, drops its
    coldest disk replica, puts it again over what is left, and flushes, at random. Every
    load's arrays are one put's bytes for their chunks, its LOAD events name exactly its
    counted chunks, and the store's counters moved by exactly the sum of what the loads
    counted. No pin is left and the audit is clean after."""
    sink = MemorySink()
    store = KVStore.open(
        tmp_path / "s",
        dram_bytes=0,
        disk_bytes=1 << 24,
        segment_bytes=1 << 18,
        promote_on_hit=False,
        sink=sink,
    )
    tokens, kv_a = _kv(23)
    _, kv_b = _kv(24)
    versions = [_chunks(kv_a), _chunks(kv_b)]
    stop = threading.Event()
    errors: list[BaseException] = []
    results: list[tuple[str, LoadResult, bool]] = []
    store.put_prompt(IDENT, PUBLIC, tokens, kv_a)
    sink.take()
    before = copy.deepcopy(store.counters)

    def mutate() -> None:
        rng = random.Random(23)
        try:
            kv = kv_a
            while not stop.is_set():
                op = rng.randrange(5)
                if op < 2:  # another put of the prompt
                    store.invalidate(namespace=PUBLIC)
                    kv = kv_b if rng.random() < 0.5 else kv_a
                    store.put_prompt(IDENT, PUBLIC, tokens, kv)
                elif op == 2:  # the coldest replica dropped (the rest stays)
                    store.evict("disk", 1)
                elif op == 3:  # the same KV again: what was dropped comes back
                    store.put_prompt(IDENT, PUBLIC, tokens, kv)
                else:
                    store.flush()
                time.sleep(rng.uniform(0, 0.003))
        except BaseException as exc:  # reported below
            errors.append(exc)

    def load(who: int) -> None:
        n = 0
        try:
            while not stop.is_set():
                lk = store.lookup(IDENT, PUBLIC, tokens)
                if not lk.hits:
                    continue
                outs = [
                    aligned_empty(PAGE.chunk_nbytes).view(np.float16).reshape(PAGE.chunk_shape)
                    for _ in lk.hits
                ]
                rid = f"{who}-{n}"
                n += 1
                handle = store.load_frames(lk, outs, request_id=rid)
                if handle is None:
                    res = store.load(lk, outs, request_id=rid)
                else:
                    for i in range(len(lk.hits)):
                        if handle.chunk(i) is None:
                            break
                    res = handle.wait()
                results.append((rid, res, handle is not None))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=mutate)] + [
        threading.Thread(target=load, args=(w,)) for w in range(2)
    ]
    for t in threads:
        t.start()
    time.sleep(2.0)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    try:
        assert not errors, errors
        framed = [r for r in results if r[2]]
        assert len(framed) > 20
        events = [e for e in sink.take() if e.kind == Move.LOAD.value]
        by_rid: dict[str, int] = {}
        for e in events:
            by_rid[e.request_id] = by_rid.get(e.request_id, 0) + 1
        total = 0
        for rid, res, _ in results:
            for i, a in enumerate(res.arrays):
                assert a.tobytes() in (versions[0][i], versions[1][i]), (rid, i)
            assert by_rid.get(rid, 0) == res.loaded, rid
            total += res.loaded
        after = store.counters
        assert after.loads - before.loads == len(results)
        assert after.tier("disk").loaded - before.tier("disk").loaded == total
        assert after.bytes_loaded - before.bytes_loaded == total * PAGE.chunk_nbytes
        assert after.frame_loads - before.frame_loads <= total
        assert after.frame_loads > before.frame_loads
        assert not store._core.pinned
        audit = store.check()
        assert audit.problems == []
    finally:
        store.close()


# --------------------------------------------------------------------------- served

SERVED_N = served.N
SERVED_CHUNKS = served.CHUNKS


@pytest.fixture(scope="module")
def gated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatedServer]:
    """One gated, write-through, non-promoting server for the served tests that keep it
    alive (each on prompts of its own)."""
    with gated_server(tmp_path_factory.mktemp("gated"), dram=4 * MiB, disk=64 * MiB) as srv:
        yield srv


@contextlib.contextmanager
def _clients(srv: GatedServer, n: int) -> Iterator[list[RemoteStore]]:
    cs = [srv.client() for _ in range(n)]
    try:
        yield cs
    finally:
        for c in cs:
            with contextlib.suppress(Exception):
                c.close()


def _served_frames(srv: GatedServer, keys: list[Any]) -> list[Frame]:
    return _frames_of(srv.path, keys)


SERVED_CASES = [
    # (the point the load parks at, what another client does meanwhile, into)
    ("wait", "invalidate_tail", "shared"),
    ("wait", "invalidate_tail", "private"),
    ("wait", "reput_other", "shared"),
    ("wait", "reput_other", "private"),
    ("wait", "evict_disk", "private"),
    ("start", "flip_payload", "shared"),
    ("start", "replace_segment", "private"),
    ("start", "reput_other", "shared"),
]


@pytest.mark.parametrize(("point", "mutation", "into"), SERVED_CASES)
def test_served_loads_parked_while_another_client_changes_the_chunks(
    gated: GatedServer, point: str, mutation: str, into: str
) -> None:
    """A client's load (load_async: streamed) parks in the server at ``point`` (at
    ``wait``, chunks 0-2 were streamed to the client before it); another client changes
    its chunks meanwhile, or the test damages the live server's segment file; then the
    load goes on. The result is the live bytes, counted once, the miss named; a chunk
    handed out by the stream is never changed after; no internal error."""
    seed = 100 + SERVED_CASES.index((point, mutation, into))
    with _clients(gated, 2) as (mine, other):
        tokens, first = served._on_disk(other, seed)
        _, kv_b = prompt_kv(seed + 50, SERVED_CHUNKS * SERVED_N, served.LAYOUT)
        second = [
            np.ascontiguousarray(kv_b[:, :, :, i * SERVED_N : (i + 1) * SERVED_N, :]).tobytes()
            for i in range(SERVED_CHUNKS)
        ]
        lk = mine.lookup(served.IDENT, PUBLIC, tokens)
        assert lk.tiers() == {"disk": SERVED_CHUNKS}
        keys = [h.key for h in lk.hits]
        frames = _served_frames(gated, keys)
        state = other.server_state()
        before = copy.deepcopy(other.counters)
        outs = served._shared(mine) if into == "shared" else served._private()
        gated.arm(point)  # type: ignore[arg-type]
        handle = mine.load_async(lk, outs)
        gated.parked()
        handed: dict[int, bytes] = {}
        seg = frames[0].segment
        kept = seg.with_name("kept.tmp")  # the live file, put back after a replacement
        try:
            if point == "wait":  # streamed before the publication: the client has them
                for i in range(SERVED_CHUNKS - 1):
                    got = handle.chunk(i, timeout=30)
                    assert got is not None
                    handed[i] = got.tobytes()
            if mutation == "invalidate_tail":
                assert other.invalidate(prefix=keys[2]) == 2
            elif mutation == "reput_other":
                other.invalidate(namespace=PUBLIC)
                other.put_prompt(served.IDENT, PUBLIC, tokens, kv_b)
                other.flush()
                other.evict("dram", BIG)
            elif mutation == "evict_disk":
                other.evict("disk", BIG)
            elif mutation == "flip_payload":
                flip(frames[2].segment, frames[2].payload_offset + 100, 1)
            else:
                tmp = seg.with_name("swapped.tmp")
                shutil.copyfile(seg, tmp)
                a, b = (Frame(tmp, g.offset, g.key, g.payload_len) for g in frames[:2])
                swap_frames(a, b, "whole-frames")
                os.link(seg, kept)
                os.replace(tmp, seg)
        finally:
            gated.release()
        try:
            res = handle.wait(timeout=30)
        finally:
            if kept.exists():  # the server's file at its path again, for later tests
                os.replace(kept, seg)
        live = second if mutation == "reput_other" else first
        want = {
            "invalidate_tail": 2,
            "reput_other": SERVED_CHUNKS,
            "evict_disk": 0,
            "flip_payload": 2,
            "replace_segment": SERVED_CHUNKS,
        }[mutation]
        for i, arr in enumerate(res.arrays):
            if i in handed:
                assert arr.tobytes() == handed[i], f"chunk {i} changed after it was handed out"
            assert arr.tobytes() == live[i], f"chunk {i} counted with other bytes"
        if mutation == "reput_other":  # parked at start: the new put's, whole; at wait:
            # the first chunk out of service ends the result (vanished), as pinned
            want = SERVED_CHUNKS if point == "start" and res.loaded else 0
        assert res.loaded == want, res
        assert res.corrupt == ([keys[2]] if mutation == "flip_payload" else [])
        after = other.counters
        assert after.loads - before.loads == 1
        assert after.tier("disk").loaded - before.tier("disk").loaded == want
        assert 0 <= after.frame_loads - before.frame_loads <= want
        if mutation == "reput_other" or (mutation == "replace_segment" and point == "start"):
            assert after.frame_loads == before.frame_loads  # none from the old frames
        assert other.server_state()["internal_errors"] == state["internal_errors"]


def test_a_promoting_server_serves_a_load_whose_disk_replicas_went_to_dram(
    tmp_path: Path,
) -> None:
    """A default server (promotes disk hits): a client's load parks before its
    publication; another client loads the same chunks (promoted into DRAM), drains and
    evicts the disk tier. The parked load must return the stored bytes."""
    srv = GatedServer(
        tmp_path / "store", tmp_path / "gate", promote=True, dram=4 * MiB, disk=64 * MiB
    )
    srv.start()
    try:
        with _clients(srv, 2) as (mine, other):
            tokens, stored = served._on_disk(other, 200)
            lk = mine.lookup(served.IDENT, PUBLIC, tokens)
            assert lk.tiers() == {"disk": SERVED_CHUNKS}
            outs = served._shared(mine)
            srv.arm("wait")
            handle = mine.load_async(lk, outs)
            srv.parked()
            try:
                got = other.load(other.lookup(served.IDENT, PUBLIC, tokens), served._private())
                assert got.loaded == SERVED_CHUNKS
                other.drain()
                assert other.lookup(served.IDENT, PUBLIC, tokens).tiers() == {"dram": SERVED_CHUNKS}
                other.evict("disk", BIG)
            finally:
                srv.release()
            try:
                res = handle.wait(timeout=30)
            except RemoteError as exc:
                pytest.fail(f"the parked load failed: {exc}")
            assert res.loaded == SERVED_CHUNKS
            assert [a.tobytes() for a in res.arrays] == stored
            assert other.server_state()["internal_errors"] == 0
    finally:
        srv.disarm()
        srv.stop()


KILLED_CLIENT = """
import sys
import numpy as np
from kvlife.client import RemoteStore
from kvlife.core.identity import PUBLIC
from kvlife.bench.server.loads import shared_chunks
from tests.server import test_frame_loads_served as served

c = RemoteStore(sys.argv[1], timeout=30)
tokens = np.array([int(t) for t in sys.stdin.readline().split()])
lk = c.lookup(served.IDENT, PUBLIC, tokens)
outs = shared_chunks(c, served.LAYOUT, len(lk.hits))
h = c.load_async(lk, outs)
got = h.chunk(0, timeout=30)
print("got" if got is not None else "none", flush=True)
sys.stdin.readline()
"""


def test_a_client_killed_while_its_load_is_parked_leaves_the_server_whole(
    gated: GatedServer,
) -> None:
    """A client process's streamed load into its shared buffer parks before the
    publication (chunk 0 already streamed to it); the process is SIGKILLed; the load
    goes on into a buffer nobody maps but the server. The server keeps serving: no
    internal error, the session and its buffer gone, descriptors and threads back where
    they were, and another client's load of the same chunks is exact."""
    with _clients(gated, 1) as (other,):
        tokens, stored = served._on_disk(other, 300)
        served._shared(other)  # warm: this session's buffer path, once
        q = quiet(other)
        fds, tasks = gated.fds(), gated.tasks()
        state = other.server_state()
        with ClientProc(KILLED_CLIENT, gated.socket) as proc:
            gated.arm("wait")
            proc.send(" ".join(str(int(t)) for t in tokens))
            assert proc.line() == "got"
            gated.parked()
            proc.proc.kill()
            proc.proc.wait(timeout=30)
            gated.release()
        quiet(other, q["sessions"])
        wait_for(lambda: gated.fds() <= fds, what="the server's descriptors back")
        wait_for(lambda: gated.tasks() <= tasks, what="the server's threads back")
        lk = other.lookup(served.IDENT, PUBLIC, tokens)
        res = other.load(lk, served._private())
        assert res.loaded == SERVED_CHUNKS
        assert [a.tobytes() for a in res.arrays] == stored
        assert other.server_state()["internal_errors"] == state["internal_errors"]
        assert gated.alive()


def test_a_server_killed_while_a_load_is_parked_restarts_whole(tmp_path: Path) -> None:
    """SIGKILL while a frame load is parked (at its start, then at its publication):
    the restarted server serves the stored bytes and its audit is clean."""
    path = tmp_path / "store"
    for point in ("start", "wait"):
        srv = GatedServer(path, tmp_path / "gate", promote=False, dram=4 * MiB, disk=64 * MiB)
        srv.start()
        try:
            c = srv.client()
            tokens, stored = served._on_disk(c, 400 if point == "start" else 401)
            lk = c.lookup(served.IDENT, PUBLIC, tokens)
            srv.arm(point)
            handle = c.load_async(lk, served._shared(c))
            srv.parked()
            srv.kill()
            with contextlib.suppress(Exception):
                handle.wait(timeout=30)
            with contextlib.suppress(Exception):
                c.close()
        finally:
            srv.disarm()
            if srv.alive():
                srv.kill()
        again = disk_server(path)
        try:
            c = again.client()
            lk = c.lookup(served.IDENT, PUBLIC, tokens)
            assert lk.tiers() == {"disk": SERVED_CHUNKS}
            res = c.load(lk, served._shared(c))
            assert res.loaded == SERVED_CHUNKS
            assert [a.tobytes() for a in res.arrays] == stored
            assert c.counters.frame_loads == SERVED_CHUNKS
            audit = c.check()
            assert audit.problems == []
            c.close()
        finally:
            again.stop()


def test_a_shared_buffer_truncated_by_its_client_is_a_read_error_not_a_crash(
    gated: GatedServer,
) -> None:
    """The client cuts its shared buffer's file to nothing, then loads disk hits into
    it: the frame reads fail (the server's mapping has no pages there), the store's load
    fails too, the load is a counted read error and the server keeps serving. (The
    test never touches the truncated mapping itself: that would be SIGBUS here.)"""
    with _clients(gated, 2) as (mine, other):
        tokens, stored = served._on_disk(other, 500)
        state = other.server_state()
        before = copy.deepcopy(other.counters)
        outs = served._shared(mine)
        made = [p for p in Path("/dev/shm").iterdir() if f"-{gated.pid}-buf-" in p.name]
        assert made
        for p in made:  # this test's buffers and earlier sessions' that are still there
            os.truncate(p, 0)
        lk = mine.lookup(served.IDENT, PUBLIC, tokens)
        res = mine.load(lk, outs)
        got = (res.loaded, res.read_errors, len(res.corrupt))  # ints: its arrays are gone
        del res, outs
        assert got == (0, 1, 0)
        after = other.counters
        assert after.frame_loads == before.frame_loads
        assert after.tier("disk").loaded == before.tier("disk").loaded
        assert gated.alive()
        assert other.server_state()["internal_errors"] == state["internal_errors"]
        res = other.load(other.lookup(served.IDENT, PUBLIC, tokens), served._private())
        assert [a.tobytes() for a in res.arrays] == stored


def test_many_served_loads_of_every_outcome_leak_nothing_in_the_server(
    gated: GatedServer,
) -> None:
    """Loads into shared buffers and into grants, whole, with a corrupt frame, and with
    their chunks invalidated: the server's descriptors and threads come back to where
    they were."""
    with _clients(gated, 1) as (c,):
        tokens, stored = served._on_disk(c, 600)
        shared = served._shared(c)
        fds = tasks = 0  # counted after the first round (the store's background thread)
        for round_ in range(4):
            for _ in range(5):
                lk = c.lookup(served.IDENT, PUBLIC, tokens)
                assert c.load(lk, shared).loaded == SERVED_CHUNKS
                assert c.load_async(lk, served._private()).wait(timeout=30).loaded == (
                    SERVED_CHUNKS
                )
            lk = c.lookup(served.IDENT, PUBLIC, tokens)
            f = _served_frames(gated, [lk.hits[2].key])[0]
            flip(f.segment, f.payload_offset + 8, 1)
            res = c.load(lk, shared)
            assert res.loaded == 2 and res.corrupt == [lk.hits[2].key]
            c.invalidate(namespace=PUBLIC)
            assert c.load(lk, served._private()).loaded == 0
            tokens, stored = served._on_disk(c, 600)
            if round_ == 0:
                fds, tasks = gated.fds(), gated.tasks()
            assert gated.fds() <= fds, f"round {round_}: the server's descriptors"
            assert gated.tasks() <= tasks, f"round {round_}: the server's threads"
        res = c.load(c.lookup(served.IDENT, PUBLIC, tokens), shared)
        assert [a.tobytes() for a in res.arrays] == stored

"""Red team of ``close()`` called from inside a callback the store runs (commit 10e3935:
``kvlife/store/callbacks.py`` marks the thread, ``close_store`` then starts the close on
a thread named ``kvlife-close`` and returns at once; a later ``close()`` waits for it;
its error is logged; docs/store.md, "Closing while other threads work").

``tests/attack/test_close_races_attack.py`` covers a sink closing on a put's 'index'
event in the caller's thread and on a load, and ``check``'s progress callback. This file
attacks the rest of the seam with real stores in ``tmp_path`` (no mocks; interleavings
forced with ``FaultyIO`` stalls; joins bounded):

1. callbacks run on the store's own threads: a sink closing from ``put_async``'s worker
   (the close must not wait for itself), from the background promotion thread, from
   ``load_async``'s I/O threads; inside a put's demotion and its ``prepare_put``;
2. callbacks run inside other calls: ``flush()``, ``invalidate``, ``evict``,
   ``check(fix=True)``'s progress over a damaged frame;
3. what the callback (or its caller) does next: close twice, keep using the store,
   raise after closing, close on every event;
4. a callback close racing a close from another thread, in both orders;
5. a deferred close that fails (its flush's writes fail): logged, a later close
   returns, the directory reopens;
6. the process exiting after a callback close (a child interpreter);
7. what is left after the close: a ``put_async`` made while it runs, a close called
   from the sink's ``flush()`` (a callback the store runs inside close), the
   ``kvlife-close`` thread and its logged error when a later close returns.

What broke a promise was kept as a strict xfail with its reason, and mended the same day
(the reasons are kept as comments above the tests, sections 6 and 7): a callback close
followed by the process exiting lost the flush it was asked for (an untyped RuntimeError
on a non-daemon thread, or no close at all on a daemon one); a ``put_async`` during the
close leaked a ``kvlife-put`` thread; a close from the sink's ``flush()`` never returned;
a later close could return before the deferred one ended.

Promises held to: every call completes or raises a typed error (KVLifeError), none
hangs, no wrong KV is served, a reopen audits clean, nothing acknowledged durable is
lost (a put acknowledged before a ``close(flush=True)``, a write-through put, an
invalidation that returned), no ``kvlife-*`` thread outlives the close.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvlife.core.errors import KVLifeError, StoreClosedError
from kvlife.core.events import EventSink, LifecycleEvent
from kvlife.core.identity import PUBLIC, ModelIdentity
from kvlife.faults.damage import flip, scan_frames
from kvlife.faults.fileio import FaultyIO
from kvlife.results import LoadResult, PutResult
from kvlife.store import KVStore
from tests.conftest import TINY, prompt_kv
from tests.helpers.store_threads import Call as _Call
from tests.helpers.store_threads import CloseOnce
from tests.helpers.store_threads import assert_exact as _exact
from tests.helpers.store_threads import blocked as _blocked
from tests.helpers.store_threads import chunk_of as _chunk
from tests.helpers.store_threads import open_small as _open
from tests.helpers.store_threads import reopen_clean as _reopen_clean
from tests.helpers.store_threads import wait_until as _wait

N = TINY.tokens_per_chunk
SEG = "seg-*"
STALL_S = 10.0
"""A held seam call fails with ETIMEDOUT after this long (a broken test cannot hang)."""
REPO = Path(__file__).resolve().parents[2]


def _kvlife_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvlife")]


def _no_kvlife_threads(before: set[threading.Thread], timeout_s: float = 5.0) -> None:
    """Every ``kvlife-*`` thread started since ``before`` ends within ``timeout_s`` (a
    thread may still be returning from the wait that ended the close)."""
    deadline = time.monotonic() + timeout_s
    for t in _kvlife_threads():
        if t not in before:
            t.join(max(0.0, deadline - time.monotonic()))
    left = [t.name for t in _kvlife_threads() if t not in before and t.is_alive()]
    assert left == [], f"threads left running after close: {left}"


def _closed_later(store: KVStore, flush: bool = False) -> None:
    """The later ``close()`` the contract names: it waits for the deferred one, bounded."""
    closing = _Call(lambda: store.close(flush=flush))
    closing.join(20)
    assert closing.error is None, repr(closing.error)


def _typed(error: BaseException | None) -> None:
    assert error is None or isinstance(error, KVLifeError), repr(error)


class _CloseOn(EventSink):
    """A sink that calls its store's ``close(flush=...)`` on the first event ``when``
    accepts (``times`` calls in a row), then runs ``then`` (still inside ``emit``); it
    records the thread it fired on and what close raised."""

    def __init__(
        self,
        when: Callable[[LifecycleEvent], bool],
        *,
        flush: bool = False,
        times: int = 1,
        then: Callable[[], object] | None = None,
        every: bool = False,
    ) -> None:
        self.when = when
        self.close_flush = flush
        self.times = times
        self.then = then
        self.every = every
        self.store: KVStore | None = None
        self.fired = threading.Event()
        self.fired_on: list[str] = []
        self.errors: list[BaseException] = []
        self.events: list[LifecycleEvent] = []
        self._lock = threading.Lock()

    def emit(self, event: LifecycleEvent) -> None:
        with self._lock:
            self.events.append(event)
            go = (
                self.store is not None
                and self.when(event)
                and (self.every or not self.fired.is_set())
            )
            if go:
                self.fired_on.append(threading.current_thread().name)
        if not go:
            return
        assert self.store is not None
        for _ in range(self.times):
            try:
                self.store.close(flush=self.close_flush)
            except BaseException as exc:  # reported by the test
                self.errors.append(exc)
        self.fired.set()
        if self.then is not None:
            self.then()


def _kind(kind: str, dst: str | None = None) -> Callable[[LifecycleEvent], bool]:
    return lambda e: e.kind == kind and (dst is None or e.dst_tier == dst)


# --------------------------------------------------------------- 1. the store's own threads


@pytest.mark.parametrize("flush", [False, True])
def test_sink_closing_on_the_put_async_worker_does_not_wait_for_itself(
    tmp_path: Path, identity: ModelIdentity, flush: bool
) -> None:
    """The sink closes on a put's 'index' event, emitted on ``put_async``'s own worker
    thread (``kvlife-put``), which the close shuts down and waits for. The future ends
    (stored, or typed); the close ends by itself (no later close needed to run it), a
    later close returns, no thread is left, and with ``flush=True`` the put acknowledged
    before the close ran is on disk after the reopen. (A second ``put_async`` made while
    that close ran leaked a thread until 2026-12-07: section 7 below.)"""
    before = set(threading.enumerate())
    sink = _CloseOn(_kind("index"), flush=flush)
    store = _open(tmp_path / "s", sink=sink)
    sink.store = store
    tokens, kv = prompt_kv(101, 4 * N)
    fut = store.put_async(store.prepare_put(identity, PUBLIC, tokens, kv))
    try:
        res = fut.result(10)
    except KVLifeError:
        res = None
    assert sink.fired.is_set() and sink.errors == [], sink.errors
    assert sink.fired_on[0].startswith("kvlife-put"), sink.fired_on
    _wait(lambda: store._core.close_done.is_set(), "the deferred close to finish", 10)
    _closed_later(store)
    _no_kvlife_threads(before)
    with pytest.raises(StoreClosedError):
        store.put_prompt(identity, PUBLIC, tokens, kv)
    n = 4 if (flush and isinstance(res, PutResult) and res.stored == 4) else None
    _reopen_clean(tmp_path / "s", identity, [(tokens, kv, n)])


def test_sink_closing_on_the_background_promotion_thread(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """A load's hits promoted by the background thread (``kvlife-bg``): the sink closes
    on the first 'offload>dram'. The close (which drains and shuts that very thread)
    ends, the load served exact, and the directory reopens clean with every chunk."""
    before = set(threading.enumerate())
    sink = _CloseOn(_kind("offload", "dram"), flush=True)
    store = _open(tmp_path / "s", sink=sink, promote=True)
    tokens, kv = prompt_kv(102, 4 * N)
    store.put_prompt(identity, PUBLIC, tokens, kv)
    store.flush()
    store.evict("dram", 1 << 30)
    sink.store = store
    loading = _Call(lambda: store.get(identity, PUBLIC, tokens))
    loading.join(10)
    _typed(loading.error)
    if isinstance(loading.result, LoadResult):
        _exact(loading.result.arrays, kv)
    assert sink.fired.wait(10), "no promotion was published"
    assert sink.errors == [], sink.errors
    assert sink.fired_on[0].startswith("kvlife-bg"), sink.fired_on
    _wait(lambda: store._core.close_done.is_set(), "the deferred close to finish", 10)
    _closed_later(store)
    _no_kvlife_threads(before)
    _reopen_clean(tmp_path / "s", identity, [(tokens, kv, 4)])


def test_sink_closing_on_a_demotion_inside_a_put_keeps_every_acknowledged_put(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """A DRAM tier too small for two prompts: the second put demotes the first to disk
    in its turn; the sink closes (flush) on that 'offload>disk'. Both puts end (stored
    or typed), and every put acknowledged is on disk after the reopen."""
    before = set(threading.enumerate())
    sink = _CloseOn(_kind("offload", "disk"), flush=True)
    kv_bytes = prompt_kv(0, 4 * N)[1].nbytes
    store = _open(tmp_path / "s", sink=sink, dram_bytes=kv_bytes + kv_bytes // 2)
    sink.store = store
    prompts = [prompt_kv(103 + i, 4 * N) for i in range(3)]
    acked: list[tuple[np.ndarray, np.ndarray, int | None]] = []
    for tokens, kv in prompts:
        try:
            res = store.put_prompt(identity, PUBLIC, tokens, kv)
        except KVLifeError:
            continue
        if res.stored == 4:
            acked.append((tokens, kv, 4))
    assert sink.fired.is_set(), "nothing was demoted"
    assert sink.errors == [] and acked, (sink.errors, len(acked))
    _closed_later(store)
    _no_kvlife_threads(before)
    _reopen_clean(tmp_path / "s", identity, acked)


@pytest.mark.parametrize("depth", [None, 1])
def test_sink_closing_on_a_load_async_io_thread(
    tmp_path: Path, identity: ModelIdentity, depth: int | None
) -> None:
    """``load_async`` of four disk-only chunks: its 'load' events are emitted on the I/O
    pool's threads (``kvlife-load``), which the close shuts down and waits for; the sink
    closes on the first. The handle ends: ``wait`` exact or StoreClosedError, each
    ``chunk`` exact or None; the later close returns, no thread is left, and the reopen
    serves every chunk exact."""
    before = set(threading.enumerate())
    sink = _CloseOn(_kind("load"), flush=False)
    store = _open(tmp_path / "s", sink=sink)
    tokens, kv = prompt_kv(112 if depth is None else 113, 4 * N)
    store.put_prompt(identity, PUBLIC, tokens, kv)
    store.flush()
    store.evict("dram", 1 << 30)
    lookup = store.lookup(identity, PUBLIC, tokens)
    assert [h.tier for h in lookup.hits] == ["disk"] * 4
    sink.store = store
    handle = store.load_async(lookup, depth=depth)
    try:
        res = handle.wait(10)
    except StoreClosedError:
        res = None
    assert handle.done()
    if res is not None:
        _exact(res.arrays, kv)
    for i in range(4):
        got = handle.chunk(i, 5)
        assert got is None or np.array_equal(got, _chunk(kv, i)), f"chunk {i} served other KV"
    assert sink.fired.is_set() and sink.errors == [], sink.errors
    assert sink.fired_on[0].startswith("kvlife-load"), sink.fired_on
    _closed_later(store)
    _no_kvlife_threads(before)
    _reopen_clean(tmp_path / "s", identity, [(tokens, kv, 4)])


def test_sink_closing_on_prepare_put_leaves_nothing_tentative(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """The sink closes on the first 'put' (a chunk made TENTATIVE by ``prepare_put``).
    The prepare returns or raises typed; a commit of what it returned stores it or ends
    typed; every chunk ends 'index' or 'abort' (nothing left TENTATIVE by the close);
    the reopen is clean and serves the prompt exact or not at all."""
    before = set(threading.enumerate())
    sink = _CloseOn(_kind("put"), flush=True)
    store = _open(tmp_path / "s", sink=sink)
    sink.store = store
    tokens, kv = prompt_kv(114, 4 * N)
    preparing = _Call(lambda: store.prepare_put(identity, PUBLIC, tokens, kv))
    preparing.join(10)
    _typed(preparing.error)
    stored = 0
    if preparing.error is None:
        committing = _Call(lambda: store.commit_put(preparing.result))  # type: ignore[arg-type]
        committing.join(10)
        _typed(committing.error)
        if isinstance(committing.result, PutResult):
            stored = committing.result.stored
    assert sink.fired.is_set() and sink.errors == [], sink.errors
    _closed_later(store)
    _no_kvlife_threads(before)
    last: dict[str, str] = {}
    for e in sink.events:
        last[e.key] = e.kind if e.kind != "offload" else last.get(e.key, "")
    assert set(last.values()) <= {"index", "abort"}, last
    _reopen_clean(tmp_path / "s", identity, [(tokens, kv, 4 if stored == 4 else None)])


# --------------------------------------------------------------- 2. inside other calls


def test_sink_closing_during_flush(tmp_path: Path, identity: ModelIdentity) -> None:
    """``flush()`` copies two prompts to disk; the sink closes (flush) on its first
    'offload>disk'. The flush returns its count or StoreClosedError, and both prompts
    (acknowledged before the close) are on disk after the reopen."""
    before = set(threading.enumerate())
    sink = _CloseOn(_kind("offload", "disk"), flush=True)
    store = _open(tmp_path / "s", sink=sink)
    p1, p2 = prompt_kv(106, 4 * N), prompt_kv(107, 4 * N)
    for tokens, kv in (p1, p2):
        assert store.put_prompt(identity, PUBLIC, tokens, kv).stored == 4
    sink.store = store
    flushing = _Call(store.flush)
    flushing.join(10)
    _typed(flushing.error)
    assert sink.fired.is_set() and sink.errors == [], sink.errors
    if flushing.error is None:
        assert flushing.result == 8
    _closed_later(store)
    _no_kvlife_threads(before)
    _reopen_clean(tmp_path / "s", identity, [(*p1, 4), (*p2, 4)])


def test_sink_closing_during_invalidate_keeps_the_invalidation(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """The sink closes on the first 'invalidate' event (emitted under the store's lock,
    before the invalidation's deletes). ``invalidate`` returns its count ("durable when
    it returns") or a typed error; once it returned a count, the reopened store serves
    none of those chunks."""
    before = set(threading.enumerate())
    sink = _CloseOn(_kind("invalidate"), flush=True)
    store = _open(tmp_path / "s", sink=sink)
    tokens, kv = prompt_kv(108, 4 * N)
    store.put_prompt(identity, PUBLIC, tokens, kv)
    store.flush()
    sink.store = store
    doing = _Call(lambda: store.invalidate(weights_digest=identity.weights_digest))
    doing.join(10)
    _typed(doing.error)
    assert sink.fired.is_set() and sink.errors == [], sink.errors
    _closed_later(store)
    _no_kvlife_threads(before)
    with _open(tmp_path / "s") as again:
        assert again.check().problems == []
        got = again.get(identity, PUBLIC, tokens)
        if doing.error is None:
            assert doing.result == 4
            assert got.loaded == 0, "an invalidation that returned came back after reopen"
        _exact(got.arrays, kv)


def test_sink_closing_during_evict(tmp_path: Path, identity: ModelIdentity) -> None:
    """``evict('dram', ...)`` of a flushed prompt; the sink closes on the first 'evict'.
    The evict returns (bytes) or a typed error; the reopen serves every chunk exact."""
    before = set(threading.enumerate())
    sink = _CloseOn(_kind("evict"), flush=False)
    store = _open(tmp_path / "s", sink=sink)
    tokens, kv = prompt_kv(110, 4 * N)
    store.put_prompt(identity, PUBLIC, tokens, kv)
    store.flush()
    sink.store = store
    evicting = _Call(lambda: store.evict("dram", 1 << 30))
    evicting.join(10)
    _typed(evicting.error)
    assert sink.fired.is_set() and sink.errors == [], sink.errors
    if evicting.error is None:
        assert isinstance(evicting.result, int) and evicting.result > 0
    _closed_later(store)
    _no_kvlife_threads(before)
    _reopen_clean(tmp_path / "s", identity, [(tokens, kv, 4)])


def test_progress_closing_during_check_fix_of_a_damaged_frame(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """A payload of a disk-only prompt damaged while the store is closed; on reopen
    ``check(fix=True, progress=...)`` whose progress closes the store. The audit is not
    cut short (the damage is reported, no healthy replica is), the fix holds, a later
    close returns; the next reopen audits clean, serves chunk 0 exact and never the
    damaged chunk."""
    before = set(threading.enumerate())
    path = tmp_path / "s"
    tokens, kv = prompt_kv(111, 4 * N)
    with _open(path, dram_bytes=0) as store:
        store.put_prompt(identity, PUBLIC, tokens, kv)
    frames = scan_frames(path)
    keys = [k for k in (f.key for f in frames)]
    assert len(keys) == 4
    damaged = next(f for f in frames if f.key == keys[1])
    flip(damaged.segment, damaged.payload_offset + 11, 4)
    store = _open(path, dram_bytes=0)
    progress = CloseOnce(store)
    checking = _Call(lambda: store.check(fix=True, progress=progress))
    checking.join(10)
    assert progress.calls == [None], progress.calls
    _typed(checking.error)
    if checking.error is None:
        report: Any = checking.result
        assert len(report.problems) == 1, report.problems  # the damaged frame, no other
        assert report.fixed
    _closed_later(store)
    _no_kvlife_threads(before)
    with _open(path) as again:
        assert again.check().problems == []
        got = again.get(identity, PUBLIC, tokens)
        assert got.loaded == 1, got.loaded  # the chain stops at the damaged chunk
        _exact(got.arrays, kv)


# --------------------------------------------------------------- 3. what comes after


def test_callback_closing_twice_then_the_store_kept_in_use_is_exact_or_typed(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """The sink calls ``close()`` twice on a put's 'index' event; the caller then goes
    on using the store while the close runs: puts, lookups, loads, flush, info. Each
    returns a right answer (exact KV) or StoreClosedError; the later close returns; the
    reopen serves every put acknowledged (all before the close began: flush=True) exact."""
    before = set(threading.enumerate())
    sink = _CloseOn(_kind("index"), flush=True, times=2)
    store = _open(tmp_path / "s", sink=sink)
    p0 = prompt_kv(112, 4 * N)
    store.put_prompt(identity, PUBLIC, *p0)
    sink.store = store
    p1 = prompt_kv(113, 4 * N)
    res1 = store.put_prompt(identity, PUBLIC, *p1)
    assert sink.fired.is_set() and sink.errors == [], sink.errors
    acked: list[tuple[np.ndarray, np.ndarray, int | None]] = [(*p0, 4)]
    if res1.stored == 4:
        acked.append((*p1, 4))
    served: list[tuple[np.ndarray, np.ndarray]] = [p0, p1]
    for i in range(20):
        tokens, kv = prompt_kv(114 + i, 4 * N)
        try:
            if store.put_prompt(identity, PUBLIC, tokens, kv).stored == 4:
                served.append((tokens, kv))
                acked.append((tokens, kv, 4))  # before the close began: its flush has it
        except StoreClosedError:
            pass
        for t, want in served:
            try:
                got = store.get(identity, PUBLIC, t)
            except StoreClosedError:
                continue
            _exact(got.arrays, want)
        for call in (store.flush, store.info):
            with contextlib.suppress(StoreClosedError):
                call()
    _closed_later(store)
    _no_kvlife_threads(before)
    _reopen_clean(tmp_path / "s", identity, acked)


def test_sink_that_closes_then_raises_leaves_nothing_behind(
    tmp_path: Path, identity: ModelIdentity, caplog: pytest.LogCaptureFixture
) -> None:
    """The sink closes and then raises (a sink's error is logged and counted, the move
    stands): the put returns, the deferred close runs, nothing hangs or leaks."""
    before = set(threading.enumerate())

    def boom() -> None:
        raise RuntimeError("sink broke after closing")

    sink = _CloseOn(_kind("index"), flush=True, then=boom)
    store = _open(tmp_path / "s", sink=sink)
    sink.store = store
    tokens, kv = prompt_kv(140, 4 * N)
    with caplog.at_level(logging.WARNING):
        putting = _Call(lambda: store.put_prompt(identity, PUBLIC, tokens, kv))
        putting.join(10)
        _typed(putting.error)
        _wait(lambda: store._core.close_done.is_set(), "the deferred close to finish", 10)
    assert sink.errors == [], sink.errors
    assert any("sink broke after closing" in r.getMessage() for r in caplog.records)
    _closed_later(store)
    _no_kvlife_threads(before)
    n = 4 if isinstance(putting.result, PutResult) and putting.result.stored == 4 else None
    _reopen_clean(tmp_path / "s", identity, [(tokens, kv, n)])


def test_sink_closing_on_every_event_of_many_puts_starts_no_lasting_threads(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """A sink that calls ``close()`` on every event (the close's own aborts and offloads
    included) while three threads put: every put ends stored or typed, every
    ``kvlife-close`` thread ends, the reopen is clean and serves what it holds exact."""
    before = set(threading.enumerate())
    sink = _CloseOn(lambda e: True, flush=True, every=True)
    store = _open(tmp_path / "s", sink=sink)
    sink.store = store
    prompts = [prompt_kv(150 + i, 4 * N) for i in range(6)]

    def puts(k: int) -> list[int]:
        out = []
        for tokens, kv in prompts[k::3]:
            try:
                out.append(store.put_prompt(identity, PUBLIC, tokens, kv).stored)
            except StoreClosedError:
                out.append(-1)
        return out

    calls = [_Call(partial(puts, k)) for k in range(3)]
    for c in calls:
        c.join(15)
        _typed(c.error)
    assert sink.fired.is_set() and sink.errors == [], sink.errors
    _closed_later(store)
    _no_kvlife_threads(before)
    _reopen_clean(tmp_path / "s", identity, [(t, kv, None) for t, kv in prompts])


# --------------------------------------------------------------- 4. two closes


def test_callback_close_held_in_its_flush_makes_a_later_close_wait(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """The sink's close (flush=True) is held in its flush's disk write; a ``close(flush=
    False)`` from the main thread must wait for it (not return over a store still
    writing, nor close the tiers under the flush), then return; the reopen holds the
    flushed prompts."""
    before = set(threading.enumerate())
    io = FaultyIO()
    sink = _CloseOn(_kind("index"), flush=True)
    store = _open(tmp_path / "s", io, sink=sink)
    p0 = prompt_kv(160, 4 * N)
    store.put_prompt(identity, PUBLIC, *p0)
    sink.store = store
    stall = io.stall("pwritev", path=SEG, timeout_s=STALL_S)
    try:
        p1 = prompt_kv(161, 4 * N)
        assert store.put_prompt(identity, PUBLIC, *p1).stored == 4
        assert stall.wait_entered(), "the deferred close never flushed"
        later = _Call(lambda: store.close(flush=False))
        assert _blocked(later), "a later close returned while the deferred one was flushing"
    finally:
        stall.release()
    later.join(20)
    assert later.error is None, repr(later.error)
    assert not stall.timed_out
    _no_kvlife_threads(before)
    _reopen_clean(tmp_path / "s", identity, [(*p0, 4), (*p1, 4)])


def test_a_later_close_that_runs_first_still_waits_for_the_flush_asked_before_it(
    tmp_path: Path, identity: ModelIdentity, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sink asks ``close(flush=True)`` on a put's 'index'; the thread that runs it is
    slow to begin (held 0.3 s here, a loaded machine's scheduling), and the main
    thread's ``close(flush=False)``, asked after it, reaches the store first. That
    later close waits for the one asked before it, so the flush asked runs: the reopen
    serves the prompt from disk. (Until 2026-12-07 the later close took the store and
    closed it without the flush; the deferred one found it closing and did nothing:
    seen as a flaky failure of the EIO test below under a full test run.)"""
    from kvlife.store import lifecycle

    original = lifecycle._close_logged

    def slow_start(*args: Any) -> None:
        time.sleep(0.3)
        original(*args)

    monkeypatch.setattr(lifecycle, "_close_logged", slow_start)
    before = set(threading.enumerate())
    sink = _CloseOn(_kind("index"), flush=True)
    store = _open(tmp_path / "s", sink=sink)
    sink.store = store
    tokens, kv = prompt_kv(163, 4 * N)
    assert store.put_prompt(identity, PUBLIC, tokens, kv).stored == 4
    assert sink.fired.is_set() and sink.errors == [], sink.errors
    _closed_later(store, flush=False)
    assert store._core.close_done.is_set()
    _no_kvlife_threads(before)
    _reopen_clean(tmp_path / "s", identity, [(tokens, kv, 4)])


def test_callback_close_during_a_close_from_another_thread(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """``close(flush=True)`` from a thread, held in its flush's write; the flush's
    'offload>disk' events reach a sink that closes again (from inside the close's own
    callback). Both end, no thread is left, the reopen holds the prompt."""
    before = set(threading.enumerate())
    io = FaultyIO()
    sink = _CloseOn(_kind("offload", "disk"), flush=False, times=2)
    store = _open(tmp_path / "s", io, sink=sink)
    tokens, kv = prompt_kv(162, 4 * N)
    store.put_prompt(identity, PUBLIC, tokens, kv)
    sink.store = store
    stall = io.stall("pwritev", path=SEG, timeout_s=STALL_S)
    try:
        first = _Call(lambda: store.close(flush=True))
        assert stall.wait_entered()
        assert _blocked(first)
    finally:
        stall.release()
    first.join(20)
    assert first.error is None, repr(first.error)
    assert sink.fired.is_set() and sink.errors == [], sink.errors
    _no_kvlife_threads(before)
    _reopen_clean(tmp_path / "s", identity, [(tokens, kv, 4)])


# --------------------------------------------------------------- 5. a deferred close that fails


def test_deferred_close_whose_flush_fails_is_logged_and_a_later_close_returns(
    tmp_path: Path, identity: ModelIdentity, caplog: pytest.LogCaptureFixture
) -> None:
    """Every write to a segment file fails with EIO; the sink closes (flush) on a put's
    'index'. The deferred close's flush fails: its error is logged once (naming the
    store and the write's EIO), the later close returns (not hangs, not raises: it did not
    close), the directory lock is dropped (a reopen succeeds), the reopen audits clean
    and serves the prompt exact or not at all."""
    before = set(threading.enumerate())
    io = FaultyIO()
    sink = _CloseOn(_kind("index"), flush=True)
    store = _open(tmp_path / "s", io, sink=sink)
    sink.store = store
    io.arm("pwritev", errno.EIO, path=SEG)
    tokens, kv = prompt_kv(170, 4 * N)
    with caplog.at_level(logging.ERROR, logger="kvlife.store.lifecycle"):
        putting = _Call(lambda: store.put_prompt(identity, PUBLIC, tokens, kv))
        putting.join(10)
        _typed(putting.error)
        _closed_later(store)
        _no_kvlife_threads(before)
    assert io.injected.get("pwritev", 0) >= 1, io.injected
    logged = [r.getMessage() for r in caplog.records if "inside a callback" in r.getMessage()]
    assert len(logged) == 1, [r.getMessage() for r in caplog.records]
    assert str(tmp_path / "s") in logged[0] and "EIO" in logged[0], logged[0]
    io.disarm()
    _reopen_clean(tmp_path / "s", identity, [(tokens, kv, None)])  # its flush failed


# --------------------------------------------------------------- 6. the process exits

_CHILD = textwrap.dedent(
    """
    import sys, threading, time
    sys.path.insert(0, {repo!r})
    from kvlife.core.events import EventSink
    from kvlife.core.identity import PUBLIC
    from kvlife.store import KVStore
    from tests.conftest import TINY, prompt_kv, tiny_identity

    N = TINY.tokens_per_chunk
    identity = tiny_identity()
    closed = threading.Event()

    class Sink(EventSink):
        store = None

        def emit(self, event):
            if event.kind == "index" and self.store is not None and not closed.is_set():
                self.store.close(flush={flush!r})
                print("closed from", threading.current_thread().name, flush=True)
                closed.set()
                time.sleep({hold!r})  # the put's turn held a while: its close waits

    sink = Sink()
    store = KVStore.open(
        {path!r}, dram_bytes=1 << 20, disk_bytes=16 << 20, segment_bytes=1 << 20,
        write_through={write_through!r}, sink=sink,
    )
    res = store.put_prompt(identity, PUBLIC, *prompt_kv(180, 4 * N))
    print("acked", res.stored, flush=True)
    sink.store = store
    pending = store.prepare_put(identity, PUBLIC, *prompt_kv(181, 4 * N))
    if {via!r} == "daemon-thread":
        threading.Thread(target=lambda: store.commit_put(pending), daemon=True).start()
    else:  # the store's own put thread
        store.put_async(pending)
    assert closed.wait(10)
    print("exiting", flush=True)
    """
)


def _run_child(path: Path, *, flush: bool, write_through: bool, via: str) -> str:
    """The child's stderr, once it exited 0 (within 30 s) after acknowledging its first
    put and closing from the sink."""
    code = _CHILD.format(
        repo=str(REPO), path=str(path), flush=flush, write_through=write_through, hold=1.5, via=via
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "acked 4" in done.stdout and "exiting" in done.stdout, done.stdout
    return done.stderr


@pytest.mark.parametrize("via", ["daemon-thread", "put-async"])
def test_process_exiting_after_a_callback_close_exits_and_keeps_write_through_puts(
    tmp_path: Path, identity: ModelIdentity, via: str
) -> None:
    """A child process: write-through store (a put is durable when acknowledged), a
    sink that closes (flush=False) on the 'index' of a put committed on a daemon thread
    or by ``put_async``, holding that put's turn a while; the main thread exits at
    once. The child exits (no hang), and the reopen audits clean and serves the
    acknowledged put exact."""
    _run_child(tmp_path / "s", flush=False, write_through=True, via=via)
    _reopen_clean(tmp_path / "s", identity, [(*prompt_kv(180, 4 * N), 4)])


# Found by this red team, a strict xfail until mended the same day (2026-12-07):
# close(flush=True) from a sink on put_async's worker, then the main thread exits: the
# deferred close runs on the non-daemon kvlife-close thread after threading._shutdown
# has run concurrent.futures' exit hook (_python_exit), so the first disk write of its
# flush (ThreadPoolExecutor.submit to the disk writer's kvlife-io pool) raises an
# untyped RuntimeError('cannot schedule new futures after interpreter shutdown'); the
# close is logged as failed with it and the put acknowledged before the close is not on
# disk after the reopen
def test_process_exiting_after_a_callback_close_flushes_what_was_acknowledged(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """As above without write-through, ``close(flush=True)`` from the sink on the put
    thread: the put acknowledged (in DRAM) before the close must be on disk after the
    reopen, and the close must not fail."""
    stderr = _run_child(tmp_path / "s", flush=True, write_through=False, via="put-async")
    _reopen_clean(tmp_path / "s", identity, [(*prompt_kv(180, 4 * N), 4)])
    assert "failed" not in stderr, stderr[-2000:]


# Found by this red team, a strict xfail until mended the same day (2026-12-07):
# close(flush=True) from a sink running on a daemon thread, then the main thread exits:
# threading.Thread inherits daemon=True from the thread that starts it, so kvlife-close
# is a daemon thread the interpreter does not wait for; the close never runs
# (store._core.closed still False at exit, nothing logged) and the put acknowledged
# before the close is not on disk after the reopen
def test_process_exiting_after_a_callback_close_on_a_daemon_thread_still_closes(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """As above, the put whose 'index' reaches the sink committed on a daemon thread:
    the close asked must still happen (the flushed put on disk after the reopen)."""
    stderr = _run_child(tmp_path / "s", flush=True, write_through=False, via="daemon-thread")
    _reopen_clean(tmp_path / "s", identity, [(*prompt_kv(180, 4 * N), 4)])
    assert "failed" not in stderr, stderr[-2000:]


# --------------------------------------------------------------- 7. threads after the close


# Found by this red team, a strict xfail until mended the same day (2026-12-07):
# put_async made while a close runs its flush (a deferred close from a callback returns
# at once, so the caller goes on): Writer.put_async checks only core.closed, finds the
# pool writer.close() already shut and set to None, and starts a new ThreadPoolExecutor
# nobody shuts; its 'kvlife-put_0' thread is still alive after the later close()
# returned (unforced, a second put_async right after one whose sink closed the store
# leaked it in 52 of 150 runs)
def test_put_async_while_a_callback_close_flushes_leaks_no_thread(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """A put prepared before; the sink closes (flush=True) on another put's 'index'; the
    close is held in its flush's write while the caller ``put_async``s the prepared put.
    The future ends typed (the close aborted it), the later close returns, and no
    ``kvlife-*`` thread is left running."""
    before = set(threading.enumerate())
    io = FaultyIO()
    sink = _CloseOn(_kind("index"), flush=True)
    store = _open(tmp_path / "s", io, sink=sink)
    p0 = prompt_kv(190, 4 * N)
    store.put_prompt(identity, PUBLIC, *p0)
    pending = store.prepare_put(identity, PUBLIC, *prompt_kv(191, 4 * N))
    sink.store = store
    stall = io.stall("pwritev", path=SEG, timeout_s=STALL_S)
    try:
        store.put_prompt(identity, PUBLIC, *prompt_kv(192, 4 * N))
        assert stall.wait_entered(), "the deferred close never flushed"
        fut = None
        with contextlib.suppress(StoreClosedError):
            fut = store.put_async(pending)
    finally:
        stall.release()
    if fut is not None:
        assert isinstance(fut.exception(10), KVLifeError), repr(fut.exception(10))
    _closed_later(store)
    try:
        _no_kvlife_threads(before, timeout_s=1.0)
    finally:
        writer = store._writer
        if writer._pool is not None:  # do not leak it into the other tests
            writer._pool.shutdown(wait=True)
    _reopen_clean(tmp_path / "s", identity, [(*p0, 4)])


class _BatchingSink(EventSink):
    """A sink that hands its events to ``consumer`` in batches, at ``flush`` (the store
    flushes its sink when it closes); the consumer closes the store on an 'index'."""

    def __init__(self) -> None:
        self.store: KVStore | None = None
        self.buffer: list[LifecycleEvent] = []
        self.close_on_index = False
        self.closed_from: list[str] = []

    def emit(self, event: LifecycleEvent) -> None:
        self.buffer.append(event)
        if self.close_on_index and event.kind == "index" and self.store is not None:
            self.close_on_index = False
            self.store.close(flush=False)

    def flush(self) -> None:
        batch, self.buffer = self.buffer, []
        for event in batch:  # the consumer
            if event.kind == "index" and self.store is not None and not self.closed_from:
                self.closed_from.append(threading.current_thread().name)
                self.store.close(flush=False)


# Found by this red team, a strict xfail until mended the same day (2026-12-07): close()
# called from the event sink's flush(), which the store calls inside close_store
# (core.ledger.flush among the releases) but does not mark as a callback
# (kvlife/store/callbacks.py covers emit and progress only): that close finds
# core.closing set and waits on core.close_done, which only the close running the flush
# sets, so the close never returns (deferred: the kvlife-close thread and the later
# close() both hang; the non-daemon kvlife-close thread would also keep the process from
# exiting)
@pytest.mark.parametrize("how", ["close-from-a-thread", "deferred-from-emit"])
def test_close_from_the_sinks_flush_returns(
    tmp_path: Path, identity: ModelIdentity, how: str
) -> None:
    """A batching sink whose consumer closes the store from ``flush()``: the close that
    flushed the sink must return, the store close, and the directory reopen clean."""
    sink = _BatchingSink()
    store = _open(tmp_path / "s", sink=sink)
    tokens, kv = prompt_kv(200, 4 * N)
    sink.store = store
    sink.close_on_index = how == "deferred-from-emit"
    store.put_prompt(identity, PUBLIC, tokens, kv)
    closing = _Call(lambda: store.close(flush=False))
    try:
        assert closing.done(3), "close never returned: the close from the sink's flush waits for it"
        assert closing.error is None, repr(closing.error)
    finally:
        store._core.close_done.set()  # let the hung closes go (test cleanup only)
        closing.join(10)
        for t in threading.enumerate():
            if t.name == "kvlife-close":
                t.join(10)
    assert sink.closed_from, "the sink's flush never ran"
    _reopen_clean(tmp_path / "s", identity, [(tokens, kv, None)])


class _PauseAfterSet(threading.Event):
    """``close_done`` whose ``set()`` by the ``kvlife-close`` thread is followed by a
    pause (a thread switch right after it), until ``resume``: changes only timing."""

    def __init__(self) -> None:
        super().__init__()
        self.resume = threading.Event()

    def set(self) -> None:
        super().set()
        if threading.current_thread().name == "kvlife-close":
            self.resume.wait(5)


# Found by this red team, a strict xfail until mended the same day (2026-12-07):
# close_store sets core.close_done in its finally before it raises its error, and
# _close_logged logs that error only after: a later close() (waiting on close_done)
# returns while the kvlife-close thread is still running and before the deferred close's
# error is logged (forced here by a pause right after close_done.set(); unforced, 39 of
# 100 runs saw it)
def test_a_later_close_returns_only_once_the_deferred_close_ended_and_logged(
    tmp_path: Path, identity: ModelIdentity, caplog: pytest.LogCaptureFixture
) -> None:
    """The deferred close fails (its flush's writes fail with EIO). Once the later
    ``close()`` returned, the failure is logged and no ``kvlife-close`` thread runs."""
    io = FaultyIO()
    sink = _CloseOn(_kind("index"), flush=True)
    store = _open(tmp_path / "s", io, sink=sink)
    sink.store = store
    pause = _PauseAfterSet()
    store._core.close_done = pause
    io.arm("pwritev", errno.EIO, path=SEG)
    try:
        with caplog.at_level(logging.ERROR, logger="kvlife.store.lifecycle"):
            store.put_prompt(identity, PUBLIC, *prompt_kv(210, 4 * N))
            _wait(lambda: store._core.closing, "the deferred close to start", 10)
            _closed_later(store)
            alive = [t.name for t in threading.enumerate() if t.name == "kvlife-close"]
            logged = [r for r in caplog.records if "inside a callback" in r.getMessage()]
        assert alive == [], f"still running after a later close() returned: {alive}"
        assert len(logged) == 1, "the deferred close's error was not logged yet"
    finally:
        pause.resume.set()
        for t in threading.enumerate():
            if t.name == "kvlife-close":
                t.join(10)

"""Red team of the order of concurrent closes (kvlife/store/lifecycle.py: a close asked
from inside a callback owns the store from the moment it is asked: ``closing`` and
``core.closer`` set, and its ``kvlife-close`` thread started, all under the store's lock;
a later ``close()`` waits for it and joins it; a close asked from a callback once one was
asked returns at once with no thread; a thread that cannot start gives the store back
untouched; docs/store.md, the paragraph "Closing from inside a callback").

``tests/attack/test_close_from_callback_attack.py`` holds the closer thread with a sleep
once; this file forces each interleaving with events instead (no sleep decides an
outcome; every wait and join is bounded, every hold released in ``finally``):

1. two callback closes (an event sink's ``emit``, ``check()``'s ``progress``) asking
   different flushes and a close from the main thread, in both orders, the first
   closer thread held at its start; the thread that ran the
   callback (a caller's, ``put_async``'s worker) closing once its call returned; a
   close from the sink's ``flush()`` inside the held close; loads racing the release;
2. a callback close while another thread's close is held in its flush's write;
3. a deferred close that fails (its flush's writes fail) after a later close came first;
4. a closer thread that cannot start, before and while a later close waits for it;
5. puts once a later close waits (docs: ``close()`` first stops taking puts);
6. the ``kvlife-close`` threads of a second callback close after a later close returned;
7. a child process that closes from a callback, then closes again or just exits;
8. unforced: callbacks closing with random flushes from three putting threads, a
   loader, a main-thread close, a few rounds.

Promises held to (the contract above): every close ends; a later close returns only
once the store is closed (``core.close_done``); the close asked first runs with its
flush (a ``flush=True`` one keeps every put acknowledged before it, a ``flush=False``
one asked first is not overridden by a later ``flush=True``); no ``kvlife-*`` thread is
left; the directory lock is released (the reopen audits clean); the deferred close's
error is logged; every KV served is exact.

Faults found by this red team in the first version of that fix (130a6fc), all mended
the same day, each test failing before: a later close that reached the store while the
closer thread's ``start()`` was failing waited forever (section 4); a later close
waiting for a held closer did not stop puts (section 5); a later close returned while a
second callback's ``kvlife-close`` thread still ran (section 6, also before 130a6fc).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import random
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest

from kvlife.core.errors import CloseNotStarted, KVLifeError, StoreClosedError
from kvlife.core.events import LifecycleEvent
from kvlife.core.identity import PUBLIC, ModelIdentity
from kvlife.faults.fileio import FaultyIO
from kvlife.results import LoadResult, PutResult
from kvlife.store import KVStore, lifecycle
from tests.attack.test_close_from_callback_attack import _CloseOn, _kind, _no_kvlife_threads
from tests.conftest import TINY, prompt_kv
from tests.helpers.store_threads import Call, CloseOnce, assert_exact, open_small, wait_until

N = TINY.tokens_per_chunk
SEG = "seg-*"
HOLD_S = 10.0
"""A held closer thread or thread start goes on by itself after this long (a broken
test cannot hang)."""
DONE_S = 5.0
"""How long a close may take once nothing holds it any more."""
REPO = Path(__file__).resolve().parents[2]

Prompt = tuple[np.ndarray, np.ndarray]


# --------------------------------------------------------------- helpers


class _Held:
    """Every ``kvlife-close`` thread held at its start (before ``close_store``) until
    released; slot ``i`` is the ``i``-th thread to begin (a test waits for ``entered[i]``
    before it asks the next close, so the slot is the order asked)."""

    SLOTS = 8

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.original = lifecycle._close_logged
        self.entered = [threading.Event() for _ in range(self.SLOTS)]
        self.go = [threading.Event() for _ in range(self.SLOTS)]
        self._lock = threading.Lock()
        self._n = 0
        monkeypatch.setattr(lifecycle, "_close_logged", self._run)

    def _run(self, *args: Any) -> None:
        with self._lock:
            i, self._n = self._n, self._n + 1
        self.entered[i].set()
        self.go[i].wait(HOLD_S)
        self.original(*args)

    def release_all(self) -> None:
        for go in self.go:
            go.set()


class _Watched(threading.Event):
    """``core.close_done`` that counts the calls waiting on it; with ``pause_others``,
    a ``kvlife-close`` thread that is not ``core.closer`` pauses right after its wait
    returned (a thread switch there), until ``resume``. Changes only timing."""

    def __init__(self, store: KVStore, pause_others: bool = False) -> None:
        super().__init__()
        self.core = store._core
        self.pause_others = pause_others
        self.resume = threading.Event()
        self._count = threading.Lock()
        self.waiters = 0
        self.core.close_done = self

    def wait(self, timeout: float | None = None) -> bool:
        with self._count:
            self.waiters += 1
        done = super().wait(timeout)
        me = threading.current_thread()
        if self.pause_others and me.name == "kvlife-close" and me is not self.core.closer:
            self.resume.wait(HOLD_S)
        return done


class _Shots(_CloseOn):
    """``_CloseOn`` on 'index' that closes once per :meth:`arm` (the flush given there),
    so that each put closes once, with its own flush."""

    def __init__(self) -> None:
        self._shots: list[bool] = []
        super().__init__(self._take, every=True)

    def _take(self, event: LifecycleEvent) -> bool:
        if event.kind != "index" or not self._shots:
            return False
        self.close_flush = self._shots.pop()
        return True

    def arm(self, store: KVStore, flush: bool) -> None:
        self.store = store
        self._shots.append(flush)


def _later(store: KVStore, flush: bool) -> Call:
    return Call(lambda: store.close(flush=flush))


def _ended(call: Call, store: KVStore, what: str) -> None:
    """``call`` (a close) returned without error, and only once the store was closed."""
    call.join(DONE_S)
    assert call.error is None, f"{what}: {call.error!r}"
    assert store._core.close_done.is_set(), f"{what} returned before the store was closed"


def _served(path: Path, identity: ModelIdentity, want: list[tuple[Prompt, int | None]]) -> None:
    """The directory reopens (its lock released), audits clean and serves each prompt's
    ``n`` chunks exact (None: any leading chunks, each exact)."""
    with open_small(path) as again:
        assert again.check().problems == []
        for (tokens, kv), n in want:
            got = again.get(identity, PUBLIC, tokens)
            if n is not None:
                assert got.loaded == n, (got.loaded, n)
            assert_exact(got.arrays, kv)


def _base(store: KVStore, identity: ModelIdentity, seed: int) -> tuple[Prompt, Prompt]:
    """A prompt on disk (so that ``check()`` has rows to call ``progress`` for) and one
    acknowledged in DRAM only: on disk after the reopen iff a flush ran."""
    on_disk, in_dram = prompt_kv(seed, 4 * N), prompt_kv(seed + 1, 4 * N)
    assert store.put_prompt(identity, PUBLIC, *on_disk).stored == 4
    store.flush()
    assert store.put_prompt(identity, PUBLIC, *in_dram).stored == 4
    return on_disk, in_dram


class _Rig(NamedTuple):
    """A store held for the tests of sections 1-3: every closer thread held at its start,
    ``close_done`` watched, one prompt on disk and one acknowledged in DRAM only."""

    hold: _Held
    before: set[threading.Thread]
    path: Path
    store: KVStore
    watched: _Watched
    prompts: tuple[Prompt, Prompt]


def _rig(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    identity: ModelIdentity,
    sink: _Shots,
    seed: int,
    io: FaultyIO | None = None,
) -> _Rig:
    hold = _Held(monkeypatch)
    before = set(threading.enumerate())
    path = tmp_path / "s"
    store = open_small(path, io, sink=sink)
    watched = _Watched(store)
    return _Rig(hold, before, path, store, watched, _base(store, identity, seed))


def _first_held_later_waits(
    hold: _Held, sink: _Shots, store: KVStore, put: Callable[[], object]
) -> None:
    """The sink asks ``close(flush=True)`` on ``put``'s 'index' (its thread held); the
    main thread's ``close(flush=False)`` does not return while it is held, and returns
    once it was released and the store is closed."""
    try:
        sink.arm(store, True)
        put()
        assert hold.entered[0].wait(DONE_S)
        main = _later(store, False)
        assert not main.done(0.1), "a later close returned while the first was held"
    finally:
        hold.release_all()
    _ended(main, store, "the main thread's close")


@contextlib.contextmanager
def _start_fails(hold: bool) -> Iterator[tuple[threading.Event, threading.Event]]:
    """``Thread.start`` of the first ``kvlife-close`` thread raises RuntimeError (no
    thread: the interpreter exiting, no memory), after waiting for ``gate`` if ``hold``;
    ``entered`` is set once it is in ``start``. Other threads start as usual."""
    original = threading.Thread.start
    entered, gate = threading.Event(), threading.Event()
    failed: list[threading.Thread] = []

    def start(thread: threading.Thread) -> None:
        if thread.name == "kvlife-close" and not failed:
            failed.append(thread)
            entered.set()
            if hold:
                gate.wait(HOLD_S)
            raise RuntimeError("can't start new thread")
        original(thread)

    setattr(threading.Thread, "start", start)  # noqa: B010 (a method of the class)
    try:
        yield entered, gate
    finally:
        setattr(threading.Thread, "start", original)  # noqa: B010
        gate.set()


# --------------------------------------------------------------- 1. closes asked in order


@pytest.mark.parametrize("order", ["sink,progress,main", "sink,main,progress"])
@pytest.mark.parametrize("first_flush", [True, False])
def test_the_close_asked_first_runs_with_its_flush_whatever_the_order_after_it(
    tmp_path: Path,
    identity: ModelIdentity,
    monkeypatch: pytest.MonkeyPatch,
    first_flush: bool,
    order: str,
) -> None:
    """A sink asks ``close(flush=first_flush)`` on a put's 'index' (its thread held at its
    start); then, in ``order``, ``check()``'s progress asks the other flush and the main
    thread asks the other flush. The progress close returns at once and starts no
    thread of its own (a close was asked before it); the main thread's waits: neither
    closes the store while the first is held. Once it is released every close ends, the
    main one only once the store is closed; no thread is left; the reopen is clean and
    holds the DRAM-only prompt iff the first close asked a flush (the later
    ``flush=True`` never ran over a ``flush=False`` asked first, nor a ``flush=False``
    over a ``flush=True``)."""
    sink = _Shots()
    hold, before, path, store, watched, (on_disk, in_dram) = _rig(
        monkeypatch, tmp_path, identity, sink, 300
    )
    main: Call | None = None
    checking: Call | None = None
    progress = CloseOnce(store, flush=not first_flush)
    try:
        sink.arm(store, first_flush)
        putting = Call(lambda: store.put_prompt(identity, PUBLIC, *prompt_kv(302, 4 * N)))
        putting.join(DONE_S)
        assert putting.error is None and sink.errors == [], (putting.error, sink.errors)
        assert hold.entered[0].wait(DONE_S), "the sink's close started no thread"
        for who in order.split(",")[1:]:
            if who == "main":
                main = _later(store, not first_flush)
                wait_until(lambda: watched.waiters >= 1, "the later close to wait", DONE_S)
            else:
                checking = Call(lambda: store.check(progress=progress))
                wait_until(lambda: bool(progress.calls), "the progress close", DONE_S)
        assert main is not None and checking is not None
        assert not main.done(0.05), "a later close returned while the first was held"
        assert not store._core.closed, "a later close closed the store before the first"
        assert not hold.entered[1].is_set(), "a close asked after another started a thread"
        hold.go[0].set()
        _ended(main, store, "the main thread's close")
        checking.join(DONE_S)
    finally:
        hold.release_all()
    assert progress.calls == [None], progress.calls
    assert checking.error is None or isinstance(checking.error, KVLifeError), checking.error
    if checking.error is None:
        assert checking.result.problems == []  # type: ignore[attr-defined]
    _no_kvlife_threads(before)
    _served(path, identity, [(on_disk, 4), (in_dram, 4 if first_flush else 0)])


@pytest.mark.parametrize("via", ["caller-thread", "put-async-worker"])
def test_the_thread_that_ran_the_callback_closing_next_waits_for_the_flush(
    tmp_path: Path, identity: ModelIdentity, monkeypatch: pytest.MonkeyPatch, via: str
) -> None:
    """The sink asks ``close(flush=True)`` on a put's 'index', run on the caller's
    thread or on ``put_async``'s worker; the closer thread is held. That caller, once its
    put returned, closes with ``flush=False``: its close waits (does not begin, does not
    return) while the closer is held, then returns once the store is closed; the reopen
    holds the DRAM-only prompts (the flush asked first ran)."""
    sink = _Shots()
    hold, before, path, store, _, (on_disk, in_dram) = _rig(
        monkeypatch, tmp_path, identity, sink, 310
    )
    last = prompt_kv(312, 4 * N)

    def put_then_close() -> None:
        sink.arm(store, True)
        if via == "caller-thread":
            res = store.put_prompt(identity, PUBLIC, *last)
        else:
            res = store.put_async(store.prepare_put(identity, PUBLIC, *last)).result(DONE_S)
        assert res.stored == 4
        store.close(flush=False)

    try:
        closing = Call(put_then_close)
        assert hold.entered[0].wait(DONE_S), "the sink's close started no thread"
        assert not closing.done(0.2), "the caller's close returned while the closer was held"
        assert not store._core.closed, "the caller's close closed the store before the first"
    finally:
        hold.release_all()
    _ended(closing, store, "the caller's close")
    assert sink.errors == [], sink.errors
    want = "kvlife-put" if via == "put-async-worker" else "Thread"
    assert sink.fired_on and sink.fired_on[0].startswith(want), sink.fired_on
    _no_kvlife_threads(before)
    _served(path, identity, [(on_disk, 4), (in_dram, 4), (last, 4)])


class _FlushCloses(_Shots):
    """``_Shots`` whose ``flush()`` (run by the store inside its close) closes again."""

    def __init__(self) -> None:
        super().__init__()
        self.from_flush: list[BaseException | None] = []

    def flush(self) -> None:
        if self.store is not None and not self.from_flush:
            try:
                self.store.close(flush=False)
                self.from_flush.append(None)
            except BaseException as exc:  # reported by the test
                self.from_flush.append(exc)


def test_close_from_the_sinks_flush_inside_a_held_close_with_a_later_close_waiting(
    tmp_path: Path, identity: ModelIdentity, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sink asks ``close(flush=True)`` on an 'index' (closer held); the main thread's
    ``close(flush=False)`` waits; once released, the close calls the sink's ``flush()``,
    which closes again (``flush=False``, deferred as a callback). Every close ends, the
    main one only once the store is closed, no thread is left, and the flush asked
    first ran (the DRAM-only prompt is on disk after the reopen)."""
    sink = _FlushCloses()
    hold, before, path, store, _, (on_disk, in_dram) = _rig(
        monkeypatch, tmp_path, identity, sink, 320
    )
    last = prompt_kv(322, 4 * N)
    _first_held_later_waits(hold, sink, store, lambda: store.put_prompt(identity, PUBLIC, *last))
    assert sink.from_flush == [None], sink.from_flush
    _no_kvlife_threads(before)
    _served(path, identity, [(on_disk, 4), (in_dram, 4)])


def test_loads_racing_a_held_close_and_its_release_serve_exact_or_typed(
    tmp_path: Path, identity: ModelIdentity, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loader thread loads both prompts in a loop (exact, or StoreClosedError once
    the store is closed); ``check()`` runs while the closer is held and the main
    thread's ``close(flush=False)`` waits (clean or typed); the closer (``flush=True``)
    is released under the loads. Everything ends; the reopen holds the DRAM-only prompt."""
    sink = _Shots()
    hold, before, path, store, _, prompts = _rig(monkeypatch, tmp_path, identity, sink, 330)
    stop = threading.Event()
    served = [0]

    def loads() -> None:
        while not stop.is_set():
            for tokens, kv in prompts:
                try:
                    got = store.get(identity, PUBLIC, tokens)
                except StoreClosedError:
                    return
                assert_exact(got.arrays, kv)
                served[0] += got.loaded

    try:
        sink.arm(store, True)
        assert store.put_prompt(identity, PUBLIC, *prompt_kv(332, 4 * N)).stored == 4
        assert hold.entered[0].wait(DONE_S)
        main = _later(store, False)
        loading = Call(loads)
        try:
            report = store.check()
            assert report.problems == [], report.problems
        except StoreClosedError:
            pass
        wait_until(lambda: served[0] > 0, "a load to serve while the close waits", DONE_S)
    finally:
        hold.release_all()
    try:
        _ended(main, store, "the main thread's close")
        loading.join(DONE_S)
    finally:
        stop.set()
    assert loading.error is None, repr(loading.error)
    _no_kvlife_threads(before)
    _served(path, identity, [(prompts[0], 4), (prompts[1], 4)])


# --------------------------------------------------------------- 2. a close already flushing


def test_progress_close_while_another_threads_close_is_held_in_its_flush(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """A thread's ``close(flush=True)`` is held in its flush's write; ``check()`` on a
    second thread (the store is closing, not closed) closes from its progress
    (``flush=False``), and a third thread closes (``flush=False``). Neither later close
    returns while the first flushes; all end, each only once the store is closed; no
    thread is left; the audit is clean or typed; the reopen holds both prompts (the
    flush asked first ran to its end)."""
    before = set(threading.enumerate())
    io = FaultyIO()
    path = tmp_path / "s"
    store = open_small(path, io)
    on_disk, in_dram = _base(store, identity, 340)
    progress = CloseOnce(store, flush=False)
    stall = io.stall("pwritev", path=SEG, timeout_s=HOLD_S)
    try:
        first = _later(store, True)
        assert stall.wait_entered(), "the first close never flushed"
        checking = Call(lambda: store.check(progress=progress))
        wait_until(lambda: bool(progress.calls) or not checking.alive(), "progress", DONE_S)
        third = _later(store, False)
        assert not third.done(0.2), "a later close returned while the first was flushing"
        assert not first.alive() or not store._core.close_done.is_set()
    finally:
        stall.release()
    _ended(first, store, "the first close")
    _ended(third, store, "the third close")
    checking.join(DONE_S)
    assert not stall.timed_out
    assert progress.calls in ([], [None]), progress.calls
    if checking.error is None:
        assert checking.result.problems == []  # type: ignore[attr-defined]
    else:
        assert isinstance(checking.error, KVLifeError), repr(checking.error)
    _no_kvlife_threads(before)
    _served(path, identity, [(on_disk, 4), (in_dram, 4)])


# --------------------------------------------------------------- 3. a deferred close that fails


def test_deferred_close_that_fails_after_a_later_close_came_first_is_logged_once(
    tmp_path: Path,
    identity: ModelIdentity,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Segment writes fail with EIO; the sink asks ``close(flush=True)`` (closer held),
    the main thread's ``close(flush=False)`` reaches the store first and waits. Released,
    the deferred close's flush fails: the later close returns without raising once the
    store is closed, the error (EIO, naming the store) is logged once, the directory
    lock is dropped and the reopen audits clean."""
    io = FaultyIO()
    sink = _Shots()
    hold, before, path, store, _, (on_disk, in_dram) = _rig(
        monkeypatch, tmp_path, identity, sink, 350, io
    )
    io.arm("pwritev", errno.EIO, path=SEG)
    with caplog.at_level(logging.ERROR, logger="kvlife.store.lifecycle"):
        last = prompt_kv(352, 4 * N)
        _first_held_later_waits(
            hold, sink, store, lambda: store.put_prompt(identity, PUBLIC, *last)
        )
        _no_kvlife_threads(before)
    assert io.injected.get("pwritev", 0) >= 1, "the flush asked first never wrote"
    logged = [r.getMessage() for r in caplog.records if "inside a callback" in r.getMessage()]
    assert len(logged) == 1, [r.getMessage() for r in caplog.records]
    assert str(path) in logged[0] and "EIO" in logged[0], logged[0]
    io.disarm()
    _served(path, identity, [(on_disk, 4), (in_dram, None)])


# --------------------------------------------------------------- 4. no closer thread


@pytest.mark.parametrize("callback", ["sink-emit", "check-progress"])
def test_closer_thread_that_cannot_start_leaves_the_close_to_a_later_one(
    tmp_path: Path, identity: ModelIdentity, callback: str
) -> None:
    """The ``kvlife-close`` thread of a callback's ``close(flush=True)`` cannot start
    (RuntimeError). A later ``close(flush=False)`` from the main thread then closes the
    store: it returns (no hang, no error) once the store is closed, no thread is left,
    the lock is dropped and the reopen is clean."""
    before = set(threading.enumerate())
    sink = _Shots()
    path = tmp_path / "s"
    store = open_small(path, sink=sink)
    on_disk, in_dram = _base(store, identity, 360)
    progress = CloseOnce(store, flush=True)
    with _start_fails(hold=False) as (entered, _):
        if callback == "sink-emit":
            sink.arm(store, True)
            store.put_prompt(identity, PUBLIC, *prompt_kv(362, 4 * N))
            asked: list[Any] = sink.errors
        else:
            store.check(progress=progress)
            asked = progress.calls
        assert entered.is_set(), "no closer thread was started"
    assert len(asked) == 1 and isinstance(asked[0], CloseNotStarted), asked
    assert isinstance(asked[0].__cause__, RuntimeError) and "still open" in str(asked[0])
    main = _later(store, False)
    try:
        assert main.done(DONE_S), "a later close hung after the closer thread failed to start"
        _ended(main, store, "the later close")
    finally:
        store._core.close_done.set()  # cleanup only: let a hung close go
    _no_kvlife_threads(before)
    _served(path, identity, [(on_disk, 4), (in_dram, None)])


# Found by this red team (2026-12-07) in 130a6fc, mended: _close_later set core.closer
# under the lock and started the thread outside it; a close() that reached the store in
# between waited on core.close_done, and when start() raised nobody woke it (the store
# never closed, its lock never dropped). The thread now starts under the lock.
@pytest.mark.parametrize("waiter", ["main-thread-close", "second-callback-close"])
def test_a_close_waiting_while_the_closer_thread_fails_to_start_still_ends(
    tmp_path: Path, identity: ModelIdentity, waiter: str
) -> None:
    """``check()``'s progress asks ``close(flush=True)``; its thread's ``start()`` is
    slow, then fails. Meanwhile another close reaches the store and waits for it: the
    main thread's ``close(flush=False)``, or a sink's (its ``kvlife-close`` thread did
    start). That close must still end within a few seconds once the start failed, and
    the store be closed (a close was asked and nothing else will close it)."""
    before = set(threading.enumerate())
    sink = _CloseOn(_kind("index"), flush=False)
    path = tmp_path / "s"
    store = open_small(path, sink=sink)
    watched = _Watched(store)
    on_disk, in_dram = _base(store, identity, 370)
    progress = CloseOnce(store, flush=True)
    core = store._core
    waiting: Call | None = None
    try:
        with _start_fails(hold=True) as (entered, gate):
            checking = Call(lambda: store.check(progress=progress))
            assert entered.wait(DONE_S), "no closer thread was started"
            if waiter == "main-thread-close":
                waiting = _later(store, False)
            else:
                sink.store = store
                waiting = Call(lambda: store.put_prompt(identity, PUBLIC, *prompt_kv(372, 4 * N)))
            wait_until(lambda: watched.waiters >= 1 or core.closing, "the close to wait", DONE_S)
            gate.set()
            checking.join(DONE_S)
        assert len(progress.calls) == 1 and isinstance(progress.calls[0], CloseNotStarted)
        assert waiting.done(DONE_S), "the waiting close never returned"
        if waiter == "main-thread-close":
            assert waiting.error is None, repr(waiting.error)
        wait_until(core.close_done.is_set, "the store to be closed by the close asked", 3.0)
        _no_kvlife_threads(before, timeout_s=2.0)
    finally:
        watched.set()  # cleanup only: free the waiting closes, then really close
        if waiting is not None:
            waiting.join(DONE_S)
        if not core.closing:
            store.close(flush=False)
        for t in threading.enumerate():
            if t.name == "kvlife-close":
                t.join(DONE_S)
    _served(path, identity, [(on_disk, 4), (in_dram, None)])


# --------------------------------------------------------------- 5. puts while a close waits


# Found by this red team (2026-12-07) in 130a6fc, mended: a close() waiting for a
# deferred close asked before it did not mark the store closing, so until the closer
# thread began puts were prepared, committed and acknowledged after close() was called
# (docs/store.md: "close() first stops taking puts"). The close asked from the callback
# now sets closing when it is asked.
def test_no_put_is_taken_once_a_later_close_waits_for_the_held_closer(
    tmp_path: Path, identity: ModelIdentity, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sink asks ``close(flush=False)`` (closer held); the main thread's ``close()``
    has begun (it waits). A ``put_async`` and a ``prepare_put`` made now are refused
    with StoreClosedError (raised, or the future's)."""
    hold = _Held(monkeypatch)
    sink = _Shots()
    store = open_small(tmp_path / "s", sink=sink)
    watched = _Watched(store)
    core = store._core
    pending = store.prepare_put(identity, PUBLIC, *prompt_kv(381, 4 * N))
    outcomes: list[object] = []
    try:
        sink.arm(store, False)
        store.put_prompt(identity, PUBLIC, *prompt_kv(380, 4 * N))
        assert hold.entered[0].wait(DONE_S)
        main = _later(store, True)
        wait_until(lambda: watched.waiters >= 1 or core.closing, "the later close", DONE_S)
        try:
            outcomes.append(store.put_async(pending).result(DONE_S))
        except KVLifeError as exc:
            outcomes.append(exc)
        try:
            outcomes.append(store.prepare_put(identity, PUBLIC, *prompt_kv(382, 4 * N)))
        except KVLifeError as exc:
            outcomes.append(exc)
    finally:
        hold.release_all()
    _ended(main, store, "the later close")
    assert all(isinstance(o, StoreClosedError) for o in outcomes), outcomes


# --------------------------------------------------------------- 6. a second closer thread


# Found by this red team (2026-12-07), mended (also before 130a6fc): every close asked
# from a callback started a kvlife-close thread, a later close() joined only the first,
# and a second one could still run when it returned (35 of 100 unforced runs). A close
# asked from a callback once one was asked now returns at once, with no thread.
def test_a_later_close_returns_only_once_every_closer_thread_ended(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """The sink calls ``close()`` twice in one 'index' event: two ``kvlife-close``
    threads, the second waiting for the first. The second is paused right after its wait
    returned (a thread switch). Once the main thread's ``close()`` returned, no
    ``kvlife-close`` thread runs."""
    sink = _CloseOn(_kind("index"), flush=True, times=2)
    store = open_small(tmp_path / "s", sink=sink)
    watched = _Watched(store, pause_others=True)
    sink.store = store
    try:
        assert store.put_prompt(identity, PUBLIC, *prompt_kv(390, 4 * N)).stored == 4
        assert sink.errors == [], sink.errors
        main = _later(store, False)
        _ended(main, store, "the later close")
        alive = [t.name for t in threading.enumerate() if t.name == "kvlife-close"]
        assert alive == [], f"still running after a later close() returned: {alive}"
    finally:
        watched.resume.set()
        for t in threading.enumerate():
            if t.name == "kvlife-close":
                t.join(DONE_S)


# --------------------------------------------------------------- 7. the process exits

_CHILD = textwrap.dedent(
    """
    import sys, threading
    sys.path.insert(0, {repo!r})
    from kvlife.core.events import EventSink
    from kvlife.core.identity import PUBLIC
    from kvlife.store import KVStore, lifecycle
    from tests.conftest import TINY, prompt_kv, tiny_identity

    N = TINY.tokens_per_chunk
    identity = tiny_identity()
    go = threading.Event()
    original = lifecycle._close_logged

    def held(*args):
        go.wait(10)  # the closer begins once a later close waits, or once the exit began
        original(*args)

    lifecycle._close_logged = held

    class Watched(threading.Event):
        def wait(self, timeout=None):
            go.set()
            return super().wait(timeout)

    class Sink(EventSink):
        store = None

        def emit(self, event):
            if event.kind == "index" and self.store is not None:
                store, self.store = self.store, None
                store.close(flush=True)

    sink = Sink()
    store = KVStore.open(
        {path!r}, dram_bytes=1 << 20, disk_bytes=16 << 20, segment_bytes=1 << 20, sink=sink
    )
    store._core.close_done = Watched()
    sink.store = store
    res = store.put_prompt(identity, PUBLIC, *prompt_kv({seed!r}, 4 * N))
    print("acked", res.stored, flush=True)
    if {how!r} == "later-close":
        store.close(flush=False)
        print("closed", store._core.close_done.is_set(), flush=True)
    else:
        threading._register_atexit(go.set)  # runs before the closer's join (reversed)
    print("exiting", flush=True)
    """
)


@pytest.mark.parametrize("how", ["later-close", "exit"])
def test_child_process_closing_from_a_callback_then_closing_or_exiting_keeps_the_flush(
    tmp_path: Path, identity: ModelIdentity, how: str
) -> None:
    """A child process: the sink asks ``close(flush=True)`` on the 'index' of a put
    acknowledged in DRAM; its closer thread is held until the main thread's
    ``close(flush=False)`` waits for it, or until the interpreter's exit began (the
    main thread just returns). The child exits 0 within 30 s, logs no failure, and the
    reopen serves the put from disk (the flush asked first ran)."""
    path = tmp_path / "s"
    code = _CHILD.format(repo=str(REPO), path=str(path), seed=395, how=how)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "acked 4" in done.stdout and "exiting" in done.stdout, done.stdout
    if how == "later-close":
        assert "closed True" in done.stdout, done.stdout
    assert "failed" not in done.stderr, done.stderr[-2000:]
    _served(path, identity, [(prompt_kv(395, 4 * N), 4)])


# --------------------------------------------------------------- 8. unforced


class _Recorder(_CloseOn):
    """Closes once per putting thread, on its first 'index' (emitted under the store's
    lock, so the order recorded is the order the closes were asked), with a random
    flush; ``asked`` keeps the flushes in that order."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.asked: list[bool] = []
        self.seen: set[int] = set()
        super().__init__(self._pick, every=True)

    def _pick(self, event: LifecycleEvent) -> bool:
        me = threading.get_ident()
        if event.kind != "index" or me in self.seen:
            return False
        self.seen.add(me)
        self.close_flush = self.rng.random() < 0.5
        self.asked.append(self.close_flush)
        return True


def test_unforced_rounds_of_callback_closes_puts_loads_and_a_main_close(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """Rounds of: three threads put (two prompts each, one by ``put_async``), their
    sink asks a close with a random flush on each thread's first 'index'; a loader loads
    the DRAM-only prompt; then the main thread closes with a random flush. Every call
    ends stored, exact or typed; the main close returns once the store is closed; no
    thread is left; the reopen is clean and holds the DRAM-only prompt iff the close
    asked first flushed."""
    rng = random.Random(7)
    before = set(threading.enumerate())
    for r in range(8):
        sink = _Recorder(rng)
        path = tmp_path / f"s{r}"
        store = open_small(path, sink=sink)
        on_disk, in_dram = _base(store, identity, 400 + 10 * r)
        sink.store = store

        def puts(k: int, store: KVStore = store, r: int = r) -> None:
            for j in range(2):
                tokens, kv = prompt_kv(1000 + 100 * r + 10 * k + j, 4 * N)
                try:
                    if j:
                        pending = store.prepare_put(identity, PUBLIC, tokens, kv)
                        res = store.put_async(pending).result(DONE_S)
                    else:
                        res = store.put_prompt(identity, PUBLIC, tokens, kv)
                    assert isinstance(res, PutResult)
                except KVLifeError:
                    pass

        def loads(store: KVStore = store, prompt: Prompt = in_dram) -> None:
            for _ in range(20):
                try:
                    got = store.get(identity, PUBLIC, prompt[0])
                except StoreClosedError:
                    return
                assert isinstance(got, LoadResult)
                assert_exact(got.arrays, prompt[1])

        calls = [Call(partial(puts, k)) for k in range(3)] + [Call(loads)]
        for c in calls:
            c.join(DONE_S * 2)
            assert c.error is None, repr(c.error)
        assert sink.asked and sink.errors == [], (sink.asked, sink.errors)
        main = _later(store, rng.random() < 0.5)
        _ended(main, store, f"round {r}: the main thread's close")
        _no_kvlife_threads(before)
        _served(path, identity, [(on_disk, 4), (in_dram, 4 if sink.asked[0] else 0)])

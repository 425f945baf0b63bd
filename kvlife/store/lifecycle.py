"""Opening and closing a store directory, in the order crash safety needs.

Open: take the directory lock, rebuild lost segment files from parity (before any tier
opens them), build the tier chain from its specs, load the lifetime counters, recover
what the durable tiers hold; on any failure the tiers built so far are closed and the
lock released. Close: refuse new puts, stop the background work, flush (unless told
not to), save the counters, release every tier even if one fails, protect the segment
files with parity while the lock is still held, then drop the lock. The facade
(:class:`~kvlife.store.KVStore`) calls these and holds what :func:`open_store` returns.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from kvlife.core.errors import CloseNotStarted, KVLifeError
from kvlife.core.events import EventSink
from kvlife.store import deletes, metrics, protection
from kvlife.store.config import StoreConfig
from kvlife.store.core import StoreCore
from kvlife.store.lock import drop_dir_lock, take_dir_lock
from kvlife.store.reads import Reader
from kvlife.store.recovery import recover
from kvlife.store.writes import Writer
from kvlife.tiers.base import Tier
from kvlife.tiers.disk.fileio import FileIO
from kvlife.tiers.registry import TierContext, build_tier

log = logging.getLogger(__name__)


@dataclass(slots=True)
class OpenStore:
    """A store directory held open by this process."""

    path: Path
    config: StoreConfig
    core: StoreCore
    lockfile: IO[str]
    """The directory lock's file (held until :func:`close_store`)."""
    parity_repair: protection.ParityOutcome
    """What parity rebuilt (or could not) at this open."""
    lifetime_base: dict[str, int]
    """The lifetime counters as they were at this open."""


def open_store(
    path: Path, config: StoreConfig, sink: EventSink | None, fileio: FileIO | None
) -> OpenStore:
    """Lock ``path``, repair from parity, build the chain and recover (see above)."""
    lockfile = take_dir_lock(path)
    chain: list[Tier] = []
    try:
        repaired = protection.repair(path, config)
        ctx = TierContext(path, fileio)
        for spec in config.chain:
            chain.append(build_tier(spec, ctx))
        core = StoreCore(path, config, chain, sink)
        core.counters.segments_rebuilt += len(repaired.rebuilt)
        core.counters.segments_unrecoverable += len(repaired.unrecoverable)
        base = metrics.load_lifetime(core)
        recover(core)
    except BaseException:
        for tier in chain:
            tier.close()
        drop_dir_lock(path, lockfile)
        raise
    return OpenStore(path, config, core, lockfile, repaired, base)


def close_store(store: OpenStore, writer: Writer, reader: Reader, *, flush: bool) -> None:
    """Flush (unless ``flush=False``), then release files, threads and the lock; the
    first error is raised once everything is released. A second call (from any thread)
    waits for the first to finish, then does nothing.

    Called from inside a callback the store is running (an event sink's ``emit``,
    ``check()``'s ``progress``: :mod:`kvlife.store.callbacks`), the close cannot wait for
    the call that runs the callback: it runs on a thread of its own, started here, and
    this call returns at once. The store then closes as a close from another thread
    does, once the calls under way (that one too) have ended; a later ``close()`` waits
    for it (even one that reaches the store before that thread has begun: the close
    asked first is the one that runs, with the flush it asked for; a close asked from a
    callback once one was asked returns at once), and an error of that close is
    logged."""
    core = store.core
    if core.callbacks.inside():
        _close_later(store, writer, reader, flush)
        return
    me = threading.current_thread()
    with core.lock:  # from here on no put is prepared or committed (StoreClosedError)
        # a close asked from inside a callback owns the store from the moment it was
        # asked (``closing`` set then, :func:`_close_later`): its own thread goes on,
        # any other close waits for it
        owner = core.closer is me
        second = core.closing and not owner
        core.closing = True
    if second:  # another call closes it: wait for that one (and, deferred, its log)
        core.close_done.wait()
        closer = core.closer
        if closer is not None and closer is not me:
            closer.join()
        return
    try:
        writer.abort_all("store closed")
        reader.close()
        writer.close()
        if flush:
            writer.flush()
        metrics.save_lifetime(core, store.lifetime_base)
    finally:
        with core.lock:  # a locked section that found the store open may take a ticket
            core.closed = True
            core.seq.close(f"store {core.path} is closed")
        errors: list[BaseException] = []
        try:  # plans that took a ticket before, and reads under way, end before the tiers
            core.stop_background()
            core.wait_readers()
            deletes.retry_kept(core)
        except BaseException as exc:
            errors.append(exc)
        for release in (core.ledger.flush, *(t.close for t in core.chain)):
            try:
                release()
            except BaseException as exc:  # every tier is closed, the lock released
                errors.append(exc)
        if not errors:
            try:  # the segment files are final now: protect them before the lock goes
                protection.protect(store.path, store.config)
            except (KVLifeError, OSError) as exc:
                errors.append(exc)
        drop_dir_lock(store.path, store.lockfile)
        core.close_done.set()
        if errors:
            raise errors[0]


def _close_later(store: OpenStore, writer: Writer, reader: Reader, flush: bool) -> None:
    """Start :func:`close_store` on a thread of its own (a close asked from inside a
    callback). Not a daemon, whatever the caller's thread is: a daemon would be dropped
    at exit, its close never run. And joined by the interpreter's shutdown before
    ``concurrent.futures`` stops taking work (its exit hook runs in the same list, after
    the ones registered later): a close still running then would find the disk tier's
    I/O pool refusing its flush's writes."""
    core = store.core
    closer = threading.Thread(
        target=_close_logged,
        args=(store, writer, reader, flush),
        name="kvlife-close",
        daemon=False,
    )
    with core.lock:
        if core.closing:
            # a close began or was asked before this one: that one runs (a second close
            # waits for the first, which a callback cannot do: it returns now)
            return
        # the close is this one's from now on: puts are refused from here (as by a
        # close on any thread), and a later close() waits for this thread and joins it.
        # Started under the lock, so that no other thread sees the close asked and its
        # thread not started: one that cannot start gives the store back untouched.
        core.closing = True
        core.closer = closer
        try:
            closer.start()
        except BaseException as exc:  # no thread (the interpreter is exiting): nothing asked
            core.closing = False
            core.closer = None
            if not isinstance(exc, RuntimeError):
                raise
            raise CloseNotStarted(
                f"close() of {store.path} asked from inside a callback could not start its "
                f"closing thread ({exc}); nothing was closed: the store is still open, "
                "close it from outside the callback"
            ) from exc
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        with contextlib.suppress(RuntimeError):  # already shutting down: nothing to add
            register(closer.join)


def _close_logged(store: OpenStore, writer: Writer, reader: Reader, flush: bool) -> None:
    """:func:`close_store` on its own thread (a close asked from inside a callback): its
    error has no caller to go to, so it is logged."""
    try:
        close_store(store, writer, reader, flush=flush)
    except BaseException as exc:
        log.error(
            "kvlife: closing %s (asked from inside a callback) failed: %s: %s",
            store.path,
            type(exc).__name__,
            exc,
        )

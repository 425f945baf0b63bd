"""Loads of disk frames read by the extension from the caller's thread (issue 28): the
server's loads with disk hits, into a session's shared buffers or into arena extents
for grants, and an embedded store's ``load`` into the caller's buffers (where they are
whole aligned pages, and the disk tier reads through the plain FileIO).

A served load with disk hits went through the store's ``load_async``: pins, a load
handle, one I/O-pool task per chunk, each finished read handing the next to another
pool thread. Traced (docs/server.md), the first device read began about half a
millisecond into the call and each next read 0.1 ms after the one before ended: a
4 x 2 MiB load ran at 0.6 of raw reads where a client reading the same frames itself
(:mod:`kvlife.store.direct`) ran at 0.8. Here the server does what that client does:

1. :func:`start`, under the store's lock, finds the leading hits that are INDEXED and
   served exact from a disk tier, and each one's frame (its catalog row): the chunk is
   live in that frame at that moment, as a pin would have found it.
2. The extension reads those frames into the caller's buffers on its own threads
   (:func:`kvlife.native.frames.start_direct`) and verifies each in order when asked
   (``step``): the header byte for byte against the row's, the payload's xxh3-128
   against the row's checksum. A frame moved, compacted away, torn or overwritten
   since step 1 does not verify.
3. :meth:`FrameLoad.wait` publishes the load: the leading chunks that verified and are
   still INDEXED under the store's lock are loaded (each with its LOAD in the ledger
   and the tier's counters, as any load counts them). A chunk that verified but left
   the index since ends the result as vanished, as a pinned load's publication ends
   it: it may have been handed out already (``chunk``), so nothing is read into its
   buffer again. Otherwise the hits after them (a frame that did not verify, a hit
   not read from a frame) are read by the store's pinned load first (pinned, read and
   verified, not yet published; a read that raises counts nothing loaded), and then
   published with the frame-read chunks under one lock, where those are checked
   INDEXED again: one invalidated (or put again with other KV) while the rest was read
   ends the result there and the rest is given up unpublished, so a result never holds
   chunks of two puts (the red team of 2026-12-05 found it did). The pinned load counts
   what it finds (a corrupt frame counted and retired there). A store closed first
   raises StoreClosedError, as a pinned load does.

So no chunk is served that was not live in the frame it was read from when the load
began and still live when it was published, and whose bytes did not verify against
that frame's row: the same promise as a pinned load, without the pins (a pin keeps a
replica readable while it is read; here a replica deleted meanwhile fails to verify
and the chunk goes through the store's load instead).

A store that promotes disk hits into its first tier has them promoted as a pinned
load's publication plans it: each loaded chunk's disk replica pinned at the
publication until the promotion, on the store's background thread, read it again (the
loaded buffers are the caller's). Hits served from DRAM or from a transform's frame go
through the store's load, from the first such hit on.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvlife.core.errors import InvalidArgument
from kvlife.core.lifecycle import ObjectState
from kvlife.core.objects import EXACT, ObjectRecord, TierName
from kvlife.native import frames as native
from kvlife.results import LoadResult, LookupResult
from kvlife.store.core import StoreCore
from kvlife.store.direct import count_exact_load
from kvlife.store.executor import execute
from kvlife.store.reads import Reader
from kvlife.tiers.disk.native_reads import usable
from kvlife.tiers.disk.tier import DiskTier

INDEXED = ObjectState.INDEXED

DEPTH = 1
"""Frame reads in flight of an embedded store's ``load`` (its reader thread reads chunk
i + 1 while the caller verifies chunk i), as the server's loads into shared buffers
(:data:`kvlife.server.loads.FRAME_DEPTH`) and a client's direct reads."""


class FrameLoad:
    """A load whose leading chunks the extension reads from their disk frames
    (:func:`start`); a :class:`~kvlife.store.api.LoadProgress` for one thread: the
    caller that started it calls ``chunk``, ``done`` and ``wait``."""

    def __init__(
        self,
        core: StoreCore,
        lookup: LookupResult,
        outs: Sequence[np.ndarray | None],
        found: list[tuple[ObjectRecord, TierName]],
        into: list[np.ndarray],
        run: native.DirectRun,
        request_id: str,
        reader: Reader,
    ) -> None:
        self._core = core
        self._lookup = lookup
        self._outs = outs
        self._found = found
        self._into = into
        """The buffers of the chunks read from frames (``outs``' first ones)."""
        self._run = run
        self._request_id = request_id
        self._reader = reader
        """The store's pinned load, for the hits after the frame-read ones."""
        self._verified = 0
        self._closed = False
        self._result: LoadResult | None = None

    def __len__(self) -> int:
        return len(self._lookup.hits)

    def chunk(self, i: int, timeout: float | None = None) -> np.ndarray | None:
        """Chunk ``i``'s buffer once it and every chunk before it verified in its frame;
        a chunk not read from a frame (or after one that did not verify) waits for the
        whole load (``wait``: the rest goes through the store) and is the result's
        array, None for a miss. ``timeout`` is not used: a read of the extension's ends
        or fails on its own."""
        n = len(self._lookup.hits)
        if not 0 <= i < n:
            raise InvalidArgument(f"chunk {i} is not in this load of {n} hits")
        if self._result is None:
            # step() says False again once a frame failed: no state of its own here
            while self._verified <= i and self._verified < len(self._found):
                if not self._run.step():
                    break
                self._verified += 1
            if i < self._verified:
                return self._into[i]
        res = self.wait()
        return res.arrays[i] if i < res.loaded else None

    def landed(self, i: int, at_least: int) -> int:
        """Bytes of chunk ``i``'s buffer landed from its frame so far, once at least
        ``at_least`` did (or its read ended first), hashed but NOT verified yet: a
        caller copying them out keeps the copy only if ``chunk(i)`` then returns this
        buffer (a miss's buffer is never data). A frame read in pieces (the run's last,
        larger than twice ``native.DEFAULT_PIECE``) tells them as they land (the wait hashes
        what lands meanwhile); one read whole, all of them once it landed, before its
        hash. 0 where nothing can be told early: ``i`` is not the next chunk to verify,
        or its read or header failed already."""
        if self._result is not None or i != self._verified or i >= len(self._found):
            return 0
        return self._run.progress(at_least)

    def completed(self) -> int:
        """Leading chunks verified so far."""
        return self._verified

    def done(self) -> bool:
        """Whether the load was published (``wait``, or a ``chunk`` that waited for it):
        a server streaming its chunks sends the last one read from a frame before that,
        so the client copies it while the load is published."""
        return self._result is not None

    def wait(self, timeout: float | None = None) -> LoadResult:
        """The load's result: the frames checked, the load published, the rest loaded
        through the store (once; later calls return the same result). StoreClosedError
        when the store closed first (nothing counted); InvalidArgument after ``close``."""
        if self._result is None:
            if self._closed:
                raise InvalidArgument("this frame load was closed before it was waited for")
            verified = self._run.finish()  # the reads after the first failure never start
            self._result = self._publish(min(verified, len(self._found)))
        return self._result

    def close(self) -> None:
        """Stop the reads without publishing (the caller failed before ``wait``); a no-op
        once waited."""
        if self._result is None:
            self._closed = True
        self._run.close()

    def _publish(self, verified: int) -> LoadResult:
        """Count the leading chunks that verified and are INDEXED now (the load's
        moment, under the lock). One that verified but left the index ends the result
        as vanished, as a pinned load's publication ends it: it may have been handed
        out (``chunk``), so its buffer is never read into again. Else the hits after
        the counted ones are read by the store's pinned load first (a read that raises
        counts nothing loaded), and published with the frame-read chunks under one
        lock, where those are checked INDEXED again: a chunk invalidated (or put again
        with other KV) while the rest was read ends the result there, the rest's reads
        given up unpublished (unpinned, not counted loaded), so no result holds chunks
        of two puts."""
        core, hits = self._core, self._lookup.hits
        n = len(hits)
        with core.lock:
            core.check_open()  # a pinned load raises StoreClosedError too
            live = _live(self._found, verified)
        read = None
        if live == verified and live < n:
            read = self._reader.read_pinned(self._lookup.sub(live, n), self._outs[live:])
        with core.lock:
            try:
                core.check_open()
            except BaseException:
                if read is not None:
                    self._reader.release(read[0])
                raise
            loaded = _live(self._found, live)  # again: the rest took a while
            rest = None
            if read is not None:
                if loaded == live:
                    rest = self._reader.publish(read[0], n - live, read[1], self._request_id)
                else:
                    self._reader.release(read[0])  # its call was counted among loads
            else:
                core.counters.loads += 1
            vanished = 1 if loaded < verified else 0  # (a rest was read only if live == verified)
            if rest is None:
                core.counters.vanished += vanished
            took = self._found[:loaded]
            tiers: dict[str, int] = {}
            for rec, tier in took:
                count_exact_load(core, rec, tier, self._request_id)
                tiers[tier] = tiers.get(tier, 0) + 1
            core.counters.frame_loads += loaded
            _promote_later(core, took)
        arrays = self._into[:loaded]
        if rest is None:
            return LoadResult(
                arrays,
                loaded,
                n,
                tiers=tiers,
                vanished=vanished,
                representations=_exact(loaded),
            )
        for name, k in rest.tiers.items():
            tiers[name] = tiers.get(name, 0) + k
        forms = _exact(loaded)
        for form, k in rest.representations.items():
            forms[form] = forms.get(form, 0) + k
        return LoadResult(
            arrays + rest.arrays,
            loaded + rest.loaded,
            n,
            tiers=tiers,
            corrupt=rest.corrupt,
            vanished=rest.vanished,
            read_errors=rest.read_errors,
            unknown_transform=rest.unknown_transform,
            decoded=rest.decoded,
            representations=forms,
        )


def _live(found: list[tuple[ObjectRecord, TierName]], upto: int) -> int:
    """Under the lock: how many of the first ``upto`` chunks found are INDEXED still,
    in a row from the first."""
    live = 0
    for rec, _ in found[:upto]:
        if rec.state is not INDEXED:
            break  # invalidated since it was found
        live += 1
    return live


def _promote_later(core: StoreCore, took: list[tuple[ObjectRecord, TierName]]) -> None:
    """Under the lock, at the publication: plan the promotion of the chunks just loaded
    into the first tier, as a pinned load's publication does, each disk replica pinned
    until the promotion (on the store's background thread, in its sequencer turn) read
    it. The promotion reads the frame again: the loaded buffers are the caller's."""
    if not core.config.promote_on_hit or len(core.chain) < 2:
        return
    first = core.chain[0].name
    # only chunks still INDEXED with their disk replica readable (one evicted from disk
    # since, say into DRAM by another load's promotion, has nothing to promote from)
    took = [
        (rec, tier)
        for rec, tier in took
        if tier != first
        and rec.state is INDEXED
        and (rep := rec.replicas.get(tier)) is not None
        and rep.readable
    ]
    if not took:
        return
    pinned = [(rec, core.pin(rec, tier)) for rec, tier in took]
    core.placement.plan_promote([rec.key for rec, _ in took])
    bound = core.residency.take()

    def promote() -> None:
        try:
            execute(core, bound)
        finally:  # inside the turn, so that drain() returns with the pins released
            with core.lock:
                for rec, rep in pinned:
                    core.unpin(rec, rep)

    # submitted under the lock with its ticket: background jobs run in ticket order
    core.later(core.seq.take(), promote)


def _exact(n: int) -> dict[str, int]:
    return {EXACT.name: n} if n else {}


def start(
    core: StoreCore,
    lookup: LookupResult,
    outs: Sequence[np.ndarray | None],
    request_id: str,
    depth: int,
    reader: Reader,
) -> FrameLoad | None:
    """Start a load whose leading hits are read from their disk frames by the extension
    into ``outs`` (checked by the caller: one writable buffer per hit, disjoint; a hit
    with None is read by ``reader``, the store's pinned load, into new memory, as is
    every hit after it), with up to ``depth`` reads in flight; None where it cannot (the
    extension not built, a first hit not served exact from disk, buffers O_DIRECT cannot
    fill, a buffer that does not fit its chunk): the caller loads through the store's
    pinned load (``load`` or ``load_async``), which refuses a buffer that does not fit
    before it reads into any buffer of that run."""
    hits = lookup.hits
    if not hits or not native.available():
        return None
    # a tier whose FileIO reads another way (a test's or the campaign's faults, a
    # stall) is read through it, by the store's load: never around it
    disks = {t.name: t for t in core.chain if isinstance(t, DiskTier) and usable(t.io)}
    if not disks:
        return None
    keys = [h.key for h in hits]
    found: list[tuple[ObjectRecord, TierName]] = []
    frames: list[native.DirectFrame] = []
    into: list[np.ndarray] = []
    with core.lock:
        core.check_open()
        rows = {name: tier.frame_rows(keys) for name, tier in disks.items()}  # one lock each
        for i, key in enumerate(keys):
            rec = core.index.get(key)
            if rec is None or rec.state is not INDEXED:
                break
            served = core.serving(rec, lookup.accept)
            tier = served.tier
            rep = served.replica
            if tier not in disks or rep is None or rep.transform != EXACT:
                break
            row = rows[tier][i]
            out = outs[i]
            if out is None or row is None or row.transform != EXACT.name:
                break  # no buffer (the caller's arena had no room), or not a frame: the rest
            if (
                row.nbytes != out.nbytes
                or tuple(row.shape) != out.shape
                or np.dtype(row.dtype) != out.dtype
            ):
                return None  # refused by the pinned load, before any of it is read
            found.append((rec, tier))
            into.append(out)
            path = disks[tier].segment_file(row.seg)
            frames.append((path, row.off, out, row.nbytes, row.header(), row.checksum))
    if not found:
        return None
    try:
        run = native.start_direct(frames, depth)
    except (ValueError, OverflowError):  # buffers O_DIRECT cannot fill: nothing read
        return None
    return FrameLoad(core, lookup, outs, found, into, run, request_id, reader)

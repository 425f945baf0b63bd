"""Attacks on the write-through put's end check (``Writer.commit_put``,
``_not_durable`` and ``_undo_write_through`` in kvlife/store/writes.py). A put that
finds chunks of its prompt indexed while another write is copying them to disk
("borrowed") counts on that copy. In its own sequencer turn it checks every chunk of
its prompt: an indexed chunk must be readable on disk, and a chunk gone since a
write-through failed in the store counts as lost. Otherwise it raises
``StorePathError``. A failed write-through put retires all its new chunks, counted in
``write_through_failed``, inside its own turn.

The promise under attack (README, docs/store.md, tests/test_crash.py): with
``write_through=True`` a put that returns has made every chunk of its prompt durable,
including chunks it found indexed; a put that cannot stores none of its new chunks and
raises; nothing is lost uncounted.

Each test holds a real disk write in the file seam (``FaultyIO.stall``), lets another
store call run meanwhile on a thread (joins bounded), and then lets the write succeed
or fail (``FaultyIO.arm(..., once=True)`` before the release). ``close(flush=False)``
then a reopen through a plain FileIO stands in for a crash.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from kvlife.core.errors import KVLifeError, StorePathError
from kvlife.core.events import MemorySink
from kvlife.core.identity import PUBLIC, ChunkKey, ModelIdentity
from kvlife.faults.fileio import FaultyIO, Stall
from kvlife.results import PutResult
from kvlife.store import KVStore
from tests.conftest import TINY, prompt_kv
from tests.helpers.store_threads import Call as _Call
from tests.helpers.store_threads import assert_loads_exactly as _assert_loads_exactly
from tests.helpers.store_threads import blocked as _blocked
from tests.helpers.store_threads import release as _release
from tests.helpers.store_threads import wait_until as _wait
from tests.helpers.workload import disk_of

N = TINY.tokens_per_chunk
SEG = "seg-*"
"""The disk tier's segment files (the copy's frames), not its catalog or superblock."""
FRAME = 8192
"""Room one TINY chunk takes in the disk tier (``frame_room(2048)``)."""


def _open(
    path: Path,
    io: FaultyIO | None = None,
    sink: MemorySink | None = None,
    *,
    disk: int = 16 << 20,
    segment: int = 1 << 20,
) -> KVStore:
    return KVStore.open(
        path,
        dram_bytes=1 << 20,
        disk_bytes=disk,
        segment_bytes=segment,
        write_through=True,
        sink=sink,
        fileio=io,
    )


def _reopen(path: Path, *, disk: int = 16 << 20, segment: int = 1 << 20) -> KVStore:
    """The directory again through a plain FileIO (what a restart after a crash sees)."""
    return KVStore.open(path, dram_bytes=1 << 20, disk_bytes=disk, segment_bytes=segment)


def _head(tokens: np.ndarray, kv: np.ndarray, chunks: int) -> tuple[np.ndarray, np.ndarray]:
    return tokens[: chunks * N], kv[:, :, :, : chunks * N, :]


def _on_disk(store: KVStore, keys: Sequence[bytes]) -> list[bool]:
    disk = disk_of(store)
    return [disk.contains(ChunkKey(k)) for k in keys]


def _reasons(sink: MemorySink) -> dict[str, list[tuple[str, str]]]:
    """Each chunk's events in order, as (kind, reason)."""
    kinds: dict[str, list[tuple[str, str]]] = {}
    for e in sink.take():
        kinds.setdefault(e.key, []).append((e.kind, e.reason))
    return kinds


# --------------------------------------------------------------------------- 1. missed
# refusals: a put whose found chunks went before its plan saw them


@pytest.mark.parametrize("longer", [False, True], ids=["same-prompt", "longer-prompt"])
def test_a_two_phase_put_committed_after_the_copy_it_counted_on_failed_is_refused(
    tmp_path: Path, identity: ModelIdentity, longer: bool
) -> None:
    """Put #1 (4 chunks) is indexed in DRAM, its copy held. Put #2 of the same prompt
    (or 6 chunks extending it) is prepared now (two-phase, as the server's
    ``prepare_put``/``commit_put`` does while its client writes the KV): it counts the
    4 chunks present. Put #1's copy fails; put #1 raises and retires them, in its turn.
    Only then is put #2 committed. The same breach the fix closed for a put that was
    already waiting in the sequencer: put #2 must raise and store nothing, not return."""
    tokens, kv = prompt_kv(101, (6 if longer else 4) * N)
    t1, kv1 = _head(tokens, kv, 4)
    io = FaultyIO()
    store = _open(tmp_path, io)
    stall = io.stall("pwritev", path=SEG)
    try:
        first = _Call(lambda: store.put_prompt(identity, PUBLIC, t1, kv1))
        assert stall.wait_entered(), "put #1's copy never reached the disk"
        pending = store.prepare_put(identity, PUBLIC, tokens, kv)
        io.arm("pwritev", errno.EIO, once=True, path=SEG)
        stall.release()
        first.join()
        assert isinstance(first.error, KVLifeError), first.error or first.result
        assert store.indexed_keys() == []  # put #1 retired its chunks, in its turn

        outcome: PutResult | KVLifeError
        try:
            outcome = store.commit_put(pending)
        except KVLifeError as exc:
            outcome = exc
    finally:
        stall.release()
        store.close(flush=False)  # a crash: DRAM is gone
    with _reopen(tmp_path) as again:
        orphans = len(again.indexed_keys())
    assert isinstance(outcome, KVLifeError), (outcome, f"{orphans} chunk(s) on disk")
    assert orphans == 0


def test_a_put_whose_found_chunks_were_replaced_by_a_put_whose_copy_fails_is_refused(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """Put #2 is prepared while the prompt is durable (4 chunks present). The prompt is
    invalidated and put again by put #3, whose copy is held (new records, same keys).
    Put #2 commits now: it plans no copy (the keys' disk replicas are being written),
    waits for put #3's turn, and put #3's copy fails. Put #2's prompt is then in no tier
    at all; it must raise rather than return a PutResult."""
    tokens, kv = prompt_kv(102, 4 * N)
    io = FaultyIO()
    store = _open(tmp_path, io)
    stall: Stall | None = None
    try:
        keys = store.put_prompt(identity, PUBLIC, tokens, kv).keys
        pending = store.prepare_put(identity, PUBLIC, tokens, kv)
        assert store.invalidate(prefix=ChunkKey(keys[0])) == 4
        stall = io.stall("pwritev", path=SEG)
        third = _Call(lambda: store.put_prompt(identity, PUBLIC, tokens, kv))
        assert stall.wait_entered(), "put #3's copy never reached the disk"
        second = _Call(lambda: store.commit_put(pending))
        assert _blocked(second), "put #2 returned before put #3's copy was done"
        io.arm("pwritev", errno.EIO, once=True, path=SEG)
        stall.release()
        third.join()
        second.join()
        assert isinstance(third.error, KVLifeError), third.error or third.result
        assert store.lookup(identity, PUBLIC, tokens).tokens == 0
    finally:
        _release(stall)
        store.close(flush=False)
    assert isinstance(second.error, KVLifeError), second.error or second.result


def test_a_put_whose_own_copy_evicts_its_present_chunks_from_disk_is_not_acknowledged(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """Disk of 8 frames, segments of 4. Segment 1 holds R (2 chunks) and Z (2 chunks);
    segment 2 holds P (4 chunks, DRAM and disk). Z is invalidated (segment 1: 2 frames
    of garbage). A load of R (DRAM-evicted, disk only) is held in its ``preadv``, so
    segment 1 cannot be compacted. A write-through put of P + 2 new chunks: placement
    counts room for the copy (6 live frames + 2 <= 8), the disk tier refuses it (8 used),
    and the executor evicts more, as placement chooses: P's chunks 1-2 are its only
    unprotected disk replicas. Segment 2 is compacted, the copy fits, and the put
    returns with chunks 1-2 of its prompt in DRAM only."""
    disk, seg = 8 * FRAME, 4 * FRAME
    r_tokens, r_kv = prompt_kv(103, 2 * N)
    z_tokens, z_kv = prompt_kv(104, 2 * N)
    tokens, kv = prompt_kv(105, 6 * N)
    p_tokens, p_kv = _head(tokens, kv, 4)
    io = FaultyIO()
    store = _open(tmp_path, io, disk=disk, segment=seg)
    read: Stall | None = None
    loader: _Call | None = None
    try:
        r_keys = store.put_prompt(identity, PUBLIC, r_tokens, r_kv).keys
        z_keys = store.put_prompt(identity, PUBLIC, z_tokens, z_kv).keys
        assert store.put_prompt(identity, PUBLIC, p_tokens, p_kv).stored == 4
        assert store.invalidate(prefix=ChunkKey(z_keys[0])) == 2
        assert store.evict("dram", 2 * TINY.chunk_nbytes) == 2 * TINY.chunk_nbytes
        dram = store.tier("dram")
        assert not any(dram.contains(ChunkKey(k)) for k in r_keys), "R is not disk-only"
        read = io.stall("preadv", path=SEG)
        loader = _Call(lambda: store.get(identity, PUBLIC, r_tokens))
        assert read.wait_entered(), "the load of R never read the disk"

        outcome: PutResult | KVLifeError
        try:
            outcome = store.put_prompt(identity, PUBLIC, tokens, kv)
            durable = _on_disk(store, outcome.keys)
        except KVLifeError as exc:  # refusing is keeping the promise too
            outcome, durable = exc, []
        read.release()
        loader.join()
    finally:
        _release(read)
        store.close(flush=False)
    assert loader.error is None, repr(loader.error)
    with _reopen(tmp_path, disk=disk, segment=seg) as again:
        covered = again.lookup(identity, PUBLIC, tokens).tokens
    if isinstance(outcome, PutResult):
        claimed = outcome.tokens_stored_or_present
        assert durable == [True] * 6, f"returned with chunks on disk: {durable}"
        assert covered >= claimed, f"a reopen covers {covered // N} of {claimed // N} chunks"


# --------------------------------------------------------------------------- 2. the fix's
# own path, held: what it must keep doing


@pytest.mark.parametrize("copy_fails", [False, True])
def test_a_put_borrowing_a_flush_copy(
    tmp_path: Path, identity: ModelIdentity, copy_fails: bool
) -> None:
    """Chunks 1-4 are DRAM-only (their disk replicas evicted); ``flush()`` copies them,
    its write held. Put #2 of chunks 1-6 finds 1-4 indexed with their copy under way
    (borrowed: the copier is a flush, not a put). Copy done: put #2 returns, and a
    reopen serves all 6 bit-exact. Copy failed: flush raises, chunks 1-4 stay indexed
    (DRAM), put #2 raises StorePathError, its 2 new chunks go, counted."""
    tokens, kv = prompt_kv(111, 6 * N)
    t1, kv1 = _head(tokens, kv, 4)
    io = FaultyIO()
    store = _open(tmp_path, io)
    stall: Stall | None = None
    try:
        assert store.put_prompt(identity, PUBLIC, t1, kv1).stored == 4
        assert store.evict("disk", 1 << 30) > 0
        assert disk_of(store).replica_keys() == []
        stall = io.stall("pwritev", path=SEG)
        flusher = _Call(store.flush)
        assert stall.wait_entered(), "the flush never wrote"
        second = _Call(lambda: store.put_prompt(identity, PUBLIC, tokens, kv))
        assert _blocked(second), "put #2 returned before the flush's copy was done"
        if copy_fails:
            io.arm("pwritev", errno.EIO, once=True, path=SEG)
        stall.release()
        flusher.join()
        second.join()
        counters = store.counters.as_dict()
        if copy_fails:
            assert isinstance(flusher.error, KVLifeError), flusher.error or flusher.result
            assert isinstance(second.error, StorePathError), second.error or second.result
            assert store.lookup(identity, PUBLIC, tokens).tokens == 4 * N  # 1-4, DRAM
            assert len(store.indexed_keys()) == 4
            assert counters["write_through_failed"] == 2
            assert counters["chunks_stored"] == 4  # put #1's; put #2 stored nothing
        else:
            assert flusher.error is None and flusher.result == 4, flusher.error
            assert second.error is None, repr(second.error)
            assert isinstance(second.result, PutResult)
            assert (second.result.stored, second.result.already_present) == (2, 4)
            assert counters["write_through_failed"] == 0
            assert all(_on_disk(store, second.result.keys))
    finally:
        _release(stall)
        store.close(flush=False)
    with _reopen(tmp_path) as again:
        if copy_fails:
            assert again.indexed_keys() == []
        else:
            _assert_loads_exactly(again, identity, tokens, kv, 6)
        assert again.check().problems == []


def test_a_put_whose_own_copy_of_found_dram_only_chunks_fails(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """Chunks 1-4 are indexed DRAM-only (disk replicas evicted): put #2 of 1-6 copies
    them itself with its own 5-6, and that write fails. Put #2 raises the write's error;
    its new 5-6 go (counted, 2); 1-4, which it only found, stay served from DRAM; nothing
    is claimed durable and a reopen has nothing."""
    tokens, kv = prompt_kv(115, 6 * N)
    t1, kv1 = _head(tokens, kv, 4)
    io = FaultyIO()
    store = _open(tmp_path, io)
    try:
        assert store.put_prompt(identity, PUBLIC, t1, kv1).stored == 4
        assert store.evict("disk", 1 << 30) > 0
        io.arm("pwritev", errno.EIO, once=True, path=SEG)
        with pytest.raises(KVLifeError, match="injected EIO"):  # the write's own error
            store.put_prompt(identity, PUBLIC, tokens, kv)
        assert io.injected == {"pwritev": 1}
        c = store.counters.as_dict()
        assert c["write_through_failed"] == 2
        assert c["chunks_stored"] == 4  # put #1's only
        _assert_loads_exactly(store, identity, t1, kv1, 4)
        assert store.lookup(identity, PUBLIC, tokens).tokens == 4 * N
        assert disk_of(store).replica_keys() == []
    finally:
        store.close(flush=False)
    with _reopen(tmp_path) as again:
        assert again.indexed_keys() == []


def test_a_chain_of_three_puts_on_a_failed_copy_all_raise_and_count_each_chunk_once(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """Put #1 (chunks 1-4) held in its copy; put #2 (1-6) and put #3 (1-8) wait behind
    it (1-4 borrowed; for put #3, 5-6 are put #2's, in flight). Put #1's copy fails.
    All three raise; nothing is left, in memory or after a reopen; every chunk that was
    indexed and went is counted once in ``write_through_failed`` (4 + 2 + 2) and has one
    ``invalidate`` event with reason ``write-through failed``; ``chunks_stored`` is 0."""
    tokens, kv = prompt_kv(121, 8 * N)
    sink, io = MemorySink(), FaultyIO()
    store = _open(tmp_path, io, sink)
    stall = io.stall("pwritev", path=SEG)
    try:
        t4, kv4 = _head(tokens, kv, 4)
        t6, kv6 = _head(tokens, kv, 6)
        first = _Call(lambda: store.put_prompt(identity, PUBLIC, t4, kv4))
        assert stall.wait_entered()
        second = _Call(lambda: store.put_prompt(identity, PUBLIC, t6, kv6))
        assert _blocked(second)
        third = _Call(lambda: store.put_prompt(identity, PUBLIC, tokens, kv))
        assert _blocked(third)
        io.arm("pwritev", errno.EIO, once=True, path=SEG)
        stall.release()
        for call in (first, second, third):
            call.join()
        assert isinstance(first.error, KVLifeError), first.error or first.result
        assert isinstance(second.error, StorePathError), second.error or second.result
        assert isinstance(third.error, StorePathError), third.error or third.result
        assert store.indexed_keys() == []
        assert disk_of(store).live_bytes == 0
        c = store.counters.as_dict()
        assert c["write_through_failed"] == 8, {k: v for k, v in c.items() if v}
        assert c["chunks_stored"] == 0 and c["chunks_already_present"] == 0
        assert c["invalidated"] == 0 and c["aborted"] == 0
        kinds = _reasons(sink)
        assert len(kinds) == 8
        for key, seen in kinds.items():
            gone = [r for k, r in seen if k == "invalidate"]
            assert gone == ["write-through failed"], (key, seen)
    finally:
        stall.release()
        store.close(flush=False)
    with _reopen(tmp_path) as again:
        assert again.indexed_keys() == []


def test_an_invalidation_racing_the_failure_counts_each_chunk_once(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """Put #1 (1-4) held in its copy, put #2 (1-6) waiting (1-4 borrowed). An
    invalidation from chunk 3 on takes 3-4 at once and put #2's 5-6 (TENTATIVE,
    chained after them). Put #1's copy fails. Both puts raise; each of the 6 chunks is
    counted gone once (4 invalidated, 2 ``write_through_failed``), and has one ending
    event (``invalidate`` or, never indexed, ``abort``)."""
    tokens, kv = prompt_kv(131, 6 * N)
    t4, kv4 = _head(tokens, kv, 4)
    sink, io = MemorySink(), FaultyIO()
    store = _open(tmp_path, io, sink)
    stall = io.stall("pwritev", path=SEG)
    try:
        first = _Call(lambda: store.put_prompt(identity, PUBLIC, t4, kv4))
        assert stall.wait_entered()
        keys = [h.key for h in store.lookup(identity, PUBLIC, t4).hits]
        second = _Call(lambda: store.put_prompt(identity, PUBLIC, tokens, kv))
        assert _blocked(second)
        inval = _Call(lambda: store.invalidate(prefix=keys[2]))
        _wait(
            lambda: store.lookup(identity, PUBLIC, tokens).tokens == 2 * N,
            "the invalidation to take chunks 3-4",
        )
        io.arm("pwritev", errno.EIO, once=True, path=SEG)
        stall.release()
        for call in (first, second, inval):
            call.join()
        assert isinstance(first.error, KVLifeError), first.error or first.result
        assert isinstance(second.error, StorePathError), second.error or second.result
        assert inval.error is None, repr(inval.error)
        assert store.indexed_keys() == []
        c = store.counters.as_dict()
        assert c["write_through_failed"] == 2, {k: v for k, v in c.items() if v}
        # invalidate counts what it took (3-4 and put #2's TENTATIVE 5-6, those also
        # as aborted); the undo counts only 1-2: nothing is in both
        assert inval.result == 4 and c["invalidated"] == 4
        assert c["invalidated"] + c["write_through_failed"] == 6
        kinds = _reasons(sink)
        assert len(kinds) == 6
        for key, seen in kinds.items():
            ends = [k for k, _ in seen if k in ("invalidate", "abort")]
            assert len(ends) == 1, (key, seen)
    finally:
        stall.release()
        store.close(flush=False)
    with _reopen(tmp_path) as again:
        assert again.indexed_keys() == []


def test_put_async_borrowing_a_failed_copy_raises_from_its_future(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """``put_async`` runs ``commit_put`` on the store's put thread: the borrowed check
    still holds (its future raises StorePathError, its new chunks go)."""
    tokens, kv = prompt_kv(141, 6 * N)
    t4, kv4 = _head(tokens, kv, 4)
    io = FaultyIO()
    store = _open(tmp_path, io)
    stall = io.stall("pwritev", path=SEG)
    try:
        first = _Call(lambda: store.put_prompt(identity, PUBLIC, t4, kv4))
        assert stall.wait_entered()
        future = store.put_async(store.prepare_put(identity, PUBLIC, tokens, kv))
        time.sleep(0.2)
        assert not future.done(), "put_async returned before the copy it borrowed"
        io.arm("pwritev", errno.EIO, once=True, path=SEG)
        stall.release()
        first.join()
        with pytest.raises(StorePathError, match="nothing of this put was stored"):
            future.result(timeout=30)
        assert store.indexed_keys() == []
        assert store.counters.as_dict()["write_through_failed"] == 6
    finally:
        stall.release()
        store.close(flush=False)


# --------------------------------------------------------------------------- 3. the undo in
# the turn: a failing delete, close racing it


def test_a_failing_delete_in_the_undo_neither_hangs_the_sequencer_nor_serves_the_chunks(
    tmp_path: Path, identity: ModelIdentity, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Put #2 (1-6) borrowed 1-4 from put #1, whose copy fails; put #2's own 5-6 were
    made durable, so its undo deletes them from disk in its turn, and that delete fails
    (the disk tier's catalog transaction, made to raise here). Put #2 raises a typed
    error, the sequencer turn is given back (a later put and ``close`` return), and
    nothing of the failed puts is served."""
    tokens, kv = prompt_kv(151, 6 * N)
    t4, kv4 = _head(tokens, kv, 4)
    other_tokens, other_kv = prompt_kv(152, 2 * N)
    io = FaultyIO()
    store = _open(tmp_path, io)
    disk = disk_of(store)
    real = disk.delete_forgetting
    failed: list[int] = []

    def failing(keys: Sequence[ChunkKey], forget: Sequence[bytes]) -> list[int]:
        if not failed:
            failed.append(len(keys))
            raise StorePathError("injected: catalog delete failed")
        return real(keys, forget)

    stall = io.stall("pwritev", path=SEG)
    try:
        first = _Call(lambda: store.put_prompt(identity, PUBLIC, t4, kv4))
        assert stall.wait_entered()
        second = _Call(lambda: store.put_prompt(identity, PUBLIC, tokens, kv))
        assert _blocked(second)
        io.arm("pwritev", errno.EIO, once=True, path=SEG)
        monkeypatch.setattr(disk, "delete_forgetting", failing)
        stall.release()
        first.join()
        second.join()
        assert isinstance(first.error, KVLifeError), first.error or first.result
        assert isinstance(second.error, KVLifeError), second.error or second.result
        assert failed == [2], failed  # put #2's durable 5-6
        assert store.lookup(identity, PUBLIC, tokens).tokens == 0
        assert store.indexed_keys() == []
        later = _Call(lambda: store.put_prompt(identity, PUBLIC, other_tokens, other_kv))
        later.join()
        assert later.error is None, repr(later.error)
        _assert_loads_exactly(store, identity, other_tokens, other_kv, 2)
    finally:
        stall.release()
        closer = _Call(lambda: store.close(flush=False))
        closer.join()
    assert closer.error is None, repr(closer.error)


@pytest.mark.parametrize("copy_fails", [False, True])
def test_close_racing_a_put_waiting_on_a_borrowed_copy(
    tmp_path: Path, identity: ModelIdentity, copy_fails: bool
) -> None:
    """``close`` from a third thread while put #1's copy is held and put #2 waits on it:
    close waits, returns once the copy is let go, both puts end typed; a reopen has the
    6 chunks bit-exact (copy done) or nothing (copy failed)."""
    tokens, kv = prompt_kv(161, 6 * N)
    t4, kv4 = _head(tokens, kv, 4)
    io = FaultyIO()
    store = _open(tmp_path, io)
    stall = io.stall("pwritev", path=SEG)
    closer: _Call | None = None
    try:
        first = _Call(lambda: store.put_prompt(identity, PUBLIC, t4, kv4))
        assert stall.wait_entered()
        second = _Call(lambda: store.put_prompt(identity, PUBLIC, tokens, kv))
        assert _blocked(second)
        closer = _Call(lambda: store.close(flush=False))
        assert _blocked(closer), "close returned while a copy was held"
        if copy_fails:
            io.arm("pwritev", errno.EIO, once=True, path=SEG)
        stall.release()
        first.join()
        second.join()
        closer.join()
    finally:
        stall.release()
        if closer is None:
            store.close(flush=False)
    assert closer.error is None, repr(closer.error)
    if copy_fails:
        assert isinstance(first.error, KVLifeError), first.error or first.result
        assert isinstance(second.error, StorePathError), second.error or second.result
    else:
        assert first.error is None and second.error is None, (first.error, second.error)
        assert isinstance(second.result, PutResult) and second.result.stored == 2
    with _reopen(tmp_path) as again:
        if copy_fails:
            assert again.indexed_keys() == []
        else:
            _assert_loads_exactly(again, identity, tokens, kv, 6)


# --------------------------------------------------------------------------- 4. what a
# returned put claims survives a crash


def test_a_put_left_in_flight_to_a_failing_put_claims_only_what_survives(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """Put #2 (1-6) prepared while put #1's 1-4 were TENTATIVE (two-phase): 1-4 are
    ``in_flight`` to it. Put #1 commits with its copy held, put #2 commits behind it,
    put #1's copy fails. Put #2 raises too (a write-through failure since it was
    prepared took chunks of its prompt), and stores none of its own: its 5-6 would be
    durable under a prefix that is gone, never reachable. A reopen holds nothing."""
    tokens, kv = prompt_kv(171, 6 * N)
    t4, kv4 = _head(tokens, kv, 4)
    io = FaultyIO()
    store = _open(tmp_path, io)
    stall = io.stall("pwritev", path=SEG)
    try:
        p1 = store.prepare_put(identity, PUBLIC, t4, kv4)
        p2 = store.prepare_put(identity, PUBLIC, tokens, kv)
        first = _Call(lambda: store.commit_put(p1))
        assert stall.wait_entered()
        second = _Call(lambda: store.commit_put(p2))
        assert _blocked(second)
        io.arm("pwritev", errno.EIO, once=True, path=SEG)
        stall.release()
        first.join()
        second.join()
        assert isinstance(first.error, KVLifeError), first.error or first.result
        assert isinstance(second.error, StorePathError), second.error or second.result
        assert store.counters.as_dict()["write_through_failed"] == 4 + 2
    finally:
        stall.release()
        store.close(flush=False)
    with _reopen(tmp_path) as again:
        assert again.indexed_keys() == []
        assert again.check().problems == []

"""Attacks on a write-through put racing the rest of the store while its disk copy is
held in the file seam (README: "with ``write_through=True`` every put is durable on disk
before it returns"; docs/store.md, "Failures are outcomes": "a put whose chunks cannot
all be made durable stores none of its new chunks and raises").

A write-through put places its new chunks in DRAM and, in the same plan, copies them to
disk: they are INDEXED (served) before the copy is durable, and a failed copy retires
them (``Writer._undo_write_through``). Each test holds that copy with
``FaultyIO.stall`` (real files, real threads), lets something else happen meanwhile
(readers, a failure, ``close``, ``flush``, ``evict``, a second put of the same prompt,
an invalidation of part of the prompt) and checks what the store promised.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvlife.core.errors import KVLifeError, StoreClosedError, StorePathError
from kvlife.core.events import MemorySink
from kvlife.core.identity import PUBLIC, ChunkKey, ModelIdentity
from kvlife.faults.fileio import FaultyIO
from kvlife.results import PutResult
from kvlife.store import KVStore
from tests.conftest import TINY, prompt_kv
from tests.helpers.failing_deletes import fail_deletes
from tests.helpers.store_threads import Call as _Call
from tests.helpers.store_threads import assert_loads_exactly as _assert_loads_exactly
from tests.helpers.store_threads import blocked as _blocked
from tests.helpers.store_threads import chunk_of as _chunk
from tests.helpers.store_threads import release as _release
from tests.helpers.store_threads import wait_until as _wait
from tests.helpers.workload import disk_of

N = TINY.tokens_per_chunk
SEG = "seg-*"
"""The disk tier's segment files (the copy's frames), not its catalog or superblock."""


def _open(
    path: Path,
    sink: MemorySink | None = None,
    io: FaultyIO | None = None,
    *,
    dram: int = 1 << 20,
    disk: int = 16 << 20,
    segment: int = 1 << 20,
) -> KVStore:
    return KVStore.open(
        path,
        dram_bytes=dram,
        disk_bytes=disk,
        segment_bytes=segment,
        write_through=True,
        sink=sink,
        fileio=io,
    )


def _reopen(path: Path, **kw: int) -> KVStore:
    """The directory again through a plain FileIO (what a restart after a crash sees)."""
    return KVStore.open(
        path,
        dram_bytes=kw.get("dram", 1 << 20),
        disk_bytes=kw.get("disk", 16 << 20),
        segment_bytes=kw.get("segment", 1 << 20),
    )


def _moves(sink: MemorySink) -> dict[str, list[tuple[str, str]]]:
    """Each chunk's events in order, as (kind, reason); an offload as ``offload>disk``."""
    kinds: dict[str, list[tuple[str, str]]] = {}
    for e in sink.take():
        kind = f"{e.kind}>{e.dst_tier}" if e.dst_tier else e.kind
        kinds.setdefault(e.key, []).append((kind, e.reason))
    return kinds


# --------------------------------------------------------------------------- 1. a failed copy


@pytest.mark.parametrize("op", ["pwritev", "fdatasync"])
def test_a_failed_copy_after_readers_loaded_the_chunks_retires_them_explained(
    tmp_path: Path, identity: ModelIdentity, op: str
) -> None:
    """Readers hit and load the DRAM chunks while the copy is held; then the held write
    (or the fdatasync after it) fails. The put raises the typed error, the chunks are
    gone (a lookup misses; the readers' old lookup loads nothing, never other bytes),
    each is explained (``invalidate``/``delete``, reason ``write-through failed``, no
    offload claimed), nothing of the copy is left on disk, and a reopen finds nothing."""
    tokens, kv = prompt_kv(11, 4 * N)
    sink, io = MemorySink(), FaultyIO()
    store = _open(tmp_path, sink, io)
    stall = io.stall(op, path=SEG)
    try:
        put = _Call(lambda: store.put_prompt(identity, PUBLIC, tokens, kv))
        assert stall.wait_entered(), "the write-through copy never reached the disk"
        seen = store.lookup(identity, PUBLIC, tokens)
        assert seen.tokens == 4 * N  # visible before durable, by design
        early = store.load(seen)  # a reader holds the bytes it loaded
        assert early.loaded == 4
        io.arm(op, errno.EIO, once=True, path=SEG)  # the held call fails when let go
        stall.release()
        put.join()

        assert isinstance(put.error, KVLifeError), put.error or put.result
        assert io.injected == {op: 1}
        for i, arr in enumerate(early.arrays):  # what was served was the put's KV
            assert np.array_equal(arr, _chunk(kv, i))
        assert store.lookup(identity, PUBLIC, tokens).tokens == 0
        assert store.load(seen).loaded == 0  # a stale lookup serves nothing
        assert store.indexed_keys() == []
        disk = disk_of(store)
        assert disk.replica_keys() == [] and disk.live_bytes == 0
        counters = store.counters.as_dict()
        assert counters.get("tier.disk.stored", 0) == 0
        assert counters["chunks_stored"] == 0  # the put did not count them stored

        kinds = _moves(sink)
        assert len(kinds) == 4
        for key, seen_moves in kinds.items():
            names = [k for k, _ in seen_moves]
            assert not any(k.startswith("offload") for k in names), (key, names)
            assert names[:5] == ["put", "write", "seal", "commit", "index"], (key, names)
            assert names[-2:] == ["invalidate", "delete"], (key, names)
            assert all(r == "write-through failed" for _, r in seen_moves[-2:]), seen_moves
    finally:
        stall.release()
        store.close(flush=False)
    with _reopen(tmp_path) as again:
        assert again.indexed_keys() == []
        assert again.lookup(identity, PUBLIC, tokens).tokens == 0
        assert again.check().problems == []


def test_objects_retired_by_a_failed_write_through_are_counted(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """Every loss a counted, explained event: the four INDEXED chunks a reader was
    served and that then vanished have events, but no counter says they went."""
    tokens, kv = prompt_kv(12, 4 * N)
    io = FaultyIO()
    with _open(tmp_path, io=io) as store:
        stall = io.stall("pwritev", path=SEG)
        try:
            put = _Call(lambda: store.put_prompt(identity, PUBLIC, tokens, kv))
            assert stall.wait_entered()
            assert store.lookup(identity, PUBLIC, tokens).tokens == 4 * N
            io.arm("pwritev", errno.EIO, once=True, path=SEG)
        finally:
            stall.release()
        put.join()
        assert isinstance(put.error, KVLifeError)
        c = store.counters.as_dict()
        assert c["tier.dram.stored"] == 4  # they were published in DRAM
        gone = sum(
            c.get(name, 0)
            for name in (
                "invalidated",
                "aborted",
                "chunks_dropped",
                "evicted",
                "write_through_failed",
            )
        )
        assert gone == 4, {k: v for k, v in c.items() if v}
        assert c["write_through_failed"] == 4


# --------------------------------------------------------------------------- 2. close


@pytest.mark.parametrize("flush", [True, False])
@pytest.mark.parametrize("copy_fails", [False, True])
def test_close_from_another_thread_waits_for_a_held_write_through_copy(
    tmp_path: Path, identity: ModelIdentity, flush: bool, copy_fails: bool
) -> None:
    """``close`` from another thread while the put's copy is held waits for it (its
    plan has a sequencer turn), returns once it is let go (no deadlock), and the put
    ends typed: a PutResult whose chunks a reopen loads bit-exact, or (copy failed) a
    KVLifeError and nothing of it after the reopen."""
    tokens, kv = prompt_kv(21, 4 * N)
    io = FaultyIO()
    store = _open(tmp_path, io=io)
    stall = io.stall("pwritev", path=SEG)
    closer: _Call | None = None
    try:
        put = _Call(lambda: store.put_prompt(identity, PUBLIC, tokens, kv))
        assert stall.wait_entered()
        closer = _Call(lambda: store.close(flush=flush))
        assert _blocked(closer), "close returned while a put's copy was still being written"
        if copy_fails:
            io.arm("pwritev", errno.EIO, once=True, path=SEG)
        stall.release()
        put.join()
        closer.join()
    finally:
        stall.release()
        if closer is None:
            store.close(flush=False)
    assert closer.error is None, repr(closer.error)
    if copy_fails:
        assert isinstance(put.error, KVLifeError), put.error or put.result
    else:
        assert put.error is None, repr(put.error)
        assert isinstance(put.result, PutResult) and put.result.stored == 4
    with _reopen(tmp_path) as again:
        if copy_fails:
            assert again.indexed_keys() == []
        else:
            _assert_loads_exactly(again, identity, tokens, kv, 4)
        assert again.check().problems == []


def test_a_put_made_while_close_flushes_is_refused_and_the_flush_holds(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """``close(flush=True)`` holds its flush's copy (DRAM-only chunks: their disk replicas
    were evicted) while another thread puts a write-through prompt. Close has begun, so
    the put is refused (StoreClosedError, typed) and leaves nothing; close returns once
    its copy is let go, and what it flushed is durable."""
    old_tokens, old_kv = prompt_kv(30, 4 * N)
    tokens, kv = prompt_kv(31, 4 * N)
    io = FaultyIO()
    store = _open(tmp_path, io=io)
    assert store.put_prompt(identity, PUBLIC, old_tokens, old_kv).stored == 4
    assert store.evict("disk", 1 << 30) > 0  # DRAM-only now: close's flush copies them
    flush_copy = io.stall("pwritev", path=SEG)
    closer: _Call | None = None
    try:
        closer = _Call(lambda: store.close(flush=True))
        assert flush_copy.wait_entered(), "close's flush never copied the DRAM-only chunks"
        late = _Call(lambda: store.put_prompt(identity, PUBLIC, tokens, kv))
        late.join()
        assert isinstance(late.error, StoreClosedError), late.error or late.result
        assert _blocked(closer)  # still holding its flush
        flush_copy.release()
        closer.join()
    finally:
        _release(flush_copy)
        if closer is None:
            store.close(flush=False)
    assert closer.error is None, repr(closer.error)
    with _reopen(tmp_path) as again:
        _assert_loads_exactly(again, identity, old_tokens, old_kv, 4)  # the flush held
        assert again.lookup(identity, PUBLIC, tokens).tokens == 0
        assert again.check().problems == []


# --------------------------------------------------------------------------- 3. flush, evict,
# and a second put of the same prompt


@pytest.mark.parametrize("racer", ["flush", "evict-dram", "evict-disk"])
@pytest.mark.parametrize("copy_fails", [False, True])
def test_flush_or_evict_racing_a_held_write_through_copy(
    tmp_path: Path, identity: ModelIdentity, racer: str, copy_fails: bool
) -> None:
    """``flush()`` / ``evict(tier, all)`` called while the copy is held: the put's
    chunks are shielded (their disk replica is still being written), the call waits for
    the copy's turn and returns. Copy done: every chunk durable and served bit-exact.
    Copy failed: the put raises typed, the racer still returns, and no chunk is left
    indexed without a durable replica."""
    tokens, kv = prompt_kv(41, 4 * N)
    io = FaultyIO()
    store = _open(tmp_path, io=io)
    stall = io.stall("pwritev", path=SEG)
    try:
        put = _Call(lambda: store.put_prompt(identity, PUBLIC, tokens, kv))
        assert stall.wait_entered()
        call: Callable[[], object] = {
            "flush": store.flush,
            "evict-dram": lambda: store.evict("dram", 1 << 30),
            "evict-disk": lambda: store.evict("disk", 1 << 30),
        }[racer]
        other = _Call(call)
        assert _blocked(other), f"{racer} returned before the held copy's turn ended"
        assert store.lookup(identity, PUBLIC, tokens).tokens == 4 * N  # still served
        if copy_fails:
            io.arm("pwritev", errno.EIO, once=True, path=SEG)
        stall.release()
        put.join()
        other.join()
        assert other.error is None, repr(other.error)
        if racer != "flush":
            assert other.result == 0  # nothing unshielded to evict
        if copy_fails:
            assert isinstance(put.error, KVLifeError), put.error or put.result
            _wait(lambda: store.indexed_keys() == [], "the failed put's chunks to go")
            assert store.lookup(identity, PUBLIC, tokens).tokens == 0
        else:
            assert put.error is None, repr(put.error)
            _assert_loads_exactly(store, identity, tokens, kv, 4)
            disk = disk_of(store)
            assert all(disk.contains(ChunkKey(k)) for k in store.indexed_keys())
    finally:
        stall.release()
        store.close(flush=False)
    with _reopen(tmp_path) as again:
        if copy_fails:
            assert again.indexed_keys() == []
        else:
            _assert_loads_exactly(again, identity, tokens, kv, 4)


def test_a_second_put_waits_for_the_first_puts_copy_before_it_returns(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """Put #2 of the same prompt, while put #1's copy is held, finds the chunks INDEXED
    (present) and plans no copy of its own (their disk replica is being written); it
    still returns only after put #1's copy is durable (its plan's turn comes after),
    so its acknowledgement holds when the copy succeeds."""
    tokens, kv = prompt_kv(51, 4 * N)
    io = FaultyIO()
    store = _open(tmp_path, io=io)
    stall = io.stall("pwritev", path=SEG)
    try:
        first = _Call(lambda: store.put_prompt(identity, PUBLIC, tokens, kv))
        assert stall.wait_entered()
        second = _Call(lambda: store.put_prompt(identity, PUBLIC, tokens, kv))
        assert _blocked(second), "put #2 returned before put #1's copy was durable"
        stall.release()
        first.join()
        second.join()
        assert first.error is None and second.error is None, (first.error, second.error)
        assert isinstance(second.result, PutResult)
        assert second.result.already_present == 4
        assert second.result.tokens_stored_or_present == 4 * N
        assert store.counters.as_dict()["tier.disk.stored"] == 4  # one copy, not two
    finally:
        stall.release()
        store.close(flush=False)
    with _reopen(tmp_path) as again:
        _assert_loads_exactly(again, identity, tokens, kv, 4)


def test_a_put_left_in_flight_to_a_pending_put_claims_nothing(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """Put #2 prepared while put #1 is still TENTATIVE (two-phase) and committed first:
    it reports the chunks ``in_flight`` and covers no tokens (it promised nothing);
    put #1's copy then fails and retires them. Honest: nothing was claimed."""
    tokens, kv = prompt_kv(52, 4 * N)
    io = FaultyIO()
    with _open(tmp_path, io=io) as store:
        p1 = store.prepare_put(identity, PUBLIC, tokens, kv)
        p2 = store.prepare_put(identity, PUBLIC, tokens, kv)
        r2 = store.commit_put(p2)
        assert (r2.stored, r2.in_flight, r2.already_present) == (0, 4, 0)
        assert r2.tokens_stored_or_present == 0
        io.arm("pwritev", errno.EIO, once=True, path=SEG)
        with pytest.raises(KVLifeError):
            store.commit_put(p1)
        assert store.indexed_keys() == []


@pytest.mark.parametrize("longer", [False, True], ids=["same-prompt", "longer-prompt"])
def test_a_second_put_is_not_acknowledged_on_chunks_the_first_put_failed_to_make_durable(
    tmp_path: Path, identity: ModelIdentity, longer: bool
) -> None:
    """Write-through promise (README; tests/test_crash.py: "a put that returns has made
    every chunk of its prompt durable, including chunks that were already indexed"):
    put #2 that returns must have every chunk of its prompt durable, else raise.

    Sequence: put #1 (4 chunks) indexed in DRAM, its copy held; put #2 of the same 4
    chunks (or of 6 chunks extending them) finds them present and waits for its turn;
    put #1's copy fails; put #1 raises and retires the 4 chunks. Put #2 used to return
    a PutResult (already_present=4; with 6 chunks stored=2, chunks 5-6 durable but
    orphaned under a prefix that was gone), so a crash lost everything it was
    acknowledged for. It now raises, and stores nothing of its own."""
    ntok = (6 if longer else 4) * N
    tokens, kv = prompt_kv(53, ntok)
    t1, kv1 = tokens[: 4 * N], kv[:, :, :, : 4 * N, :]
    io = FaultyIO()
    store = _open(tmp_path, io=io)
    stall = io.stall("pwritev", path=SEG)
    try:
        first = _Call(lambda: store.put_prompt(identity, PUBLIC, t1, kv1))
        assert stall.wait_entered()
        second = _Call(lambda: store.put_prompt(identity, PUBLIC, tokens, kv))
        assert _blocked(second)
        io.arm("pwritev", errno.EIO, once=True, path=SEG)
        stall.release()
        first.join()
        second.join()
        assert isinstance(first.error, KVLifeError), first.error or first.result
    finally:
        stall.release()
        store.close(flush=False)  # a crash: DRAM is gone
    # put #2 found the chunks indexed with their copy under way: its promise rested on
    # that copy, so it is refused, typed, and stores nothing of its own either
    assert isinstance(second.error, StorePathError), second.error or second.result
    assert "nothing of this put was stored" in str(second.error)
    with _reopen(tmp_path) as again:
        assert again.indexed_keys() == []
        assert again.lookup(identity, PUBLIC, tokens).tokens == 0


# --------------------------------------------------------------------------- 4. part of the
# prompt invalidated while its copy is held


@pytest.mark.parametrize("copy_fails", [False, True])
def test_an_invalidation_of_the_prompts_tail_during_the_copy(
    tmp_path: Path, identity: ModelIdentity, copy_fails: bool
) -> None:
    """``invalidate(prefix=<chunk 3>)`` while the copy of chunks 1-4 is held takes chunks
    3-4 at once (a lookup covers 2 chunks). Copy done: chunks 1-2 are offloaded and
    durable, 3-4's bytes are removed after the write (no offload claimed); the put says
    stored=4, covering 2 chunks. Copy failed: 1-2 go as ``write-through failed``, 3-4 as
    invalidated, the put raises, nothing is left. A reopen agrees either way."""
    tokens, kv = prompt_kv(61, 4 * N)
    sink, io = MemorySink(), FaultyIO()
    store = _open(tmp_path, sink, io)
    stall = io.stall("pwritev", path=SEG)
    try:
        put = _Call(lambda: store.put_prompt(identity, PUBLIC, tokens, kv))
        assert stall.wait_entered()
        keys = [h.key for h in store.lookup(identity, PUBLIC, tokens).hits]
        assert len(keys) == 4
        inval = _Call(lambda: store.invalidate(prefix=keys[2]))
        _wait(
            lambda: store.lookup(identity, PUBLIC, tokens).tokens == 2 * N,
            "the invalidation to take chunks 3-4",
        )
        assert _blocked(inval)  # it deletes in its turn, after the copy's
        if copy_fails:
            io.arm("pwritev", errno.EIO, once=True, path=SEG)
        stall.release()
        put.join()
        inval.join()
        assert inval.error is None and inval.result == 2, (inval.error, inval.result)

        hexes = [bytes(k).hex() for k in keys]
        kinds = _moves(sink)
        disk = disk_of(store)
        for k in keys[2:]:
            assert not disk.contains(ChunkKey(k))
        for h in hexes[2:]:
            names = [k for k, _ in kinds[h]]
            assert not any(n.startswith("offload") for n in names), names
            assert names[-2:] == ["invalidate", "delete"], names
            assert kinds[h][-2][1].startswith("invalidated:prefix"), kinds[h]
        counters = store.counters.as_dict()
        assert counters["invalidated"] == 2
        if copy_fails:
            assert isinstance(put.error, KVLifeError), put.error or put.result
            assert store.indexed_keys() == []
            assert disk.live_bytes == 0
            for h in hexes[:2]:
                assert kinds[h][-2:] == [
                    ("invalidate", "write-through failed"),
                    ("delete", "write-through failed"),
                ], kinds[h]
        else:
            assert put.error is None, repr(put.error)
            assert isinstance(put.result, PutResult)
            assert put.result.stored == 4
            assert put.result.tokens_stored_or_present == 2 * N
            assert counters["tier.disk.stored"] == 2
            assert sorted(disk.replica_keys()) == sorted(keys[:2])
            for h in hexes[:2]:
                assert ("offload>disk", "write-through") in kinds[h], kinds[h]
            _assert_loads_exactly(store, identity, tokens, kv, 2)
    finally:
        stall.release()
        store.close(flush=False)
    with _reopen(tmp_path) as again:
        want = 0 if copy_fails else 2
        assert len(again.indexed_keys()) == want
        _assert_loads_exactly(again, identity, tokens, kv, want)


# --------------------------------------------------------------------------- 5. a put larger
# than one copy batch


class _SyncLog(FaultyIO):
    """A FaultyIO that records which file each fdatasync was for (test instrumentation of
    the file seam only)."""

    def __init__(self) -> None:
        super().__init__()
        self.synced: list[str] = []

    def fdatasync(self, fd: int) -> None:
        path = self._path(fd)
        self.synced.append(path.name if path is not None else "")
        super().fdatasync(fd)


BIG = 100
"""Chunks of the large prompt: more than one write-through copy batch (64,
``Placement.plan_copies``)."""


def _full_store(
    path: Path, identity: ModelIdentity, io: FaultyIO
) -> tuple[KVStore, np.ndarray, np.ndarray]:
    """A store whose disk holds exactly BIG frames, full of an older prompt, so that the
    next BIG-chunk put's copy evicts between its two batches (two separate writes)."""
    store = _open(path, io=io, dram=8 << 20, disk=BIG * 8192)
    old_tokens, old_kv = prompt_kv(70, BIG * N)
    assert store.put_prompt(identity, PUBLIC, old_tokens, old_kv).stored == BIG
    tokens, kv = prompt_kv(71, BIG * N)
    return store, tokens, kv


def _segment_syncs(path: Path, identity: ModelIdentity) -> list[str]:
    """The segment files a BIG-chunk put into a full store fdatasyncs, in order (the
    same steps once, to find the last copy batch's fdatasync)."""
    dry = _SyncLog()
    store, tokens, kv = _full_store(path, identity, dry)
    with store:
        before = len(dry.synced)
        store.put_prompt(identity, PUBLIC, tokens, kv)
        return [n for n in dry.synced[before:] if n.startswith("seg-")]


def test_a_write_through_put_failing_in_its_second_copy_batch_stores_none_of_it(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """docs/store.md: "under write-through, a put whose chunks cannot all be made durable
    stores none of its new chunks and raises". A 100-chunk put into a full disk copies
    in two batches (64, 36) with evictions between them, each its own write; the
    fdatasync of the second batch fails. The put raises, yet chunks 1-64 stay indexed,
    served and durable (a reopen serves 64 of the 100 chunks of a put that failed)."""
    syncs = _segment_syncs(tmp_path / "dry", identity)
    assert len(syncs) >= 2

    io = FaultyIO()
    store, tokens, kv = _full_store(tmp_path / "real", identity, io)
    try:
        io.arm("fdatasync", errno.EIO, after=len(syncs) - 1, once=True, path=SEG)
        with pytest.raises(KVLifeError, match="writing 36 replicas"):
            store.put_prompt(identity, PUBLIC, tokens, kv)
        assert io.injected == {"fdatasync": 1}
        hit = store.lookup(identity, PUBLIC, tokens).tokens
        assert hit == 0, f"a put that raised serves {hit // N} of its chunks"
        assert store.counters.as_dict()["write_through_failed"] == BIG
    finally:
        store.close(flush=False)
    with _reopen(tmp_path / "real", dram=8 << 20, disk=BIG * 8192) as again:
        assert again.lookup(identity, PUBLIC, tokens).tokens == 0


def _failed_undo(
    tmp_path: Path, identity: ModelIdentity, times: int
) -> tuple[KVStore, np.ndarray, np.ndarray, list[int]]:
    """A full store whose next BIG-chunk write-through put fails in its second copy
    batch's fdatasync, and whose disk deletes after that fault fail ``times`` times
    (the undo's first): the store, the put's tokens and KV, and the sizes of the deletes
    that failed. The put has raised its own error already."""
    syncs = _segment_syncs(tmp_path / "dry", identity)
    io = FaultyIO()
    store, tokens, kv = _full_store(tmp_path / "real", identity, io)
    # the undo's deletes, after the failed fdatasync (the evictions before it succeed)
    failed = fail_deletes(store, times, armed=lambda: bool(io.injected))
    io.arm("fdatasync", errno.EIO, after=len(syncs) - 1, once=True, path=SEG)
    with pytest.raises(KVLifeError, match="writing 36 replicas"):
        store.put_prompt(identity, PUBLIC, tokens, kv)
    return store, tokens, kv, failed


def test_a_failed_undo_of_a_write_through_put_raises_the_puts_error_and_leaves_it_unserved(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """The double fault: the second copy batch's fdatasync fails, and the undo's delete
    of the 64 frames the first batch made durable fails too (the disk tier's catalog
    raises). The put still raises its own typed error (the write's, not the delete's),
    every new chunk is counted in ``write_through_failed`` and unserved, the failed
    delete is counted and logged, and a restart does not serve the put that failed:
    its frames are deleted by the close, never indexed again."""
    store, tokens, _, failed = _failed_undo(tmp_path, identity, 1)
    try:
        assert failed == [64], "the undo's delete of the first batch's frames"
        assert store.lookup(identity, PUBLIC, tokens).tokens == 0
        counters = store.counters.as_dict()
        assert counters["write_through_failed"] == BIG
        assert counters["deletes_failed"] == 64
    finally:
        store.close(flush=False)  # retries the delete (it succeeds now)
    with _reopen(tmp_path / "real", dram=8 << 20, disk=BIG * 8192) as again:
        assert again.lookup(identity, PUBLIC, tokens).tokens == 0


def test_a_delete_that_fails_at_close_too_leaves_the_frames_for_the_next_open(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """The undo's delete failing every time, the close's retry too: the close raises
    nothing for it (logged), and the next open finds the first batch's frames again,
    each chunk served with the bytes the put wrote (never other bytes)."""
    store, tokens, kv, _ = _failed_undo(tmp_path, identity, 1 << 30)
    try:
        assert store.counters.as_dict()["deletes_failed"] == 64
    finally:
        store.close(flush=False)
    with _reopen(tmp_path / "real", dram=8 << 20, disk=BIG * 8192) as again:
        hit = again.lookup(identity, PUBLIC, tokens)
        assert hit.tokens > 0  # found again: the frames a first batch made durable
        got = again.load(hit)
        for i, arr in enumerate(got.arrays):
            assert np.array_equal(arr, _chunk(kv, i))


def test_the_close_never_deletes_a_key_put_again_since_its_delete_failed(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """Deletes go by key: a chunk whose delete failed and that a later put stored again
    holds that put's replica under the same key. The undo's delete fails once; the
    prompt's first ten chunks are put again (without a failure) before the close; the
    close's retry skips those keys and deletes the rest, and the next open serves those
    ten chunks, exact, and none after them."""
    store, tokens, kv, failed = _failed_undo(tmp_path, identity, 1)
    try:
        assert failed == [64]
        # the first ten chunks again (the undeleted frames hold disk room meanwhile)
        head_tokens, head_kv = tokens[: 10 * N], kv[:, :, :, : 10 * N, :]
        assert store.put_prompt(identity, PUBLIC, head_tokens, head_kv).stored == 10
        assert store.counters.as_dict()["deletes_failed"] == 64  # kept for the close
    finally:
        store.close(flush=False)
    with _reopen(tmp_path / "real", dram=8 << 20, disk=BIG * 8192) as again:
        assert again.lookup(identity, PUBLIC, tokens).tokens == 10 * N
        _assert_loads_exactly(again, identity, head_tokens, head_kv, 10)

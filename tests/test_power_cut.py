"""Power cuts, not only process kills: the fsync ordering of the disk tier under test.

:class:`kvlife.faults.powercut.PowerCutIO` holds what is written but not durable apart
and throws it away at a chosen moment. First the seam itself is checked (unsynced data
and directory changes vanish, synced ones stay, a dead seam changes nothing). Then writer
workloads run in-process through it (write-through puts, write-back + flush, demotion
under a tiny DRAM, compaction under a tiny disk, invalidation; some close and reopen the
store midway, so cuts also hit close and recovery), the power is cut before
or after the k-th file call (k swept over the run), the directory is reopened with a
plain FileIO, and the test demands:

(a) nothing acknowledged lost: every chunk of a write-through put that returned, and of
    every put before a flush that returned, loads, unless the store said it dropped it
    (eviction, invalidation: lifecycle events) or the operation cut short may have;
(b) nothing uncommitted or wrong served: every indexed key is one the workload put,
    loads bit-exact, and is not one an acknowledged invalidation removed;
(c) reopening dropped nothing (no catalog row names bytes that were not durable) and
    ``check()`` finds no bad replica;
(d) the reopened store takes a put and serves it back.

The default run cuts at half a dozen points per workload plus a small hypothesis sample
(a dozen points and a bigger sample under the slow profile, see tests/conftest.py); the
slow tier cuts at every call and draws many more samples.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.core.errors import KVLifeError
from kvlife.core.events import EventSink, LifecycleEvent
from kvlife.core.identity import ChunkKey, Namespace, NamespaceKind
from kvlife.core.lifecycle import Move
from kvlife.faults.damage import catalog_file
from kvlife.faults.powercut import CUT_OPS, CutPoint, PowerCut, PowerCutIO
from kvlife.store import KVStore
from kvlife.tiers.disk.fileio import FileIO
from tests.conftest import budget
from tests.helpers.workload import (
    LAYOUT,
    ChunkRef,
    KiB,
    MiB,
    Prompt,
    assert_served_correctly,
    chunk_refs,
    invalidation_after,
    load_chunk,
    load_prompt,
    make_prompt,
    put,
)

# ------------------------------------------------------------------ the seam itself


def _arr(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8).copy()


def _read(io: FileIO, fd: int, n: int, offset: int = 0) -> bytes:
    buf = np.zeros(n, dtype=np.uint8)
    got = io.preadv(fd, [buf], offset)
    return buf[:got].tobytes()


def _seam(tmp_path: Path, **kw: float) -> PowerCutIO:
    return PowerCutIO(stash=tmp_path / "stash", **kw)  # type: ignore[arg-type]


def test_unsynced_data_is_read_back_then_lost_synced_data_stays(tmp_path: Path) -> None:
    io = _seam(tmp_path)
    path = tmp_path / "f"
    fd = io.open(path, create=True)
    io.fsync_dir(tmp_path)
    io.pwritev(fd, [_arr(b"durable!")], 0)
    io.fdatasync(fd)
    io.pwritev(fd, [_arr(b"volatile"), _arr(b"-tail")], 8)
    assert _read(io, fd, 64) == b"durable!volatile-tail"
    assert io.size(fd) == 21
    assert path.read_bytes() == b"durable!", "pending data reached the real file"
    assert io.pending_bytes == 13
    io.cut()
    assert path.read_bytes() == b"durable!"
    with pytest.raises(PowerCut):
        io.preadv(fd, [np.zeros(4, dtype=np.uint8)], 0)


def test_truncate_is_pending_until_fdatasync(tmp_path: Path) -> None:
    io = _seam(tmp_path)
    path = tmp_path / "f"
    path.write_bytes(b"0123456789")
    fd = io.open(path, create=False)
    io.truncate(fd, 4)
    io.pwritev(fd, [_arr(b"xy")], 6)  # extends over the cut-away range: zeros between
    assert _read(io, fd, 16) == b"0123\0\0xy"
    assert path.read_bytes() == b"0123456789"
    io.fdatasync(fd)
    assert path.read_bytes() == b"0123\0\0xy"
    io.close(fd)


@pytest.mark.parametrize("synced", [False, True], ids=["dir-not-synced", "dir-synced"])
def test_created_file_needs_its_directory_synced(tmp_path: Path, synced: bool) -> None:
    io = _seam(tmp_path)
    path = tmp_path / "new"
    fd = io.open(path, create=True)
    io.pwritev(fd, [_arr(b"data")], 0)
    io.fdatasync(fd)
    if synced:
        io.fsync_dir(tmp_path)
    io.cut()
    assert path.exists() == synced
    if synced:
        assert path.read_bytes() == b"data"


@pytest.mark.parametrize("synced", [False, True], ids=["dir-not-synced", "dir-synced"])
def test_unlink_needs_its_directory_synced(tmp_path: Path, synced: bool) -> None:
    io = _seam(tmp_path)
    path = tmp_path / "old"
    path.write_bytes(b"kept")
    io.unlink(path)
    assert not path.exists()
    if synced:
        io.fsync_dir(tmp_path)
    io.cut()
    assert path.exists() != synced
    if not synced:
        assert path.read_bytes() == b"kept"


@pytest.mark.parametrize("synced", [False, True], ids=["dir-not-synced", "dir-synced"])
def test_rename_over_a_file_needs_its_directory_synced(tmp_path: Path, synced: bool) -> None:
    io = _seam(tmp_path)
    src, dst = tmp_path / "a.tmp", tmp_path / "a"
    src.write_bytes(b"new")
    dst.write_bytes(b"old")
    io.replace(src, dst)
    assert dst.read_bytes() == b"new" and not src.exists()
    if synced:
        io.fsync_dir(tmp_path)
    io.cut()
    assert dst.read_bytes() == (b"new" if synced else b"old")
    assert src.exists() != synced


@pytest.mark.parametrize(("when", "kept"), [("before", False), ("after", True)])
def test_cut_armed_at_a_sync_fires_before_or_after_it(
    tmp_path: Path, when: Literal["before", "after"], kept: bool
) -> None:
    io = _seam(tmp_path)
    path = tmp_path / "f"
    path.write_bytes(b"")
    fd = io.open(path, create=False)
    io.arm(CutPoint(2, "fdatasync", when))
    io.pwritev(fd, [_arr(b"one")], 0)
    io.fdatasync(fd)
    io.pwritev(fd, [_arr(b"two")], 3)
    with pytest.raises(PowerCut):
        io.fdatasync(fd)
    assert io.dead and io.cut_at.startswith(f"{when} fdatasync #2")
    assert path.read_bytes() == (b"onetwo" if kept else b"one")
    # A dead seam changes nothing: buffered calls are accepted and dropped, the rest fail.
    assert io.pwritev(fd, [_arr(b"late")], 0) == 4
    io.truncate(fd, 0)
    io.unlink(path)
    io.close(fd)
    for call in (lambda: io.fdatasync(fd), lambda: io.size(fd), lambda: io.fsync_dir(tmp_path)):
        with pytest.raises(PowerCut):
            call()
    with pytest.raises(PowerCut):
        io.open(path, create=False)
    assert path.read_bytes() == (b"onetwo" if kept else b"one")


def test_cut_armed_after_a_call_that_fails_still_fires(tmp_path: Path) -> None:
    io = _seam(tmp_path)
    io.arm(CutPoint(1, "open", "after"))
    with pytest.raises(PowerCut):
        io.open(tmp_path / "missing", create=False)
    assert io.dead and io.cut_at.startswith("after open #1")


def test_partial_write_back_keeps_a_share_of_pending_pages(tmp_path: Path) -> None:
    io = _seam(tmp_path, persist=1.0)
    path = tmp_path / "f"
    path.write_bytes(bytes(8192))
    fd = io.open(path, create=False)
    io.pwritev(fd, [_arr(b"\x01" * 8192)], 0)
    io.cut()
    assert path.read_bytes() == b"\x01" * 8192


def test_catalog_keeps_what_was_committed_at_the_cut(tmp_path: Path) -> None:
    db_path = tmp_path / "cat.sqlite"
    db = sqlite3.connect(db_path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("CREATE TABLE t (v INTEGER)")
    db.execute("INSERT INTO t VALUES (1)")
    io = PowerCutIO(catalogs=[db_path], stash=tmp_path / "stash")
    io.cut()
    db.execute("INSERT INTO t VALUES (2)")  # the dead process cannot have done this
    db.close()
    io.settle()
    db = sqlite3.connect(db_path)
    try:
        assert [r[0] for r in db.execute("SELECT v FROM t")] == [1]
    finally:
        db.close()


def test_cut_points_are_validated() -> None:
    with pytest.raises(ValueError):
        CutPoint(0)
    with pytest.raises(ValueError):
        CutPoint(1, "preadv")
    assert "fdatasync" in CUT_OPS


# ------------------------------------------------------------------ workloads under cuts

SEED = 9001
PROBE_NS = Namespace(NamespaceKind.REQUEST, "power-probe")


@dataclass(frozen=True, slots=True)
class Workload:
    """A writer run: tier sizes and what it does after each put."""

    dram_chunks: int
    disk_bytes: int
    segment_bytes: int
    write_through: bool
    prompts: int
    flush_every: int = 0
    """Flush after every n-th put (0: never)."""
    invalidate_prob: float = 0.0
    disk_evicts: bool = False
    """The disk is small enough that puts evict from it."""
    reopen_every: int = 0
    """Close the store (flushing it) and open it again after every n-th put (0: never),
    so that cuts also hit ``close`` and recovery in ``open``."""

    def open(
        self, path: Path, fileio: FileIO | None = None, sink: EventSink | None = None
    ) -> KVStore:
        return KVStore.open(
            path,
            dram_bytes=self.dram_chunks * LAYOUT.chunk_nbytes,
            disk_bytes=self.disk_bytes,
            segment_bytes=self.segment_bytes,
            write_through=self.write_through,
            fileio=fileio,
            sink=sink,
        )


WORKLOADS: dict[str, Workload] = {
    "write-through": Workload(64, 64 * MiB, 64 * KiB, write_through=True, prompts=10),
    "write-back-flush": Workload(
        256, 64 * MiB, 64 * KiB, write_through=False, prompts=12, flush_every=3, reopen_every=5
    ),
    # Six chunks of DRAM: nearly every put demotes older chunks to disk.
    "demotion": Workload(6, 64 * MiB, 64 * KiB, write_through=False, prompts=12, flush_every=4),
    # 24 frames of disk in 4-frame segments, namespaces invalidated often: eviction,
    # garbage and compaction.
    "compaction": Workload(
        8,
        24 * 8 * KiB,
        32 * KiB,
        write_through=True,
        prompts=30,
        invalidate_prob=0.3,
        disk_evicts=True,
        reopen_every=10,
    ),
    "invalidation": Workload(
        64, 64 * MiB, 64 * KiB, write_through=True, prompts=16, invalidate_prob=0.35
    ),
}


@dataclass(frozen=True, slots=True)
class Op:
    kind: Literal["put", "flush", "invalidate", "reopen"]
    prompt: Prompt | None = None
    namespace: Namespace | None = None


def operations(w: Workload, seed: int) -> Iterator[Op]:
    for n in range(w.prompts):
        yield Op("put", prompt=make_prompt(seed, n))
        if w.flush_every and (n + 1) % w.flush_every == 0:
            yield Op("flush")
        ns = invalidation_after(seed, n, w.invalidate_prob)
        if ns is not None:
            yield Op("invalidate", namespace=ns)
        if w.reopen_every and (n + 1) % w.reopen_every == 0:
            yield Op("reopen")


@dataclass(slots=True)
class Oracle(EventSink):
    """What the run acknowledged, and what the store said it dropped (its events)."""

    refs: dict[ChunkKey, ChunkRef] = field(default_factory=dict)
    last_put: dict[ChunkKey, int] = field(default_factory=dict)
    """Sequence number of the last put that may have written the key."""
    invalidated: dict[str, int] = field(default_factory=dict)
    """Namespace -> sequence number of its last acknowledged invalidation."""
    owed: set[ChunkKey] = field(default_factory=set)
    unflushed: set[ChunkKey] = field(default_factory=set)
    in_flight: Op | None = None
    dropped_now: set[ChunkKey] = field(default_factory=set)
    """Keys the operation in flight dropped (its events)."""
    acked_ops: int = 0

    def emit(self, event: LifecycleEvent) -> None:
        if event.kind == Move.DELETE.value or (
            event.kind == Move.EVICT.value and event.tier == "disk"
        ):
            key = ChunkKey(bytes.fromhex(event.key))
            self.owed.discard(key)
            self.unflushed.discard(key)
            self.dropped_now.add(key)

    def begin(self, seq: int, op: Op) -> None:
        self.in_flight = op
        self.dropped_now = set()
        if op.prompt is not None:
            for ref in chunk_refs(op.prompt):
                self.refs.setdefault(ref.key, ref)
                self.last_put[ref.key] = seq

    def acked(self, seq: int, op: Op, write_through: bool) -> None:
        self.in_flight = None
        self.acked_ops += 1
        if op.kind == "put":
            assert op.prompt is not None
            # A key the put itself dropped is not owed: the store said so (an event), as
            # the crash tests' "nd" lines say it (and see test_faults.py::
            # test_write_through_put_never_evicts_its_own_present_chunks).
            kept = [k for k in op.prompt.keys if k not in self.dropped_now]
            (self.owed if write_through else self.unflushed).update(kept)
        elif op.kind in ("flush", "reopen"):  # close flushes
            self.owed |= self.unflushed
            self.unflushed.clear()
        else:
            assert op.namespace is not None
            self.invalidated[str(op.namespace)] = seq
            gone = {k for k in self.owed | self.unflushed if self.refs[k].namespace == op.namespace}
            self.owed -= gone
            self.unflushed -= gone

    def must_be_gone(self, key: ChunkKey) -> bool:
        ns = str(self.refs[key].namespace)
        return self.invalidated.get(ns, -1) > self.last_put[key]

    def excused(self) -> tuple[set[ChunkKey], int]:
        """Owed keys the operation cut short may have removed, and how many keys more it
        may have evicted (a put that makes room)."""
        op = self.in_flight
        if op is None:
            return set(), 0
        if op.kind == "invalidate":
            return {k for k in self.owed if self.refs[k].namespace == op.namespace}, 0
        if op.kind == "put":
            assert op.prompt is not None
            return set(), len(op.prompt.keys)
        return set(), 0


@dataclass(slots=True)
class Run:
    oracle: Oracle
    calls: int
    """File calls of :data:`CUT_OPS` the run made (before the cut)."""
    counted: dict[str, int]
    """The same per operation."""
    cut_at: str
    figures: dict[str, int]
    demotions: int


def disk_figures(store: KVStore) -> dict[str, int]:
    """The disk tier's counters, from the public ``info()``."""
    tier = next(t for t in store.info().tiers if t.name == "disk")
    return {k: v for k, v in tier.details.items() if isinstance(v, int)}


def run_until_cut(
    path: Path,
    w: Workload,
    seed: int,
    point: CutPoint | None,
    persist: float = 0.0,
    io: PowerCutIO | None = None,
) -> Run:
    """Run the workload through a power-cut seam armed at ``point`` (no cut: the power
    goes at the end); leave the directory as the cut left it."""
    if io is None:
        io = PowerCutIO(
            catalogs=[catalog_file(path)],
            stash=path.parent / f"{path.name}.stash",
            persist=persist,
            seed=seed,
        )
    oracle = Oracle()
    if point is not None:
        io.arm(point)  # counted from here: the cut may come inside KVStore.open
    figures: dict[str, int] = {}
    demotions = 0

    def tally(store: KVStore) -> None:
        nonlocal demotions
        for k, v in disk_figures(store).items():
            figures[k] = figures.get(k, 0) + v
        demotions += store.counters.demotions

    store: KVStore | None = None
    try:
        try:
            store = w.open(path, io, sink=oracle)
        except KVLifeError:
            if not io.dead:
                raise
        for seq, op in enumerate(operations(w, seed)):
            if store is None:
                break
            oracle.begin(seq, op)
            try:
                if op.kind == "put":
                    assert op.prompt is not None
                    put(store, op.prompt)
                elif op.kind == "flush":
                    store.flush()
                elif op.kind == "invalidate":
                    store.invalidate(namespace=op.namespace)
                else:
                    tally(store)
                    closing, store = store, None
                    closing.close()
                    store = w.open(path, io, sink=oracle)
            except (KVLifeError, PowerCut):
                # PowerCut itself escapes untyped where the disk tier reclaims an emptied
                # segment (see test_faults.py::test_unlink_fault_while_invalidating_is_typed).
                if not io.dead:
                    raise
            if io.dead:
                break
            oracle.acked(seq, op, w.write_through)
        if not io.dead:
            assert store is not None
            tally(store)
            io.cut("at the end of the workload")
    finally:
        if not io.dead:
            io.cut("test failed")
        if store is not None:
            store.close(flush=False)
    io.settle()
    return Run(oracle, io.total, dict(io.counted), io.cut_at, figures, demotions)


def verify_after_cut(path: Path, w: Workload, run: Run) -> None:
    o = run.oracle
    store = w.open(path)
    try:
        where = f"(cut {run.cut_at})"
        assert store.counters.recovery_dropped == 0, f"recovery dropped replicas {where}"
        keys = store.indexed_keys()
        for key in keys:
            assert key in o.refs, f"store serves a key no put wrote {where}"
            assert not o.must_be_gone(key), f"invalidated key {key.hex()[:16]} is back {where}"
            got = load_chunk(store, o.refs[key])
            assert got.corrupt == [], f"replica {key.hex()[:16]} corrupt {where}"
            assert got.loaded == 1, f"indexed key {key.hex()[:16]} did not load {where}"
            assert_served_correctly(got, [key])
        excused, may_evict = o.excused()
        lost = o.owed - set(keys) - excused
        allowed = may_evict if w.disk_evicts else 0
        assert len(lost) <= allowed, (
            f"{len(lost)} acknowledged chunks lost {where}; the operation cut short may "
            f"account for {allowed}"
        )
        report = store.check()
        assert report.problems == [] and report.bad_keys == [], f"{report.problems} {where}"
        probe = make_prompt(SEED + 1, 0, namespace=PROBE_NS)
        res = put(store, probe)
        assert res.stored + res.already_present == len(probe.keys)
        got = load_prompt(store, probe)
        assert got.complete
        assert_served_correctly(got, probe.keys)
    finally:
        store.close()


def cut_and_verify(
    tmp: Path, name: str, seed: int, point: CutPoint | None, persist: float = 0.0
) -> Run:
    path = tmp / f"{name}-{seed}-{point.nth if point else 0}-{point.when if point else ''}"
    run = run_until_cut(path, WORKLOADS[name], seed, point, persist)
    verify_after_cut(path, WORKLOADS[name], run)
    return run


def dry_run(tmp: Path, name: str, seed: int) -> Run:
    """The workload without a cut: how many file calls it makes, and what it exercised."""
    return cut_and_verify(tmp, name, seed, None)


def sweep(total: int, points: int) -> list[CutPoint]:
    """``points`` cut points spread over calls 1..total, before and after alternately."""
    nths = sorted({int(x) for x in np.linspace(1, total, num=min(points, total))})
    return [CutPoint(n, None, "after" if i % 2 else "before") for i, n in enumerate(nths)]


def test_workloads_exercise_what_they_are_named_after(tmp_path: Path) -> None:
    runs = {name: dry_run(tmp_path, name, SEED) for name in WORKLOADS}
    for name, run in runs.items():
        assert run.calls > 20, f"{name} made only {run.calls} file calls"
        assert run.oracle.acked_ops > 0 and run.oracle.in_flight is None
    assert runs["demotion"].demotions > 0, "the demotion workload never demoted"
    assert runs["compaction"].figures["compaction_bytes_written"] > 0, "never compacted"
    assert runs["compaction"].figures["segments_reclaimed"] > 0
    assert runs["invalidation"].oracle.invalidated, "the invalidation workload never invalidated"
    assert runs["write-through"].oracle.owed and runs["write-back-flush"].oracle.owed
    assert runs["write-back-flush"].counted["open"] > runs["write-through"].counted["open"], (
        "the reopening workload did not reopen"
    )


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_power_cut_loses_nothing_acknowledged_serves_nothing_wrong(
    tmp_path: Path, name: str
) -> None:
    total = dry_run(tmp_path, name, SEED).calls
    owed_checked = 0
    for point in sweep(total, budget(6, 12)):
        run = cut_and_verify(tmp_path, name, SEED, point)
        assert run.cut_at.startswith(point.when), run.cut_at
        owed_checked += len(run.oracle.owed)
    assert owed_checked > 0, "no cut point had anything acknowledged to check"


CUT_SAMPLES = {
    "name": st.sampled_from(sorted(WORKLOADS)),
    "seed": st.integers(0, 2**20),
    "where": st.floats(0.0, 1.0),
    "when": st.sampled_from(["before", "after"]),
    "op": st.sampled_from([None, "pwritev", "fdatasync", "fsync_dir", "unlink"]),
    "persist": st.sampled_from([0.0, 0.5]),
}


@settings(max_examples=budget(4, 8), deadline=None)
@given(**CUT_SAMPLES)
def test_power_cut_property(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    seed: int,
    where: float,
    when: Literal["before", "after"],
    op: str | None,
    persist: float,
) -> None:
    cut_one_sample(tmp_path_factory.mktemp("cut"), name, seed, where, when, op, persist)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(**CUT_SAMPLES)
def test_power_cut_property_many_samples(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    seed: int,
    where: float,
    when: Literal["before", "after"],
    op: str | None,
    persist: float,
) -> None:
    cut_one_sample(tmp_path_factory.mktemp("cut"), name, seed, where, when, op, persist)


def cut_one_sample(
    tmp: Path,
    name: str,
    seed: int,
    where: float,
    when: Literal["before", "after"],
    op: str | None,
    persist: float,
) -> None:
    """One drawn cut: the workload ``name`` with ``seed``, cut at the share ``where`` of
    its file calls (of kind ``op``; None: all calls)."""
    dry = dry_run(tmp, name, seed)
    # ``op`` calls of one kind: count them in the dry run's seam (None: all calls).
    total = dry.calls if op is None else dry.counted.get(op, 0)
    if total == 0:
        return  # the workload makes no such call (e.g. no unlink without invalidation)
    cut_and_verify(tmp, name, seed, CutPoint(1 + int(where * (total - 1)), op, when), persist)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_power_cut_at_every_call(tmp_path: Path, name: str) -> None:
    total = dry_run(tmp_path, name, SEED + 7).calls
    for n in range(1, total + 1):
        for when in ("before", "after"):
            cut_and_verify(
                tmp_path,
                name,
                SEED + 7,
                CutPoint(n, None, when),
                persist=0.25 if n % 3 == 0 else 0.0,
            )


class SkippedSyncIO(PowerCutIO):
    """A broken data path: fdatasync does nothing (data never becomes durable)."""

    def fdatasync(self, fd: int) -> None:
        pass


def test_the_checks_catch_a_store_that_skips_fdatasync(tmp_path: Path) -> None:
    """The verification is not vacuous: with fdatasync a no-op, a power cut at the end
    of a write-through run loses acknowledged chunks, and verify_after_cut says so."""
    path = tmp_path / "broken"
    w = WORKLOADS["write-through"]
    io = SkippedSyncIO(catalogs=[catalog_file(path)], stash=tmp_path / "stash")
    run = run_until_cut(path, w, SEED, None, io=io)
    assert run.oracle.owed
    with pytest.raises(AssertionError, match=r"recovery dropped|acknowledged chunks lost"):
        verify_after_cut(path, w, run)

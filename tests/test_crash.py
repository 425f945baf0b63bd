"""Crash recovery: SIGKILL a writing child at random moments, reopen, check every byte.

A child process (the harness of :mod:`kvlife.faults.crash` running
``tests/helpers/crash_workload.py``) puts a deterministic workload with
``write_through=True``, logs every key the store drops, and fsyncs an acknowledgement
after every put and invalidation. The parent kills it after a seeded random delay of
0-300 ms (inside segment writes, fdatasync, SQLite commits, compaction, or recovery in
``KVStore.open``), reopens the store in-process and checks:

(a) every indexed key is one the workload could have written, and it loads bit-exact;
(b) nothing acknowledged is lost: every key of an acknowledged put that the store had
    on disk when the put returned, and did not drop afterwards (per the log), is still
    there; only the one operation in flight at the kill may account for a few more
    (its eviction batch, or the namespace it was invalidating). In the ``durable`` shape
    (no eviction, no invalidation) every acknowledged prompt must load in full. No key
    comes back after an acknowledged invalidation of its namespace;
(c) recovery dropped nothing and ``disk_of(store).check()`` is clean (a kill tears no
    page-cache write, so a correct commit order leaves nothing torn behind);
(d) the store takes a put, serves it back and invalidates it.

The store directory is reused across kills, so each round recovers what the last left.
"""

from __future__ import annotations

import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvlife.core.identity import ChunkKey, Namespace, NamespaceKind
from kvlife.faults import crash
from kvlife.faults.crash import CrashChild, read_log
from kvlife.store import KVStore
from tests.helpers.workload import (
    IDENTITY,
    LAYOUT,
    SHAPES,
    ChunkRef,
    Prompt,
    assert_served_correctly,
    chunk_refs,
    disk_of,
    invalidation_after,
    load_chunk,
    load_prompt,
    make_prompt,
    put,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
MAX_SLEEP_S = 0.3
CHILD_START_TIMEOUT_S = 60.0
WORKLOAD = "tests.helpers.crash_workload:run"
IN_FLIGHT_EVICTIONS = 24
"""Keys the put in flight may have evicted without logging it (the kill fell between
the catalog delete and its events). A put needs at most 5 frames (40 KiB): 5 victims,
or 20 if freed bytes are counted as 2 KiB payloads instead of 8 KiB frames."""


@dataclass(slots=True)
class ChildLog:
    """What a killed child logged, in order (parsed from its log)."""

    started: bool = False
    ready: bool = False
    entries: list[tuple[str, str]] = field(default_factory=list)
    """("put", n), ("inv", "n namespace"), ("gone", key hex), ("nd", key hex)."""
    puts: list[int] = field(default_factory=list)
    evictions: int = 0
    compaction_bytes: int = 0
    segments_reclaimed: int = 0


def parse_log(path: Path) -> ChildLog:
    out = ChildLog()
    # read_log ignores the text after the final newline: a torn line at most.
    for line in read_log(path):
        kind, parts, rest = line.kind, line.args, line.rest
        if kind == "start":
            out.started = True
        elif kind == "ready":
            out.ready = True
        elif kind == "put" and len(parts) == 4:
            out.entries.append((kind, parts[0]))
            out.puts.append(int(parts[0]))
            out.evictions = int(parts[1])
            out.compaction_bytes = int(parts[2])
            out.segments_reclaimed = int(parts[3])
        elif (kind in ("gone", "nd") and len(parts) == 1) or (kind == "inv" and len(parts) == 2):
            out.entries.append((kind, rest))
        else:
            raise AssertionError(f"unparsable line {kind} {rest!r} in {path}")
    return out


@dataclass(slots=True)
class Expectation:
    """What the children of one store directory may have written, and what must remain."""

    seed: int
    shape: str
    refs: dict[ChunkKey, ChunkRef] = field(default_factory=dict)
    last_put: dict[ChunkKey, int] = field(default_factory=dict)
    """Highest prompt number that may have put the key (acknowledged or in flight)."""
    last_invalidation: dict[str, int] = field(default_factory=dict)
    """Namespace -> number of the put after which it was last invalidated (acknowledged)."""
    owed: set[ChunkKey] = field(default_factory=set)
    """Keys durable at an acknowledged put and not dropped since, as far as the log says."""
    excused: set[ChunkKey] = field(default_factory=set)
    """Owed keys of the namespace the last operation may have been invalidating."""
    acked: list[Prompt] = field(default_factory=list)
    next_first: int = 0
    kills: int = 0
    """Rounds absorbed into this expectation (one store directory)."""
    not_durable: int = 0
    """Chunks of acknowledged puts the store held in DRAM only (see the log's ``nd``)."""
    evictions: int = 0
    compaction_bytes: int = 0
    segments_reclaimed: int = 0
    invalidations: int = 0

    def absorb(self, first: int, log: ChildLog) -> None:
        """Record a killed round that started at prompt ``first``."""
        assert log.puts == list(range(first, first + len(log.puts))), "puts out of order"
        # The prompt after the last acknowledged one may have been (partly) written.
        last = (log.puts[-1] + 1) if log.puts else first
        for number in range(first, last + 1):
            for ref in chunk_refs(make_prompt(self.seed, number)):
                self.refs.setdefault(ref.key, ref)
                self.last_put[ref.key] = number
        not_durable: set[ChunkKey] = set()
        for kind, arg in log.entries:
            if kind == "put":
                prompt = make_prompt(self.seed, int(arg))
                self.acked.append(prompt)
                self.owed.update(k for k in prompt.keys if k not in not_durable)
                self.not_durable += len(not_durable)
                not_durable.clear()
            elif kind == "nd":
                not_durable.add(ChunkKey(bytes.fromhex(arg)))
            elif kind == "gone":
                self.owed.discard(ChunkKey(bytes.fromhex(arg)))
            else:
                after, ns = arg.split()
                self.last_invalidation[ns] = int(after)
                self.invalidations += 1
        self.excused = set()
        if log.puts:
            inv = invalidation_after(self.seed, log.puts[-1], SHAPES[self.shape].invalidate_prob)
            if inv is not None:
                self.excused = {k for k in self.owed if self.refs[k].namespace == inv}
        self.next_first = last + 1
        self.kills += 1
        self.evictions += log.evictions
        self.compaction_bytes += log.compaction_bytes
        self.segments_reclaimed += log.segments_reclaimed

    def must_be_gone(self, key: ChunkKey) -> bool:
        ref = self.refs[key]
        return self.last_invalidation.get(str(ref.namespace), -1) >= self.last_put[key]


def start_child(store: Path, log: Path, seed: int, first: int, shape: str) -> CrashChild:
    return crash.start_child(
        WORKLOAD,
        store,
        log,
        [f"--seed={seed}", f"--first={first}", f"--shape={shape}"],
        pythonpath=[REPO_ROOT],
    )


def wait_for(child: CrashChild, ready: bool, warm: str) -> None:
    """Poll the child's log until it has started, or is ready; a ``warm`` round also
    waits until the child has evicted (``churn``) or put a few prompts (``durable``)."""

    def going(_: object) -> bool:
        got = parse_log(child.log)
        warmed = {"": True, "churn": got.evictions > 0, "durable": len(got.puts) >= 20}[warm]
        return (got.ready if ready else got.started) and warmed

    child.wait_until(going, timeout_s=CHILD_START_TIMEOUT_S)


def kill_round(store: Path, log: Path, exp: Expectation, rng: random.Random) -> None:
    """Run one child and SIGKILL it at a random moment; record what it acknowledged."""
    first = exp.next_first
    child = start_child(store, log, exp.seed, first, exp.shape)
    try:
        # The first round of a store runs until the churn disk is full (so that every
        # later round works under eviction and compaction) or a few prompts are durable.
        warm = exp.shape if exp.kills == 0 else ""
        # Some rounds die inside KVStore.open, while recovery deletes rows and files.
        during_open = not warm and rng.random() < 0.15
        wait_for(child, ready=not during_open, warm=warm)
        time.sleep(rng.uniform(0.0, 0.03 if during_open else MAX_SLEEP_S))
    finally:
        returncode = child.kill()
    assert returncode == -signal.SIGKILL, (
        f"child ended with {returncode}, not by the kill:\n{child.stderr()}"
    )
    exp.absorb(first, parse_log(log))


def verify_after_kill(store_path: Path, exp: Expectation) -> None:
    store = SHAPES[exp.shape].open(store_path)
    try:
        assert store.counters.recovery_dropped == 0, "recovery dropped replicas after a kill"
        disk = disk_of(store)
        assert disk is not None
        # (a) every indexed key is known and loads bit-exact, (b) invalidations stick.
        keys = store.indexed_keys()
        for key in keys:
            assert key in exp.refs, f"store serves a key no prompt wrote: {key.hex()}"
            gone = exp.must_be_gone(key)
            assert not gone, f"key {key.hex()[:16]} is back after its namespace was invalidated"
            got = load_chunk(store, exp.refs[key])
            assert got.corrupt == [], f"replica {key.hex()[:16]} corrupt after a kill"
            assert got.loaded == 1, f"indexed key {key.hex()[:16]} did not load"
            assert_served_correctly(got, [key])
        assert store.counters.corrupt == 0
        # (b) acknowledged keys survive, but for what the operation in flight may have done.
        lost = exp.owed - set(keys) - exp.excused
        allowed = IN_FLIGHT_EVICTIONS if SHAPES[exp.shape].invalidate_prob > 0 else 0
        assert len(lost) <= allowed, (
            f"{len(lost)} acknowledged chunks lost by a kill (at most {allowed} may have been "
            "evicted by the put in flight)"
        )
        if exp.shape == "durable":
            assert exp.evictions == 0, "the durable shape evicted: it cannot check losses"
            for prompt in exp.acked:
                got = load_prompt(store, prompt)
                loaded, want = got.loaded, len(prompt.keys)
                assert loaded == want, (
                    f"acknowledged prompt {prompt.number} lost chunks after a kill: "
                    f"{loaded} of {want} loaded"
                )
                assert_served_correctly(got, prompt.keys)
        # (c) the audit agrees.
        report = disk.check()
        assert report.clean, f"check() after a kill: {report.problems} {report.orphan_segments}"
        assert report.rows == len(keys)
        # (d) the store is usable: put, load back, invalidate.
        probe_store(store, exp)
        # The probe's put may have evicted owed keys: owe only what is still on disk.
        exp.owed &= set(disk.replica_keys())
    finally:
        store.close()


def probe_store(store: KVStore, exp: Expectation) -> None:
    probe_ns = Namespace(NamespaceKind.REQUEST, f"probe-{exp.kills}")
    probe = make_prompt(exp.seed + 1, exp.kills, namespace=probe_ns)
    res = put(store, probe)
    assert res.stored + res.already_present == len(probe.keys)
    got = load_prompt(store, probe)
    assert got.complete
    assert_served_correctly(got, probe.keys)
    assert store.invalidate(namespace=probe_ns) == len(probe.keys)
    assert store.lookup(IDENTITY, probe_ns, probe.tokens).hits == []


@dataclass(slots=True)
class LoopStats:
    kills: int = 0
    evictions: int = 0
    compaction_bytes: int = 0
    segments_reclaimed: int = 0
    invalidations: int = 0
    acked_puts: int = 0
    owed_checked: int = 0
    not_durable: int = 0

    def add(self, exp: Expectation) -> None:
        self.evictions += exp.evictions
        self.compaction_bytes += exp.compaction_bytes
        self.segments_reclaimed += exp.segments_reclaimed
        self.invalidations += exp.invalidations
        self.acked_puts += len(exp.acked)
        self.not_durable += exp.not_durable


def run_crash_loop(tmp: Path, shape: str, kills: int, seed: int, fresh_every: int = 0) -> LoopStats:
    """Kill ``kills`` children, verifying after each; a new store every ``fresh_every``."""
    rng = random.Random(seed)
    logs = tmp / "logs"
    logs.mkdir()
    stats = LoopStats()
    exp = Expectation(seed, shape)
    store = tmp / "store-0"
    for i in range(kills):
        if fresh_every and i and i % fresh_every == 0:
            stats.add(exp)
            exp = Expectation(seed + i, shape)
            store = tmp / f"store-{i}"
        kill_round(store, logs / f"round-{i:04d}.log", exp, rng)
        stats.kills += 1
        stats.owed_checked += len(exp.owed)
        verify_after_kill(store, exp)
    stats.add(exp)
    return stats


def test_crash_churn_eviction_invalidation(tmp_path: Path) -> None:
    """Kills under eviction, compaction and namespace invalidation serve no wrong byte
    and lose nothing acknowledged that the store did not drop by itself."""
    stats = run_crash_loop(tmp_path, "churn", kills=3, seed=20240611)
    assert stats.kills == 3
    assert stats.evictions > 0, "the churn workload never evicted: it tests nothing"
    assert stats.owed_checked > 0, "no acknowledged chunk was checked after a kill"


def test_crash_durable_nothing_acknowledged_lost(tmp_path: Path) -> None:
    """Without eviction or invalidation every acknowledged prompt survives each kill."""
    stats = run_crash_loop(tmp_path, "durable", kills=3, seed=99)
    assert stats.kills == 3
    assert stats.acked_puts > 0, "no put was acknowledged before the kills: nothing checked"


@pytest.mark.slow
def test_crash_churn_many_kills(tmp_path: Path) -> None:
    stats = run_crash_loop(tmp_path, "churn", kills=120, seed=7, fresh_every=40)
    assert stats.kills == 120
    assert stats.evictions > 0 and stats.compaction_bytes > 0 and stats.invalidations > 0


@pytest.mark.slow
def test_crash_durable_many_kills(tmp_path: Path) -> None:
    stats = run_crash_loop(tmp_path, "durable", kills=100, seed=8, fresh_every=10)
    assert stats.kills == 100
    assert stats.acked_puts > 0


def test_write_through_put_is_durable_for_chunks_already_in_dram(tmp_path: Path) -> None:
    """With write_through, a put that returns has made every chunk of its prompt durable,
    including chunks that were already indexed but held in DRAM only (their disk
    replica evicted). ``close(flush=False)`` stands in for a crash."""
    path = tmp_path / "store"

    def open_store() -> KVStore:
        return KVStore.open(
            path,
            dram_bytes=256 * LAYOUT.chunk_nbytes,  # DRAM outlives the small disk
            disk_bytes=128 * 1024,
            segment_bytes=32 * 1024,
            write_through=True,
        )

    store = open_store()
    prompts = [make_prompt(3, i) for i in range(12)]
    first = prompts[0]
    try:
        for p in prompts:
            put(store, p)
        assert store.counters.tier("disk").evictions > 0
        on_disk = set(disk_of(store).replica_keys())
        assert not any(k in on_disk for k in first.keys), "precondition: evicted from disk"
        res = put(store, first)  # acknowledged: write-through promises durability
        assert res.stored + res.already_present == len(first.keys)
    finally:
        store.close(flush=False)
    store = open_store()
    try:
        got = load_prompt(store, first)
        loaded, want = got.loaded, len(first.keys)
        assert loaded == want, f"acknowledged write-through put lost {want - loaded} chunks"
        assert_served_correctly(got, first.keys)
    finally:
        store.close()

"""Faults through the seams: ENOSPC and EIO from the file layer, a locked, newer or
unwritable store.

I/O faults are injected by :class:`kvlife.faults.fileio.FaultyIO` (a
:class:`~kvlife.tiers.disk.fileio.FileIO` subclass) passed to
``KVStore.open(..., fileio=...)``: a failed put raises a typed error and leaves nothing
of itself visible (now or after reopen), what was stored before still loads, and the
store works again once the fault clears. A failed read is a miss, never success with
bad bytes.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvlife.core.errors import (
    KVLifeError,
    StorageFullError,
    StoreFormatError,
    StoreLockedError,
    StorePathError,
)
from kvlife.core.identity import ChunkKey, prompt_chunk_keys
from kvlife.faults.fileio import FaultyIO
from kvlife.store import KVStore
from kvlife.tiers.disk.fileio import FileIO
from tests.helpers.workload import (
    IDENTITY,
    LAYOUT,
    USERS,
    ChunkRef,
    KiB,
    MiB,
    Prompt,
    assert_served_correctly,
    chunk_refs,
    disk_of,
    load_chunk,
    load_prompt,
    make_prompt,
    put,
)

SEED = 31337


@dataclass(frozen=True, slots=True)
class Config:
    """How the store under test is built."""

    dram_bytes: int
    write_through: bool

    def open(self, path: Path, fileio: FileIO | None = None) -> KVStore:
        return KVStore.open(
            path,
            dram_bytes=self.dram_bytes,
            disk_bytes=64 * MiB,
            segment_bytes=256 * KiB,
            write_through=self.write_through,
            fileio=fileio,
        )


DISK_ONLY = Config(dram_bytes=0, write_through=False)
CONFIGS = {
    "disk-only": DISK_ONLY,
    # Every put is made durable before it returns, so a disk fault fails the put.
    "dram-write-through": Config(dram_bytes=64 * LAYOUT.chunk_nbytes, write_through=True),
}


def visible_chunks(store: KVStore, prompt: Prompt) -> int:
    return len(store.lookup(IDENTITY, prompt.namespace, prompt.tokens).hits)


def assert_loads_in_full(store: KVStore, prompts: list[Prompt]) -> None:
    for prompt in prompts:
        got = load_prompt(store, prompt)
        loaded, want = got.loaded, len(prompt.keys)
        assert loaded == want, f"prompt {prompt.number}: {loaded} of {want} chunks loaded"
        assert_served_correctly(got, prompt.keys)


def fresh_prompt(number: int) -> Prompt:
    """A prompt sharing no chunk with the stored ones (another seed, a 4-chunk body)."""
    for n in range(number, number + 1000):
        p = make_prompt(SEED + 1, n)
        if len(p.keys) >= 4:
            return p
    raise AssertionError("no prompt with four chunks")


WRITE_FAULTS = [
    pytest.param("pwritev", errno.ENOSPC, 0, StorageFullError, id="pwritev-ENOSPC"),
    pytest.param("pwritev", errno.ENOSPC, 2, StorageFullError, id="pwritev-ENOSPC-mid-batch"),
    pytest.param("fdatasync", errno.ENOSPC, 0, StorageFullError, id="fdatasync-ENOSPC"),
    pytest.param("pwritev", errno.EIO, 0, StorePathError, id="pwritev-EIO"),
    pytest.param("pwritev", errno.EIO, 3, StorePathError, id="pwritev-EIO-mid-batch"),
    pytest.param("fdatasync", errno.EIO, 0, StorePathError, id="fdatasync-EIO"),
]


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
@pytest.mark.parametrize(("op", "err", "after", "expected"), WRITE_FAULTS)
def test_write_fault_fails_the_put_and_leaves_nothing_of_it(
    tmp_path: Path,
    config_name: str,
    op: str,
    err: int,
    after: int,
    expected: type[KVLifeError],
) -> None:
    config = CONFIGS[config_name]
    io = FaultyIO()
    old = [make_prompt(SEED, i) for i in range(6)]
    new = fresh_prompt(0)
    store = config.open(tmp_path, io)
    try:
        for p in old:
            put(store, p)
        io.arm(op, err, after)
        with pytest.raises(expected) as raised:
            put(store, new)
        assert io.injected.get(op, 0) >= 1, "the fault never fired"
        message = str(raised.value)
        assert str(tmp_path) in message, f"error does not name the store path: {message}"
        if err == errno.ENOSPC:
            assert "ENOSPC" in message or "full" in message, message
        io.disarm()
        assert visible_chunks(store, new) == 0, "chunks of the failed put are visible"
        assert_loads_in_full(store, old)
    finally:
        io.disarm()
        store.close()
    store = config.open(tmp_path, FaultyIO())
    try:
        assert visible_chunks(store, new) == 0, "chunks of the failed put are visible after reopen"
        assert_loads_in_full(store, old)
        assert disk_of(store).check().clean
        res = put(store, new)
        assert res.stored == len(new.keys)
        assert_loads_in_full(store, [*old, new])
    finally:
        store.close()


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
def test_store_accepts_puts_again_once_the_fault_clears(tmp_path: Path, config_name: str) -> None:
    io = FaultyIO()
    first, second = fresh_prompt(0), fresh_prompt(100)
    store = CONFIGS[config_name].open(tmp_path, io)
    try:
        io.arm("pwritev", errno.ENOSPC)
        with pytest.raises(StorageFullError):
            put(store, first)
        with pytest.raises(StorageFullError):  # still full: still refused
            put(store, second)
        io.disarm()
        for p in (first, second):
            res = put(store, p)
            assert res.stored + res.already_present == len(p.keys)
        assert_loads_in_full(store, [first, second])
        assert disk_of(store).check().clean
    finally:
        # No flush on close: what a put acknowledged must already be on disk.
        store.close(flush=not CONFIGS[config_name].write_through)
    store = CONFIGS[config_name].open(tmp_path)
    try:
        assert_loads_in_full(store, [first, second])
    finally:
        store.close()


@pytest.mark.parametrize(
    ("op", "err", "expected"),
    [
        pytest.param("pwritev", errno.ENOSPC, StorageFullError, id="pwritev-ENOSPC"),
        pytest.param("fdatasync", errno.EIO, StorePathError, id="fdatasync-EIO"),
    ],
)
def test_write_fault_during_compaction_is_typed_and_harmless(
    tmp_path: Path, op: str, err: int, expected: type[KVLifeError]
) -> None:
    """A put that needs room makes the disk tier compact first; a fault while compaction
    copies frames fails the put with the same typed error as any write fault."""
    io = FaultyIO()
    store = KVStore.open(
        tmp_path, dram_bytes=0, disk_bytes=512 * KiB, segment_bytes=64 * KiB, fileio=io
    )
    refs: dict[ChunkKey, ChunkRef] = {}
    try:
        disk = disk_of(store)
        assert disk is not None
        for n in range(400):
            if n % 5 == 0:  # deleted frames leave garbage that compaction must reclaim
                store.invalidate(namespace=USERS[n % len(USERS)])
            prompt = make_prompt(SEED, n)
            before = set(store.indexed_keys())
            compacted = disk.stats.compaction_bytes_read
            # Every put is first tried with the fault armed; it fails, and changes
            # nothing, until one of them has to compact.
            io.arm(op, err)
            try:
                with pytest.raises(expected):
                    put(store, prompt)
            finally:
                io.disarm()
            assert set(store.indexed_keys()) == before, "a failed put changed the index"
            if disk.stats.compaction_bytes_read > compacted:
                break
            put(store, prompt)
            refs.update((r.key, r) for r in chunk_refs(prompt))
        else:
            raise AssertionError("the workload never made the disk tier compact")
        assert_indexed_load_correctly(store, refs)
        assert disk.check().clean
        put(store, prompt)
        refs.update((r.key, r) for r in chunk_refs(prompt))
        assert_loads_in_full(store, [prompt])
    finally:
        store.close()
    store = KVStore.open(tmp_path, dram_bytes=0, disk_bytes=512 * KiB, segment_bytes=64 * KiB)
    try:
        assert store.counters.recovery_dropped == 0
        assert_indexed_load_correctly(store, refs)
        assert prompt.keys[-1] in store.indexed_keys()
    finally:
        store.close()


def assert_indexed_load_correctly(store: KVStore, refs: dict[ChunkKey, ChunkRef]) -> None:
    for key in store.indexed_keys():
        got = load_chunk(store, refs[key])
        assert got.loaded == 1, f"indexed chunk {key.hex()[:16]} did not load"
        assert_served_correctly(got, [key])


@pytest.mark.parametrize("after", [0, 1], ids=["first-chunk", "second-chunk"])
def test_read_fault_is_a_miss_never_bad_bytes(tmp_path: Path, after: int) -> None:
    io = FaultyIO()
    prompt = fresh_prompt(0)
    others = [make_prompt(SEED, i) for i in range(4)]
    store = DISK_ONLY.open(tmp_path, io)
    try:
        for p in [prompt, *others]:
            put(store, p)
        io.arm("preadv", errno.EIO, after)
        got = load_prompt(store, prompt)
        assert io.injected.get("preadv", 0) >= 1, "the fault never fired"
        assert got.loaded == after, "chunks after a failed read must be misses"
        assert not got.complete
        assert_served_correctly(got, prompt.keys)
        # An I/O error is a miss, not proof of corruption: the replica is kept.
        assert got.corrupt == [] and got.read_errors == 1
        assert store.counters.read_errors == 1 and store.counters.corrupt == 0
        io.disarm()
        again = load_prompt(store, prompt)
        assert again.complete, "the replica that failed to read once was dropped"
        assert_served_correctly(again, prompt.keys)
        assert_loads_in_full(store, others)
    finally:
        io.disarm()
        store.close()


# ------------------------------------------------------------------ locking

HOLDER = textwrap.dedent(
    """
    import sys
    from kvlife.store import KVStore
    store = KVStore.open(sys.argv[1], dram_bytes=0, disk_bytes=8 << 20, segment_bytes=1 << 20)
    print("open", flush=True)
    sys.stdin.readline()
    store.close()
    print("closed", flush=True)
    """
)


def start_holder(path: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "open":
        proc.kill()
        proc.wait()
        raise AssertionError(f"holder process failed to open the store (said {line!r})")
    return proc


def test_second_process_gets_store_locked_until_the_first_closes(tmp_path: Path) -> None:
    holder = start_holder(tmp_path)
    try:
        with pytest.raises(StoreLockedError) as raised:
            DISK_ONLY.open(tmp_path)
        assert str(holder.pid) in str(raised.value), "the error should name the holder's pid"
        assert str(tmp_path) in str(raised.value)
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "closed"
        assert holder.wait(timeout=30) == 0
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    store = DISK_ONLY.open(tmp_path)
    try:
        prompt = make_prompt(SEED, 0)
        put(store, prompt)
        assert_loads_in_full(store, [prompt])
    finally:
        store.close()


def test_lock_of_a_killed_holder_is_released(tmp_path: Path) -> None:
    holder = start_holder(tmp_path)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=30)
    store = DISK_ONLY.open(tmp_path)
    store.close()


def test_second_open_in_the_same_process_is_refused(tmp_path: Path) -> None:
    store = DISK_ONLY.open(tmp_path)
    try:
        with pytest.raises(StoreLockedError):
            DISK_ONLY.open(tmp_path)
        prompt = make_prompt(SEED, 0)
        put(store, prompt)  # the refused open did not disturb the holder
        assert_loads_in_full(store, [prompt])
    finally:
        store.close()


# ------------------------------------------------------------------ format and path


def snapshot(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path`` except the lock file (rewritten on open)."""
    out: dict[str, str] = {}
    for f in sorted(path.rglob("*")):
        if f.is_file() and f.name != "LOCK":
            out[str(f.relative_to(path))] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def set_catalog_version(path: Path, version: int) -> None:
    db = sqlite3.connect(path / "disk" / "catalog.sqlite")
    try:
        with db:
            db.execute("UPDATE meta SET v = ? WHERE k = 'catalog_version'", (str(version),))
        assert db.total_changes == 1
    finally:
        db.close()


def test_newer_catalog_version_is_refused_and_left_unchanged(tmp_path: Path) -> None:
    prompts = [make_prompt(SEED, i) for i in range(5)]
    store = DISK_ONLY.open(tmp_path)
    for p in prompts:
        put(store, p)
    store.close()
    set_catalog_version(tmp_path, 99)
    before = snapshot(tmp_path)
    with pytest.raises(StoreFormatError) as raised:
        DISK_ONLY.open(tmp_path)
    message = str(raised.value)
    assert "99" in message and "catalog.sqlite" in message, message
    assert snapshot(tmp_path) == before, "a refused open changed the store's files"
    # Nothing was lost: with the version restored the data is all there.
    set_catalog_version(tmp_path, 1)
    store = DISK_ONLY.open(tmp_path)
    try:
        assert_loads_in_full(store, prompts)
    finally:
        store.close()


def test_path_under_a_regular_file_is_a_store_path_error(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    for path in (blocker / "store", blocker):
        with pytest.raises(StorePathError) as raised:
            DISK_ONLY.open(path)
        assert str(blocker) in str(raised.value)
    assert blocker.read_text() == "x"


# ------------------------------------------------------------------ budget full


def test_full_disk_budget_evicts_only_what_the_put_needs(tmp_path: Path) -> None:
    """A disk budget that is exactly full makes room for a one-chunk put by evicting one
    chunk, not several (the shortfall and the freed bytes must be counted alike)."""
    frames = 16
    store = KVStore.open(
        tmp_path, dram_bytes=0, disk_bytes=frames * 8 * KiB, segment_bytes=64 * KiB
    )
    try:
        ns = USERS[0]
        one_chunk: list[Prompt] = []
        for i in range(frames + 1):
            tokens = np.random.default_rng([SEED, i]).integers(
                0, 1 << 15, size=LAYOUT.tokens_per_chunk, dtype=np.uint32
            )
            keys = tuple(prompt_chunk_keys(IDENTITY, ns, tokens))
            one_chunk.append(Prompt(i, ns, tokens, keys))
        assert len({p.keys[0] for p in one_chunk}) == frames + 1
        for p in one_chunk[:frames]:
            assert put(store, p).stored == 1
        assert store.counters.tier("disk").evictions == 0, (
            "precondition: the budget holds 16 frames"
        )
        assert put(store, one_chunk[frames]).stored == 1
        assert store.counters.tier("disk").evictions == 1, (
            f"one chunk of room cost {store.counters.tier('disk').evictions} evictions"
        )
        assert len(store.indexed_keys()) == frames
    finally:
        store.close()


# ------------------------------------------------------------------ found by the power-cut tests


def test_unlink_fault_while_invalidating_is_typed(tmp_path: Path) -> None:
    io = FaultyIO()
    store = KVStore.open(
        tmp_path, dram_bytes=0, disk_bytes=64 * MiB, segment_bytes=64 * KiB, fileio=io
    )
    try:
        ns = USERS[0]
        for i in range(12):  # about 40 frames: several sealed segments of this namespace only
            put(store, make_prompt(SEED, i, namespace=ns))
        io.arm("unlink", errno.EIO)
        # A typed refusal is fine; an untyped OSError is the bug.
        with contextlib.suppress(KVLifeError):
            store.invalidate(namespace=ns)
        assert io.injected.get("unlink", 0) >= 1, "no segment was reclaimed"
    finally:
        io.disarm()
        store.close()


def test_close_releases_the_lock_when_the_disk_fails(tmp_path: Path) -> None:
    io = FaultyIO()
    store = DISK_ONLY.open(tmp_path, io)
    io.arm("unlink", errno.EIO)  # close unlinks the empty active segment
    with contextlib.suppress(OSError):
        store.close()
    assert io.injected.get("unlink", 0) >= 1
    DISK_ONLY.open(tmp_path).close()  # the lock must be free again


def test_write_through_put_never_evicts_its_own_present_chunks(tmp_path: Path) -> None:
    """A shared prefix held on disk only (DRAM has moved on) is present for the second
    prompt; making disk room for that prompt's new chunks must not evict the prefix,
    or the put returns with its whole prompt unreachable."""
    store = KVStore.open(
        tmp_path,
        dram_bytes=2 * LAYOUT.chunk_nbytes,
        disk_bytes=8 * 8 * KiB,  # 8 frames, one per segment: eviction frees at once
        segment_bytes=8 * KiB,
        write_through=True,
    )
    try:
        ns = USERS[0]
        rng = np.random.default_rng(SEED)

        def prompt(number: int, chunks: int, prefix: np.ndarray | None = None) -> Prompt:
            own = rng.integers(0, 1 << 15, size=chunks * LAYOUT.tokens_per_chunk, dtype=np.uint32)
            tokens = own if prefix is None else np.concatenate([prefix, own])
            return Prompt(number, ns, tokens, tuple(prompt_chunk_keys(IDENTITY, ns, tokens)))

        first = prompt(0, 3)
        put(store, first)
        for i in range(5):  # fill the disk; DRAM keeps only the last two
            put(store, prompt(1 + i, 1))
        second = prompt(9, 2, prefix=first.tokens[: 2 * LAYOUT.tokens_per_chunk])
        res = put(store, second)
        assert res.already_present == 2 and res.stored == 2
        assert visible_chunks(store, second) == len(second.keys), "the put evicted its own prefix"
        assert_loads_in_full(store, [second])
    finally:
        store.close()


def test_lookup_completes_while_another_thread_is_stalled_in_a_disk_read(
    tmp_path: Path,
) -> None:
    io = FaultyIO()
    store = DISK_ONLY.open(tmp_path, io)
    try:
        stalled, other = fresh_prompt(0), fresh_prompt(100)
        put(store, stalled)
        put(store, other)
        stall = io.stall("preadv", timeout_s=60.0)
        loader = threading.Thread(target=load_prompt, args=(store, stalled))
        loader.start()
        assert stall.wait_entered(10.0), "the load never read from disk"
        hits: list[int] = []
        looker = threading.Thread(target=lambda: hits.append(visible_chunks(store, other)))
        looker.start()
        looker.join(2.0)
        finished = not looker.is_alive()
        stall.release()
        loader.join(30.0)
        looker.join(30.0)
        assert finished, "a lookup waited behind another thread's stalled disk read"
        assert hits == [len(other.keys)]
    finally:
        io.disarm()
        store.close()

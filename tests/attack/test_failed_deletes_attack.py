"""Attacks on the kept deletes of kvlife/store/deletes.py (``delete_or_keep`` and the
close's ``retry_kept``): the physical delete of replicas already out of service fails
(the disk tier's catalog write raises), the replicas are counted in ``deletes_failed``
and kept, and the close deletes each once, unless a record names its key with a
replica in that tier (written after it, under the same key).

Each test uses a real store on real files (``KVStore.open`` in ``tmp_path``) and only
injects the failure into the disk tier's ``delete_forgetting``. They attack: a key put
again after its failed delete (held only in DRAM, flushed, invalidated again, demoted),
the same key failing twice, a close whose retry raises something untyped, both flavours
of close, a crash before the close, a background delete failing, the disk room the kept
frames hold, a delete that fails after it committed, and threads invalidating and
putting while deletes fail; and they check that nothing but the put's exact bytes is
ever served (in this process and after a reopen) and that the counter counts only the
replicas that really stayed.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

from kvlife.core.errors import KVLifeError, StorageFullError, StorePathError
from kvlife.core.identity import PUBLIC, ChunkKey, ModelIdentity, Namespace, NamespaceKind
from kvlife.faults.damage import flip, scan_frames
from kvlife.faults.fileio import FaultyIO
from kvlife.store import KVStore
from kvlife.tiers.disk.frame import HEADER_BYTES
from tests.conftest import TINY, prompt_kv
from tests.helpers.failing_deletes import fail_deletes
from tests.helpers.store_threads import (
    Call,
    assert_loads_exactly,
    chunk_of,
    open_small,
    wait_until,
)
from tests.helpers.workload import disk_of

N = TINY.tokens_per_chunk
CHUNKS = 4
REPO = Path(__file__).resolve().parents[2]


def _other(kv: np.ndarray) -> np.ndarray:
    """Other KV bytes for the same tokens (a second put of the prompt, another run)."""
    return (kv + np.float16(1.0)).astype(np.float16)


def _never_serves(
    store: KVStore, identity: ModelIdentity, tokens: np.ndarray, kv: np.ndarray
) -> None:
    """No chunk the store serves for ``tokens`` has ``kv``'s bytes."""
    got = store.get(identity, PUBLIC, tokens)
    for i, arr in enumerate(got.arrays):
        assert not np.array_equal(arr, chunk_of(kv, i)), f"chunk {i}: served invalidated KV"


def _put_flushed(
    store: KVStore, identity: ModelIdentity, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    tokens, kv = prompt_kv(seed, CHUNKS * N)
    assert store.put_prompt(identity, PUBLIC, tokens, kv).stored == CHUNKS
    store.flush()
    return tokens, kv


# ------------------------------------- breaches found 2026-12-07, mended the same day


def test_a_key_whose_delete_fails_twice_is_deleted_by_the_close_without_an_error(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    store = open_small(tmp_path / "s")
    tokens, kv = _put_flushed(store, identity, 1)
    failed = fail_deletes(store, 2)
    with pytest.raises(StorePathError):
        store.invalidate(namespace=PUBLIC)
    # put again (a new frame replaces the kept one's row), invalidated again: fails again
    assert store.put_prompt(identity, PUBLIC, tokens, kv).stored == CHUNKS
    store.flush()
    with pytest.raises(StorePathError):
        store.invalidate(namespace=PUBLIC)
    assert failed == [CHUNKS, CHUNKS]
    assert store.counters.as_dict()["deletes_failed"] == 2 * CHUNKS
    try:
        store.close()  # the retry succeeds now: it must delete them, raising nothing
    except BaseException as exc:
        pytest.fail(f"close raised {type(exc).__name__}: {exc!r}")
    with open_small(tmp_path / "s") as again:
        assert again.lookup(identity, PUBLIC, tokens).tokens == 0


def test_a_reput_held_only_in_dram_never_brings_back_the_invalidated_bytes(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    store = open_small(tmp_path / "s")
    tokens, old = _put_flushed(store, identity, 2)
    fail_deletes(store, 1)
    with pytest.raises(StorePathError, match="The close retries"):
        store.invalidate(namespace=PUBLIC)
    new = _other(old)
    assert store.put_prompt(identity, PUBLIC, tokens, new).stored == CHUNKS
    assert_loads_exactly(store, identity, tokens, new, CHUNKS)  # in process: right
    store.close(flush=False)  # the re-put is volatile; the close "retries" the delete
    with open_small(tmp_path / "s") as again:
        _never_serves(again, identity, tokens, old)


# ---------------------------------------------------------------------------- held


def test_a_reput_invalidated_again_before_the_close_is_gone_at_the_next_open(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """The re-put (DRAM only) is invalidated again with a working delete: that delete
    finds only its DRAM replica; the old frame is still kept, and now no record names
    its key, so the close deletes it."""
    store = open_small(tmp_path / "s")
    tokens, old = _put_flushed(store, identity, 3)
    keys = [h.key for h in store.lookup(identity, PUBLIC, tokens).hits]
    fail_deletes(store, 1)
    with pytest.raises(StorePathError):
        store.invalidate(namespace=PUBLIC)
    assert store.put_prompt(identity, PUBLIC, tokens, _other(old)).stored == CHUNKS
    assert store.invalidate(namespace=PUBLIC) == CHUNKS
    assert store.lookup(identity, PUBLIC, tokens).tokens == 0
    assert all(disk_of(store).contains(k) for k in keys)  # the kept frames, still
    store.close(flush=False)
    with open_small(tmp_path / "s") as again:
        assert again.lookup(identity, PUBLIC, tokens).tokens == 0


@pytest.mark.parametrize("flush", [True, False])
def test_a_reput_flushed_beside_the_kept_frame_is_served_exact_here_and_after_reopen(
    tmp_path: Path, identity: ModelIdentity, flush: bool
) -> None:
    """The re-put's frame replaces the kept frame's row: from DRAM, from disk after the
    DRAM replicas are evicted, and after the close (either flavour) and a reopen, the
    re-put's bytes, never the invalidated ones."""
    store = open_small(tmp_path / "s")
    tokens, old = _put_flushed(store, identity, 4)
    fail_deletes(store, 1)
    with pytest.raises(StorePathError):
        store.invalidate(namespace=PUBLIC)
    new = _other(old)
    assert store.put_prompt(identity, PUBLIC, tokens, new).stored == CHUNKS
    assert_loads_exactly(store, identity, tokens, new, CHUNKS)
    store.flush()
    store.evict("dram", 1 << 40)
    assert_loads_exactly(store, identity, tokens, new, CHUNKS)  # from disk now
    store.close(flush=flush)
    with open_small(tmp_path / "s") as again:
        assert_loads_exactly(again, identity, tokens, new, CHUNKS)


def test_a_reput_demoted_to_disk_by_eviction_is_served_exact(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """No flush: the DRAM eviction demotes the re-put onto the disk that still holds
    the kept frames of the same keys."""
    store = open_small(tmp_path / "s")
    tokens, old = _put_flushed(store, identity, 5)
    fail_deletes(store, 1)
    with pytest.raises(StorePathError):
        store.invalidate(namespace=PUBLIC)
    new = _other(old)
    assert store.put_prompt(identity, PUBLIC, tokens, new).stored == CHUNKS
    store.evict("dram", 1 << 40)
    assert_loads_exactly(store, identity, tokens, new, CHUNKS)
    store.close(flush=False)
    with open_small(tmp_path / "s") as again:
        assert_loads_exactly(again, identity, tokens, new, CHUNKS)


@pytest.mark.parametrize("flush", [True, False])
def test_either_close_deletes_the_kept_replicas(
    tmp_path: Path, identity: ModelIdentity, flush: bool
) -> None:
    store = open_small(tmp_path / "s")
    tokens, _kv = _put_flushed(store, identity, 6)
    other, other_kv = prompt_kv(60, CHUNKS * N)
    ns = Namespace(NamespaceKind.USER, "keep")
    assert store.put_prompt(identity, ns, other, other_kv).stored == CHUNKS
    store.flush()
    fail_deletes(store, 1)
    with pytest.raises(StorePathError):
        store.invalidate(namespace=PUBLIC)
    assert store.counters.as_dict()["deletes_failed"] == CHUNKS
    store.close(flush=flush)
    with open_small(tmp_path / "s") as again:
        assert again.lookup(identity, PUBLIC, tokens).tokens == 0
        got = again.get(identity, ns, other)
        assert got.loaded == CHUNKS
        for i, arr in enumerate(got.arrays):
            assert np.array_equal(arr, chunk_of(other_kv, i))


def test_a_retry_at_close_raising_an_untyped_error_still_releases_the_store(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """The close's retry raises RuntimeError (a bug under the disk tier): the close
    raises it, but only after every tier is closed and the directory lock dropped; the
    next open finds the kept frames again, with their own bytes."""
    store = open_small(tmp_path / "s")
    tokens, kv = _put_flushed(store, identity, 7)
    failed = fail_deletes(store, 1)
    with pytest.raises(StorePathError):
        store.invalidate(namespace=PUBLIC)
    fail_deletes(store, 1, exc=RuntimeError("bug in the catalog (injected)"))
    with pytest.raises(RuntimeError, match="injected"):
        store.close()
    assert failed == [CHUNKS]
    with open_small(tmp_path / "s") as again:  # the lock was dropped
        assert again.lookup(identity, PUBLIC, tokens).tokens == CHUNKS * N
        assert_loads_exactly(again, identity, tokens, kv, CHUNKS)


def test_a_delete_failing_after_its_commit_counts_nothing_kept(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """The catalog delete commits, then the call raises: the replicas are gone, so
    ``deletes_failed`` must not count them and the close has nothing to retry."""
    store = open_small(tmp_path / "s")
    tokens, _kv = _put_flushed(store, identity, 8)
    disk = disk_of(store)
    real = disk.delete_forgetting

    def delete(keys: Sequence[ChunkKey], forget: Sequence[bytes]) -> list[int]:
        real(keys, forget)
        raise OSError(errno.EIO, "reported after the commit (injected)")

    disk.delete_forgetting = delete  # type: ignore[method-assign]
    with pytest.raises(StorePathError):
        store.invalidate(namespace=PUBLIC)
    assert store.counters.as_dict()["deletes_failed"] == 0
    store.close()
    with open_small(tmp_path / "s") as again:
        assert again.lookup(identity, PUBLIC, tokens).tokens == 0


def test_the_kept_frames_hold_disk_room_until_the_close_which_fails_typed(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """A full disk: the kept frames hold its room, so a later prompt's flush (and the
    close's flush, which runs before the retry frees that room) raise a typed
    StorageFullError; nothing served is ever other bytes, and the next open serves
    neither prompt (the first deleted, the second never durable)."""
    disk_room = CHUNKS * 8192
    store = open_small(tmp_path / "s", disk_bytes=disk_room)
    tokens, _kv = _put_flushed(store, identity, 9)
    fail_deletes(store, 1)
    with pytest.raises(StorePathError):
        store.invalidate(namespace=PUBLIC)
    t2, kv2 = prompt_kv(90, CHUNKS * N)
    assert store.put_prompt(identity, PUBLIC, t2, kv2).stored == CHUNKS
    with pytest.raises(StorageFullError):
        store.flush()
    assert_loads_exactly(store, identity, t2, kv2, CHUNKS)
    with pytest.raises(StorageFullError):
        store.close()
    with open_small(tmp_path / "s", disk_bytes=disk_room) as again:
        assert again.lookup(identity, PUBLIC, tokens).tokens == 0
        assert again.lookup(identity, PUBLIC, t2).tokens == 0


def test_a_background_delete_failing_then_the_key_put_again_keeps_the_new_frame(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """A damaged frame found by a load: its delete (background thread) fails and is
    kept; the prompt is put again with other bytes and flushed: the close must not
    delete the new frame, and the next open serves the new bytes, all of them."""
    store = open_small(tmp_path / "s")
    tokens, old = _put_flushed(store, identity, 10)
    store.evict("dram", 1 << 40)
    keys = [h.key for h in store.lookup(identity, PUBLIC, tokens).hits]
    frames = {f.key: f for f in scan_frames(tmp_path / "s")}
    bad = frames[keys[1]]
    flip(bad.segment, bad.offset + HEADER_BYTES + 5, 1)
    failed = fail_deletes(store, 1)
    got = store.get(identity, PUBLIC, tokens)
    assert got.loaded == 1 and got.corrupt
    store.drain()
    store.lookup(identity, PUBLIC, tokens)
    wait_until(lambda: store.counters.as_dict()["deletes_failed"] == 1, what="counted")
    assert failed == [1]
    new = _other(old)
    res = store.put_prompt(identity, PUBLIC, tokens, new)
    assert res.stored + res.already_present == CHUNKS
    store.flush()
    store.close()
    with open_small(tmp_path / "s") as again:
        got = again.get(identity, PUBLIC, tokens)
        assert got.loaded >= 2
        for i, arr in enumerate(got.arrays):  # each chunk one put's exact bytes
            assert np.array_equal(arr, chunk_of(new, i)) or np.array_equal(arr, chunk_of(old, i)), (
                f"chunk {i} served bytes no put wrote"
            )
        assert np.array_equal(got.arrays[1], chunk_of(new, 1)), "the re-put chunk 1"


def test_a_flush_copy_invalidated_mid_write_whose_delete_fails_raises_typed(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    io = FaultyIO()
    store = KVStore.open(
        tmp_path / "s", dram_bytes=1 << 20, disk_bytes=16 << 20, segment_bytes=1 << 20, fileio=io
    )
    tokens, kv = prompt_kv(13, CHUNKS * N)
    assert store.put_prompt(identity, PUBLIC, tokens, kv).stored == CHUNKS
    disk = disk_of(store)
    real = disk.delete_forgetting
    stall = io.stall("pwritev", path="seg-*")
    flush = Call(store.flush)
    try:
        assert stall.wait_entered(), "the flush never reached the disk"
        inv = Call(lambda: store.invalidate(namespace=PUBLIC))  # waits for the flush's turn
        wait_until(lambda: store.lookup(identity, PUBLIC, tokens).tokens == 0, what="retired")
        failed = fail_deletes(store, 2)  # the copy's delete, then the invalidation's
    finally:
        stall.release()
    flush.join()
    inv.join()
    assert failed == [CHUNKS, CHUNKS]
    assert isinstance(inv.error, StorePathError)
    disk.delete_forgetting = real  # type: ignore[method-assign]
    store.close()
    with open_small(tmp_path / "s") as again:
        assert again.lookup(identity, PUBLIC, tokens).tokens == 0
    assert flush.error is None or isinstance(flush.error, KVLifeError), repr(flush.error)


_CHILD = """
import errno, os, sys
import numpy as np
from pathlib import Path
from kvlife.core.identity import PUBLIC
from kvlife.store import KVStore
from tests.conftest import TINY, prompt_kv, tiny_identity
from tests.helpers.failing_deletes import fail_deletes
from tests.helpers.workload import disk_of
N = TINY.tokens_per_chunk
path, mode = Path(sys.argv[1]), sys.argv[2]
ident = tiny_identity()
store = KVStore.open(path, dram_bytes=1 << 20, disk_bytes=16 << 20, segment_bytes=1 << 20)
tokens, kv = prompt_kv(11, {chunks} * N)
store.put_prompt(ident, PUBLIC, tokens, kv)
store.flush()
disk = disk_of(store)
def delete(keys, forget):
    raise OSError(errno.EIO, "catalog write failed (injected)")
disk.delete_forgetting = delete
try:
    store.invalidate(namespace=PUBLIC)
except Exception as exc:
    print(type(exc).__name__)
if mode != "none":
    store.put_prompt(ident, PUBLIC, tokens, (kv + np.float16(1.0)).astype(np.float16))
    if mode == "flushed":
        store.flush()
sys.stdout.flush()
os._exit(0)
"""


@pytest.mark.parametrize("mode", ["none", "flushed"])
def test_a_crash_before_the_close_serves_one_puts_exact_bytes(
    tmp_path: Path, identity: ModelIdentity, mode: str
) -> None:
    """The process dies (os._exit) after the failed delete: the next open finds the
    kept frames again (what the error said), each with its put's bytes; a re-put that
    was flushed before the crash is what the next open serves."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(_CHILD.format(chunks=CHUNKS)))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "s"), mode],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "StorePathError" in out.stdout
    tokens, old = prompt_kv(11, CHUNKS * N)
    want = old if mode == "none" else _other(old)
    with open_small(tmp_path / "s") as again:
        assert_loads_exactly(again, identity, tokens, want, CHUNKS)


def test_threads_invalidating_and_putting_while_deletes_fail(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """Two putters and an invalidator over three namespaces for a while; every other
    disk delete fails (a key at most once: the double failure is the breach above).
    Nothing raises but the typed invalidation error; ``deletes_failed`` counts exactly
    the replicas of the failed deletes; the close raises nothing; every chunk served
    after a reopen is its prompt's exact bytes."""
    users = [Namespace(NamespaceKind.USER, f"u{i}") for i in range(3)]
    prompts = {s: prompt_kv(200 + s, CHUNKS * N) for s in range(6)}
    store = open_small(tmp_path / "s")
    for seed, (tokens, kv) in prompts.items():  # on disk before the threads start
        store.put_prompt(identity, users[seed % 3], tokens, kv)
    store.flush()
    disk = disk_of(store)
    real = disk.delete_forgetting
    guard = threading.Lock()
    failed_keys: set[bytes] = set()
    failed_count = [0]
    calls = [0]

    def delete(keys: Sequence[ChunkKey], forget: Sequence[bytes]) -> list[int]:
        with guard:
            calls[0] += 1
            fail = (calls[0] % 2 == 1 or not failed_keys) and not failed_keys.intersection(keys)
            if fail:
                failed_keys.update(keys)
                failed_count[0] += len(keys)
        if fail:
            raise OSError(errno.EIO, "catalog write failed (injected)")
        return real(keys, forget)

    disk.delete_forgetting = delete  # type: ignore[method-assign]
    stop = threading.Event()
    errors: list[BaseException] = []

    def guarded(body: Callable[[int], None]) -> Callable[[], None]:
        def run() -> None:
            i = 0
            while not stop.is_set():
                try:
                    body(i)
                except StorePathError:
                    pass
                except BaseException as exc:  # anything else is a finding
                    errors.append(exc)
                    return
                i += 1

        return run

    def putter(offset: int) -> Callable[[int], None]:
        def body(i: int) -> None:
            seed = (i + offset) % len(prompts)
            tokens, kv = prompts[seed]
            store.put_prompt(identity, users[seed % 3], tokens, kv)
            if i % 3 == 0:
                store.flush()  # a flush copy's own failed delete is kept, not raised

        return body

    def invalidator(i: int) -> None:
        store.invalidate(namespace=users[i % 3])

    threads = [
        threading.Thread(target=guarded(putter(0))),
        threading.Thread(target=guarded(putter(3))),
        threading.Thread(target=guarded(invalidator)),
    ]
    for t in threads:
        t.start()
    stop.wait(2.0)
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert failed_count[0] > 0, "no delete failed"
    # every failed delete was a kept one (a flush copy's own too, since 2026-12-07)
    assert store.counters.as_dict()["deletes_failed"] == failed_count[0]
    disk.delete_forgetting = real  # type: ignore[method-assign]
    store.flush()
    store.close()
    with open_small(tmp_path / "s") as again:
        for seed, (tokens, kv) in prompts.items():
            got = again.get(identity, users[seed % 3], tokens)
            for i, arr in enumerate(got.arrays):
                assert np.array_equal(arr, chunk_of(kv, i)), f"prompt {seed} chunk {i}"


def test_a_failed_invalidation_holds_in_process_for_every_read(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """Until the close, neither lookup, get, load after DRAM eviction, nor an audit
    brings the kept frames back into service."""
    store = open_small(tmp_path / "s")
    tokens, _kv = _put_flushed(store, identity, 12)
    fail_deletes(store, 1)
    with pytest.raises(StorePathError):
        store.invalidate(prefix=store.lookup(identity, PUBLIC, tokens).hits[0].key)
    store.evict("dram", 1 << 40)
    assert store.lookup(identity, PUBLIC, tokens).tokens == 0
    assert store.get(identity, PUBLIC, tokens).loaded == 0
    report = store.check()
    assert not report.problems
    assert store.lookup(identity, PUBLIC, tokens).tokens == 0
    try:
        store.close()
    except KVLifeError as exc:  # pragma: no cover - a finding
        pytest.fail(f"close raised {exc!r}")
    with open_small(tmp_path / "s") as again:
        assert again.lookup(identity, PUBLIC, tokens).tokens == 0

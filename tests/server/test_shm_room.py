"""An arena needs its pages on the shared-memory filesystem: one that fits the
filesystem's size but not its free room used to start, and the first write to a page
the filesystem had no room for killed the writer with SIGBUS (a client process writing
a put, exit status 135: the engine, not the server). The server's preflight counts the
free room (and this store's arenas a dead server left, removed before the new one is
made), and an arena's pages are allocated when it is made (StorageFullError, nothing
left) for a filesystem filled between the preflight and the arena.

A principal's arena (``--tenants``) is as large as the whole arena and sparse (made
whole for each principal it would multiply the memory): each extent's pages are
allocated as the server hands it out, and an extent the filesystem has no room for is
no room (StorageFullError, counted in ``arena_unbacked``), never a client's SIGBUS.

These tests mount a small tmpfs of their own (skipped where mounting is not allowed)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from kvlife.core.errors import StorageFullError
from kvlife.server.buffers import SharedBuffer
from kvlife.tiers.shm import Arena, Backed, Owner
from tests.conftest import prompt_kv, tiny_identity
from tests.server.conftest import ROOT, ServerProc, child_env
from tests.server.tenants import TOKENS, USER, as_, write_config

MiB = 1 << 20


@contextlib.contextmanager
def _tmpfs(mnt: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``mnt`` (skipped where mounting is not allowed)."""
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
        capture_output=True,
        check=False,
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def small_shm(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs with 12 MiB of it taken by a file: 4 MiB free."""
    with _tmpfs(tmp_path / "shm", "16m") as mnt:
        with (mnt / "filler").open("wb") as f:
            f.write(bytes(12 * MiB))
        yield mnt


def _fill(mnt: Path) -> None:
    """Take every free byte of the filesystem at ``mnt`` with a file."""
    with (mnt / "filler").open("wb", buffering=0) as f:
        for block in (1 << 16, 1 << 12):
            try:
                while True:
                    f.write(bytes(block))
            except OSError:
                continue


def test_a_server_whose_arena_fits_the_size_but_not_the_room_is_refused_leaving_nothing(
    tmp_path: Path, small_shm: Path
) -> None:
    """An 8 MiB arena (4 MiB DRAM and 4 MiB staging) on a 16 MiB tmpfs with 4 MiB free:
    refused before anything is made. On the code of 69c924e the server started, and
    the first client put died of SIGBUS (checked by hand: exit status 135)."""
    store = tmp_path / "store"
    cmd = [sys.executable, "-m", "kvlife.cli", "serve", str(store)]
    cmd += ["--socket", str(tmp_path / "s.sock"), "--pid-file", str(tmp_path / "s.pid")]
    cmd += ["--dram-bytes", str(4 * MiB), "--staging-bytes", str(4 * MiB)]
    cmd += ["--disk-bytes", str(16 * MiB), "--shm-dir", str(small_shm)]
    log = tmp_path / "serve.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stderr=err)
    deadline = time.monotonic() + 60
    while proc.poll() is None and not (tmp_path / "s.pid").exists():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    if proc.poll() is None:  # it started: the bug
        proc.terminate()
        proc.wait(timeout=60)
    text = log.read_text()
    assert proc.returncode == 1, text
    assert "Traceback" not in text and "free" in text, text
    assert not store.exists() and not (tmp_path / "s.sock").exists()
    assert sorted(p.name for p in small_shm.iterdir()) == ["filler"]


def test_an_arena_the_filesystem_has_no_room_for_is_refused_typed_and_removed(
    small_shm: Path,
) -> None:
    """Made on a filesystem filled after the preflight: StorageFullError, no file left
    (before: a sparse file, whose pages failed only when written, with SIGBUS)."""
    with pytest.raises(StorageFullError, match="arena"):
        Arena(small_shm / "arena", 8 * MiB, owner=None)
    assert sorted(p.name for p in small_shm.iterdir()) == ["filler"]
    arena = Arena(small_shm / "fits", 2 * MiB)  # what fits is made as before
    try:
        assert os.stat(arena.path).st_blocks * 512 >= 2 * MiB  # its pages allocated
    finally:
        arena.unlink()


def test_a_sparse_arena_allocates_each_extents_pages_or_refuses_it_counted(
    small_shm: Path,
) -> None:
    """A principal's arena larger than the room (made sparse, as the server makes them):
    extents are handed out while their pages fit, then None (no room) counted in
    ``arena_unbacked``, the extent free again; nothing is left to fault."""
    arena = Arena(
        small_shm / "t-bob", 8 * MiB, populate_pages=False, owner=Owner(os.geteuid(), os.getegid())
    )
    try:
        views = []
        while (view := arena.alloc(MiB, "u1", (MiB,))) is not None:
            view[:] = 1  # written as a client writes a put: pages there already
            views.append(view)
        assert 2 <= len(views) <= 4
        assert arena.stats()["arena_unbacked"] == 1
        assert arena.extents == len(views)  # the refused extent was given back
        views.clear()
        assert arena.alloc(MiB, "u1", (MiB,)) is not None  # pages allocated before: reused
    finally:
        arena.unlink()


def test_a_batch_of_extents_of_a_sparse_arena_stops_at_the_first_without_room(
    small_shm: Path,
) -> None:
    """``alloc_many`` (a served put's staged extents, issue 28) on a sparse arena larger
    than the room: the extents whose pages fit come back in order with their offsets,
    the first that does not fit is counted in ``arena_unbacked`` and the batch stops
    there, every extent after it given back unseen (only the views handed out hold
    any); a batch made again once they are dropped reuses their pages."""
    arena = Arena(
        small_shm / "t-carol",
        8 * MiB,
        populate_pages=False,
        owner=Owner(os.geteuid(), os.getegid()),
    )
    try:
        made = arena.alloc_many(MiB, "u1", (MiB,), 8)
        assert 2 <= len(made) <= 4
        assert arena.stats()["arena_unbacked"] == 1
        assert arena.extents == len(made)  # the unbacked one and those after it: free
        offsets = [off for _, off in made]
        assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)
        for view, off in made:
            assert arena.offset_of(view) == off
            view[:] = 1  # the pages are there: no fault
        n = len(made)
        made.clear()
        del view  # the loop's last: every view dropped now
        again = arena.alloc_many(MiB, "u1", (MiB,), n)
        assert [off for _, off in again] == offsets
    finally:
        arena.unlink()


def test_a_shared_buffer_the_filesystem_has_no_room_for_is_refused_typed_and_removed(
    small_shm: Path,
) -> None:
    """The server writes loads into a session's shared buffer: its pages are allocated
    when it is made (before: sparse, and the server's first copy into a page the
    filesystem could not back would kill the server with SIGBUS)."""
    with pytest.raises(StorageFullError, match="shared buffer"):
        SharedBuffer.create(small_shm / "arena-buf", 8 * MiB)
    assert sorted(p.name for p in small_shm.iterdir()) == ["filler"]


PUTTER = """
import sys
import numpy as np
from kvlife.client import RemoteStore
from kvlife.core.errors import StorageFullError
from tests.conftest import prompt_kv, tiny_identity
from tests.server.tenants import USER

ident = tiny_identity(model_id="room")
n = ident.layout.tokens_per_chunk
with RemoteStore(sys.argv[1], timeout=30, token=sys.argv[2]) as bob:
    assert bob._wire.connected().arena is not None  # bob maps his own arena
    for seed in range(4):
        tokens, kv = prompt_kv(seed, 16 * n)
        try:
            stored = bob.put_prompt(ident, USER["bob"], tokens, kv).stored
        except StorageFullError as exc:
            print("full", exc, flush=True)
            continue
        got = bob.load(bob.lookup(ident, USER["bob"], tokens))
        for i, a in enumerate(got.arrays):  # what is served is what was put
            assert np.array_equal(a, kv[:, :, :, i * n : (i + 1) * n])
        print("stored", stored, "loaded", got.loaded, flush=True)
"""


def test_a_client_putting_into_its_principals_arena_on_a_full_tmpfs_survives(
    tmp_path: Path,
) -> None:
    """``kvlife serve --tenants`` on a 16 MiB tmpfs whose free room is then taken by a
    file: bob (this Unix user) maps his own arena, sparse, and puts into it. The server
    allocates each extent's pages before handing it out; with no room it is no room
    (the put goes through the socket, or is refused with StorageFullError), counted in
    ``arena_unbacked``: the client process lives. Before the fix the client died of
    SIGBUS on its first write into the arena (exit status -7; checked with the fix
    stashed)."""
    with _tmpfs(tmp_path / "shm", "16m") as mnt:
        config = write_config(tmp_path / "t.toml", bob_uid=os.geteuid())
        srv = ServerProc(
            tmp_path / "store",
            dram=2 * MiB,
            staging=2 * MiB,
            extra=("--tenants", str(config), "--shm-dir", str(mnt)),
        ).start()
        try:
            _fill(mnt)
            done = subprocess.run(
                [sys.executable, "-c", PUTTER, str(srv.socket), TOKENS["bob"]],
                cwd=ROOT,
                env=child_env(),
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
            assert done.stdout.count("\n") == 4, done.stdout
            assert srv.alive()
            with as_(srv, "root") as root:
                assert root.server_state()["arena_unbacked"] >= 1
        finally:
            srv.stop()


def test_a_principals_arena_stays_sparse_its_pages_allocated_as_extents_are_handed_out(
    tmp_path: Path,
) -> None:
    """bob maps his arena (as large as the server's, 8 MiB) and puts a prompt: only the
    extents handed out have pages (before, his client's ``MAP_POPULATE`` of the shared
    mapping allocated every page of the file at his first ``hello``)."""
    with _tmpfs(tmp_path / "shm", "64m") as mnt:
        config = write_config(tmp_path / "t.toml", bob_uid=os.geteuid())
        srv = ServerProc(
            tmp_path / "store",
            dram=4 * MiB,
            staging=4 * MiB,
            extra=("--tenants", str(config), "--shm-dir", str(mnt)),
        ).start()
        try:
            with as_(srv, "bob") as bob:
                ident = tiny_identity(model_id="sparse")
                tokens, kv = prompt_kv(1, 4 * ident.layout.tokens_per_chunk)
                assert bob.put_prompt(ident, USER["bob"], tokens, kv).stored == 4
                (arena,) = mnt.glob("*-t-bob")
                st = arena.stat()
                assert st.st_size == 8 * MiB
                assert st.st_blocks * 512 <= MiB, st.st_blocks * 512
        finally:
            srv.stop()


RANGES = st.lists(st.tuples(st.integers(0, 40), st.integers(0, 8)), max_size=30)


@settings(max_examples=200, deadline=None)
@given(added=RANGES, asked=RANGES)
def test_the_allocated_ranges_of_a_sparse_arena_cover_what_was_added_and_no_more(
    added: list[tuple[int, int]], asked: list[tuple[int, int]]
) -> None:
    """:class:`Backed` against a set of pages: a range is covered exactly when every
    page of it was added (in one range or several touching ones), and the ranges are
    merged (never two that touch)."""
    backed, pages = Backed(), set()
    for lo, n in added:
        backed.add(lo, lo + n + 1)
        pages |= set(range(lo, lo + n + 1))
    for lo, n in asked + added:
        assert backed.covers(lo, lo + n + 1) == pages.issuperset(range(lo, lo + n + 1))
    runs = sum(1 for p in pages if p - 1 not in pages)
    assert len(backed) == runs

"""Disk loads through ``kvlife serve`` are pipelined and stay verified: while one read is
held, the chunks before it are handed out (exact) and nothing after it is, though later
reads run meanwhile; a corrupt chunk in the middle is a counted miss that ends the
load, the chunks before it exact. Both ways a disk load hands its chunks over: grants
(ordinary buffers, each chunk copied here as soon as it verified) and shared buffers
(read there by the server, each chunk told as soon as it verified).

The server is a real ``kvlife serve`` whose disk reads of marked chunks are held or
damaged (:mod:`tests.server.stalled_server`), on every CPU and on one (where the store
reads a load's chunks back to back, each verified on a helper meanwhile)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvlife.client import RemoteStore, replies
from kvlife.core.identity import PUBLIC
from tests.conftest import TINY, prompt_kv, tiny_identity
from tests.server.conftest import ROOT, child_env
from tests.server.stalled_server import CORRUPT_MARK, STALL_MARK, mark

N = TINY.tokens_per_chunk


class StalledServer:
    """The child program of :mod:`tests.server.stalled_server`, stopped by PID."""

    def __init__(self, tmp: Path, one_cpu: bool = False) -> None:
        self.socket = tmp / "s.sock"
        pid_file = tmp / "s.pid"
        self.log = tmp / "s.log"
        with self.log.open("wb") as err:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.server.stalled_server",
                    str(tmp / "store"),
                    str(self.socket),
                    str(pid_file),
                    *(["one-cpu"] if one_cpu else []),
                ],
                cwd=ROOT,
                env=child_env(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        deadline = time.monotonic() + 60
        while not pid_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {self.log.read_text()}")
            time.sleep(0.02)

    def line(self) -> str:
        assert self.proc.stdout is not None
        out = self.proc.stdout.readline()
        assert out, f"the server ended: {self.log.read_text()[-2000:]}"
        return out.strip()

    def release(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("release\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.release()  # a held read would hold up the store's close
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(params=[False, True], ids=["cpus", "one-cpu"])
def stalled(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[StalledServer, RemoteStore]]:
    """The server on every CPU (a load's reads chained, one chunk per task) and on one
    (its reads back to back, each chunk verified on a helper meanwhile)."""
    srv = StalledServer(tmp_path, one_cpu=request.param)
    remote = RemoteStore(srv.socket, timeout=60)
    try:
        yield srv, remote
    finally:
        remote.close()
        srv.stop()


def _on_disk(remote: RemoteStore, kv: np.ndarray, tokens: np.ndarray, n: int) -> object:
    """``kv`` put, flushed and evicted from DRAM: the lookup of its ``n`` disk hits."""
    remote.put_prompt(tiny_identity(), PUBLIC, tokens, kv)
    remote.flush()
    remote.evict("dram", 1 << 30)
    lk = remote.lookup(tiny_identity(), PUBLIC, tokens)
    assert lk.tiers() == {"disk": n}
    return lk


def _outs(remote: RemoteStore, n: int, shared: bool) -> list[np.ndarray]:
    if not shared:
        return [np.zeros(TINY.chunk_shape, np.float16) for _ in range(n)]
    raw = remote.alloc_buffer(n * 4096)
    size = TINY.chunk_nbytes
    return [
        raw[i * 4096 : i * 4096 + size].view(np.float16).reshape(TINY.chunk_shape) for i in range(n)
    ]


def _exact(arr: np.ndarray | None, kv: np.ndarray, i: int) -> bool:
    want = kv[:, :, :, i * N : (i + 1) * N]
    return arr is not None and np.array_equal(arr.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("shared", [False, True], ids=["grants", "shared-buffers"])
def test_chunks_before_a_held_read_are_handed_out_and_none_after_it(
    stalled: tuple[StalledServer, RemoteStore], shared: bool
) -> None:
    srv, remote = stalled
    n, held = 6, 3
    tokens, kv = prompt_kv(71, n * N)
    mark(kv, held, N, STALL_MARK)
    lk = _on_disk(remote, kv, tokens, n)
    outs = _outs(remote, n, shared)
    handle = remote.load_async(lk, outs)  # type: ignore[arg-type]
    assert srv.line() == "entered"
    for i in range(held):  # handed out while chunk 3's read is held
        got = handle.chunk(i, timeout=10)
        assert got is outs[i] and _exact(got, kv, i)
    time.sleep(0.3)  # the reads after the held one run meanwhile, none is handed out
    assert handle.completed() == held and not handle.done()
    srv.release()
    assert srv.line() == "released"
    res = handle.wait(timeout=30)
    assert res.loaded == n and res.corrupt == [] and res.tiers == {"disk": n}
    assert all(_exact(a, kv, i) for i, a in enumerate(res.arrays))


@pytest.mark.parametrize("shared", [False, True], ids=["grants", "shared-buffers"])
def test_chunks_verified_after_the_last_read_ride_in_the_final_reply(
    stalled: tuple[StalledServer, RemoteStore], shared: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chunks before a held read come in a partial reply each while it is held; the
    held chunk and the ones after it (read meanwhile), verified once every read had
    finished, come with the final reply (into shared buffers the last chunk always
    does): every chunk handed out exact, in order, none twice."""
    srv, remote = stalled
    n, held = 6, 3
    tokens, kv = prompt_kv(73, n * N)
    mark(kv, held, N, STALL_MARK)
    lk = _on_disk(remote, kv, tokens, n)
    outs = _outs(remote, n, shared)
    parts: list[int] = []  # the chunk of each partial reply the client read
    part, part_into = replies.part, replies.part_into

    def seen(p: list[object]) -> tuple[int, int, str, tuple[int, ...]]:
        got = part(p)
        parts.append(got[0])
        return got

    def seen_into(p: list[object]) -> int:
        parts.append(part_into(p))
        return parts[-1]

    monkeypatch.setattr(replies, "part", seen)
    monkeypatch.setattr(replies, "part_into", seen_into)
    handle = remote.load_async(lk, outs)  # type: ignore[arg-type]
    assert srv.line() == "entered"
    for i in range(held):
        assert _exact(handle.chunk(i, timeout=10), kv, i)
    assert parts == list(range(held))
    time.sleep(0.3)  # the reads after the held one finish meanwhile
    srv.release()
    assert srv.line() == "released"
    res = handle.wait(timeout=30)
    assert res.loaded == n and all(_exact(a, kv, i) for i, a in enumerate(res.arrays))
    assert [handle.chunk(i, timeout=1) is outs[i] for i in range(n)] == [True] * n
    # in order, none twice; normally none for the held chunk and those after it (the
    # load is published by the time this thread sees them), never the last into
    # shared buffers
    assert parts == list(range(len(parts))) and held <= len(parts) <= n - shared


@pytest.mark.parametrize("shared", [False, True], ids=["grants", "shared-buffers"])
def test_a_corrupt_middle_chunk_is_a_counted_miss_and_those_before_it_exact(
    stalled: tuple[StalledServer, RemoteStore], shared: bool
) -> None:
    _, remote = stalled
    n, bad = 5, 2
    tokens, kv = prompt_kv(72, n * N)
    mark(kv, bad, N, CORRUPT_MARK)
    lk = _on_disk(remote, kv, tokens, n)
    corrupt_before = remote.counters.corrupt
    outs = _outs(remote, n, shared)
    handle = remote.load_async(lk, outs)  # type: ignore[arg-type]
    res = handle.wait(timeout=30)
    assert res.loaded == bad and res.corrupt == [lk.hits[bad].key]  # type: ignore[attr-defined]
    assert all(_exact(a, kv, i) for i, a in enumerate(res.arrays))
    # nothing from the corrupt chunk on was handed out
    assert [handle.chunk(i, timeout=1) is not None for i in range(n)] == [True] * bad + [False] * (
        n - bad
    )
    assert remote.counters.corrupt == corrupt_before + 1
    # the corrupt object is gone: the prompt's hits end before it
    assert remote.lookup(tiny_identity(), PUBLIC, tokens).tiers() == {"disk": bad}

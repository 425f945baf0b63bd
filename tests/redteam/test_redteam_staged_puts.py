"""Red team of the staged put's ``put_written`` notices on a real ``kvlife serve``: a
client that sends notices out of order, overlapping, repeated, of no bytes, negative,
beyond its put, huge, of the wrong type, with no deferred put (after its commit, from
another session), and a client SIGKILLed between its notices and its commit. The put
that follows the bad notices stores exactly the bytes written, sealed as written (the
audit is clean); every bad notice is an unreplied typed error (counted), never an
internal error; a killed client leaves nothing staged, tentative or stored."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from kvlife.client import RemoteStore
from kvlife.core.identity import PUBLIC
from kvlife.server import protocol
from tests.conftest import TINY, prompt_kv, tiny_identity
from tests.server.conftest import ROOT, ServerProc, child_env, quiet

N = TINY.tokens_per_chunk
SIZE = TINY.chunk_nbytes


def _exact(remote: RemoteStore, tokens: np.ndarray, kv: np.ndarray, n: int) -> None:
    got = remote.load(remote.lookup(tiny_identity(), PUBLIC, tokens))
    assert got.loaded == n
    for i, a in enumerate(got.arrays):
        want = kv[:, :, :, i * N : (i + 1) * N]
        assert np.array_equal(a.view(np.uint16), want.view(np.uint16))


_PACK = protocol.pack
"""The real ``pack`` (tests below spy on the module's)."""


def _notice(upto: object) -> bytes:
    return _PACK([0, "put_written", {"bytes": upto}])


BAD = [0, -1, -(1 << 40), 4 * SIZE + 1, 1 << 50, (1 << 50) + 1, 1 << 62, "12", 1.5, None, [3]]
"""Notices the server must refuse (each an unreplied typed error): none, negative,
beyond a put of 4 chunks, huge, not an int."""


@pytest.mark.usefixtures("server_hashes_puts")
def test_bad_and_disordered_notices_never_change_what_is_sealed(
    server: ServerProc, remote: RemoteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvlife.client.puts as client_puts

    monkeypatch.setattr(remote._puts, "notice_bytes", 1)
    monkeypatch.setattr(client_puts, "NOTICES_PER_PUT", 1 << 30)  # a notice per row
    ident = tiny_identity()
    remote.put_prompt(ident, PUBLIC, *prompt_kv(90, 4 * N))  # stages 4 extents
    before = quiet(remote)
    pack = protocol.pack
    sent: list[int] = []

    def spy(msg: object) -> bytes:
        frame = pack(msg)
        if isinstance(msg, list) and msg[1] == "put_written":
            upto = msg[2]["bytes"]
            sent.append(upto)
            # after each real notice: the bad ones, then older and partial ones again
            # (out of order, overlapping), then the real one repeated
            extra = b"".join(_notice(b) for b in BAD)
            extra += b"".join(_notice(b) for b in (1, upto // 2 or 1, max(1, upto - 3), upto))
            return frame + extra
        return frame

    tokens, kv = prompt_kv(91, 4 * N)
    remote.put_prompt(ident, PUBLIC, tokens[:N], kv[:, :, :, :N])  # chunk 0 present
    monkeypatch.setattr(protocol, "pack", spy)
    res = remote.put_prompt(ident, PUBLIC, tokens, kv)
    monkeypatch.setattr(protocol, "pack", pack)
    assert res.stored == 3 and res.already_present == 1
    assert len(sent) >= 4 and any(b % SIZE for b in sent), "notices mid-chunk"
    report = remote.check()
    assert report.clean, report
    state = quiet(remote)
    assert state["internal_errors"] == before["internal_errors"] == 0
    assert state["unreplied_errors"] - before["unreplied_errors"] == len(BAD) * len(sent)
    assert state["tentative"] == 0
    _exact(remote, tokens, kv, 4)


def test_notices_with_no_deferred_put_are_refused_and_touch_no_put(
    server: ServerProc, remote: RemoteStore
) -> None:
    """After a commit, and from another session while this one has a deferred put in
    its copy: the notice names no put of its own session, so it is refused (counted)."""
    ident = tiny_identity()
    tokens, kv = prompt_kv(92, 2 * N)
    remote.put_prompt(ident, PUBLIC, tokens, kv)  # two-phase, stages 2 extents
    conn = remote._wire.connected()
    conn.sock.sendall(_notice(SIZE))  # no deferred put on this session
    other = server.client()
    try:
        oconn = other._wire.connected()
        oconn.sock.sendall(_notice(1) + _notice(SIZE))  # nor on that one
        other._wire.roundtrip(oconn, "state", {})  # in order: the notices were taken
        tokens2, kv2 = prompt_kv(93, 2 * N)
        res = remote.put_prompt(ident, PUBLIC, tokens2, kv2)  # staged, one round trip
        assert res.stored == 2
        state = quiet(other, sessions=2)
        assert state["unreplied_errors"] == 3 and state["internal_errors"] == 0
    finally:
        other.close()
    assert remote.check().clean
    _exact(remote, tokens2, kv2, 2)


_KILLED = r"""
import os, signal, sys
import numpy as np
import kvlife.client.puts as client_puts
from kvlife.client import RemoteStore
from kvlife.core.identity import PUBLIC
from tests.conftest import prompt_kv, tiny_identity, TINY

n = TINY.tokens_per_chunk
r = RemoteStore(sys.argv[1])
r._puts.notice_bytes = 1
r._puts.seal_copies = False  # the server hashes what the notices tell
client_puts.NOTICES_PER_PUT = 1 << 30  # a notice per row
r.put_prompt(tiny_identity(), PUBLIC, *prompt_kv(94, 3 * n))  # stages 3 extents
real = np.copyto
copies = []
rows = TINY.chunk_shape[0]


class Numpy:
    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def copyto(dst, src):
        copies.append(1)
        if len(copies) == rows + 1:  # chunk 0 copied and noticed, chunk 1 begun
            conn = r._wire.conn
            r._wire.roundtrip(conn, "state", {})  # the server took the notices
            print("noticed", flush=True)
            sys.stdin.readline()
            os.kill(os.getpid(), signal.SIGKILL)
        real(dst, src)


client_puts.stream_copy = Numpy.copyto
r.put_prompt(tiny_identity(), PUBLIC, *prompt_kv(95, 3 * n))
print("not killed", flush=True)
"""


def test_a_client_killed_between_its_notices_and_its_commit_stores_nothing(
    server: ServerProc,
) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED, str(server.socket)],
        cwd=ROOT,
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    watcher = server.client()
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == b"noticed"
        mid = quiet(watcher, sessions=2)
        assert mid["tentative"] == 3, "the deferred put is prepared, its chunks TENTATIVE"
        child.stdin.write(b"go\n")
        child.stdin.flush()
        assert child.wait(timeout=60) == -signal.SIGKILL
        state = quiet(watcher, sessions=1)
        assert state["staged"] == 0 and state["tentative"] == 0
        assert state["arena_extents"] == state["shm_replicas"] == 3
        assert state["internal_errors"] == 0
        tokens, kv = prompt_kv(95, 3 * N)
        assert watcher.lookup(tiny_identity(), PUBLIC, tokens).hits == []
        # the store takes the same prompt whole afterwards, and serves it exact
        assert watcher.put_prompt(tiny_identity(), PUBLIC, tokens, kv).stored == 3
        assert watcher.check().clean
        _exact(watcher, tokens, kv, 3)
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
        watcher.close()

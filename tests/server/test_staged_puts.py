"""The one-round-trip put: the server stages arena extents for a session with its first
put of a chunk shape; later puts of that shape copy every chunk into staged extents and
commit with one ``put``. Chunks the store lacks are adopted without a copy; the extents
of chunks it already holds stay staged. Bytes are exact, extents are never handed out
twice, a bad ``put`` is a typed error, and a client that dies leaves nothing staged."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from itertools import pairwise
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvlife.client import RemoteStore
from kvlife.core.errors import ChecksumMismatch, ProtocolError
from kvlife.core.identity import PUBLIC, KVLayout, ModelIdentity, token_bytes
from kvlife.native.copies import copy_sealed, stream_copy
from kvlife.server import protocol
from tests.conftest import TINY, prompt_kv, tiny_identity
from tests.server.conftest import ROOT, ServerProc, child_env, quiet

N = TINY.tokens_per_chunk


def _chunks_equal(remote: RemoteStore, tokens: np.ndarray, kv: np.ndarray, n: int) -> None:
    got = remote.load(remote.lookup(tiny_identity(), PUBLIC, tokens))
    assert got.loaded == n
    for i, a in enumerate(got.arrays):
        assert np.array_equal(a.view(np.uint16), kv[:, :, :, i * N : (i + 1) * N].view(np.uint16))


def test_second_put_of_a_shape_is_one_round_trip_and_adopts_staged_extents(
    remote: RemoteStore,
) -> None:
    ident = tiny_identity()
    tokens, kv = prompt_kv(31, 3 * N)
    first = remote.put_prompt(ident, PUBLIC, tokens, kv)
    assert first.stored == 3
    state = quiet(remote)
    assert state["staged"] == 3, "the first put stages extents for the next one"
    adopted = remote.info().tiers[0].details["adopted"]
    verbs: list[str] = []
    roundtrip = remote._wire.roundtrip

    def spy(conn: object, verb: str, *rest: object) -> object:
        verbs.append(verb)
        return roundtrip(conn, verb, *rest)  # type: ignore[arg-type]

    remote._wire.roundtrip = spy  # type: ignore[method-assign,assignment]
    tokens2, kv2 = prompt_kv(32, 3 * N)
    second = remote.put_prompt(ident, PUBLIC, tokens2, kv2)
    remote._wire.roundtrip = roundtrip  # type: ignore[method-assign]
    assert verbs == ["put_commit"], "one round trip (the deferred put rode ahead of it)"
    assert second.stored == 3 and second.already_present == 0
    assert remote.info().tiers[0].details["adopted"] == adopted + 3  # no copy on the server
    assert quiet(remote)["staged"] == 3, "the consumed extents are replaced"
    _chunks_equal(remote, tokens, kv, 3)
    _chunks_equal(remote, tokens2, kv2, 3)


def test_present_chunks_keep_their_extents_staged_and_replicas_are_never_restaged(
    remote: RemoteStore,
) -> None:
    ident = tiny_identity()
    tokens, kv = prompt_kv(33, 4 * N)
    remote.put_prompt(ident, PUBLIC, tokens[: 2 * N], kv[:, :, :, : 2 * N])
    remote.put_prompt(ident, PUBLIC, tokens[: 2 * N], kv[:, :, :, : 2 * N])  # all present
    res = remote.put_prompt(ident, PUBLIC, tokens, kv)  # 2 present, 2 new: staged path
    assert res.stored + res.already_present == 4
    # later puts overwrite staged extents: the replicas' bytes must not change
    for seed in range(34, 40):
        t, k = prompt_kv(seed, 4 * N)
        remote.put_prompt(ident, PUBLIC, t, k)
    _chunks_equal(remote, tokens, kv, 4)
    state = quiet(remote)
    assert 0 < int(str(state["staged"])) <= 8


def _put_args(tokens: np.ndarray, staged: list[int]) -> dict[str, object]:
    return {
        "identity": protocol.encode_identity(tiny_identity()),
        "namespace": str(PUBLIC),
        "tokens": token_bytes(tokens),
        "staged": staged,
    }


def test_a_put_naming_extents_it_was_not_given_is_a_typed_error(remote: RemoteStore) -> None:
    tokens, kv = prompt_kv(41, 2 * N)
    remote.put_prompt(tiny_identity(), PUBLIC, tokens, kv)
    with pytest.raises(ProtocolError, match="no staged extent"):
        remote._wire.call("put", _put_args(tokens, [10**9, 10**9 + 1]))
    with pytest.raises(ProtocolError, match="distinct staged extents"):
        remote._wire.call("put", _put_args(tokens, [1]))
    with pytest.raises(ProtocolError, match="distinct staged extents"):
        remote._wire.call("put", _put_args(tokens, [5, 5]))
    # ids are the session's own: another session's (this one staged none) name nothing
    other = RemoteStore(remote.socket_path, timeout=30)
    fresh = RemoteStore(remote.socket_path, timeout=30)
    try:
        t2, kv2 = prompt_kv(42, 2 * N)
        other.put_prompt(tiny_identity(), PUBLIC, t2, kv2)
        conn = other._wire.conn
        assert conn is not None
        theirs = [sid for pool in conn.staged.values() for sid, _ in pool][:2]
        assert len(theirs) == 2
        with pytest.raises(ProtocolError, match="no staged extent"):
            fresh._wire.call("put", _put_args(prompt_kv(43, 2 * N)[0], theirs))
        assert quiet(remote, sessions=3)["staged"] == 4  # nothing taken from either
    finally:
        other.close()
        fresh.close()
    assert remote.lookup(tiny_identity(), PUBLIC, prompt_kv(43, 2 * N)[0]).hits == []


def client_process(server: ServerProc, code: str, ready: bytes) -> subprocess.Popen[bytes]:
    """A client process running ``code`` against the server, once it printed ``ready``
    (it then waits on its stdin, to be killed where it stands)."""
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(server.socket)],
        cwd=ROOT,
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == ready
    return child


def test_a_killed_client_leaves_no_staged_extent(server: ServerProc) -> None:
    code = (
        "import sys; from kvlife.client import RemoteStore\n"
        "from kvlife.core.identity import PUBLIC\n"
        "from tests.conftest import prompt_kv, tiny_identity, TINY\n"
        "r = RemoteStore(sys.argv[1]); t, kv = prompt_kv(51, 2 * TINY.tokens_per_chunk)\n"
        "r.put_prompt(tiny_identity(), PUBLIC, t, kv)\n"
        "print('staged', flush=True); sys.stdin.read()\n"
    )
    child = client_process(server, code, b"staged")
    watcher = server.client()
    try:
        assert quiet(watcher, sessions=2)["staged"] == 2
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        state = quiet(watcher, sessions=1)
        assert state["staged"] == 0 and state["tentative"] == 0
        assert state["arena_extents"] == state["shm_replicas"]
    finally:
        watcher.close()


def test_a_deferred_put_that_failed_is_raised_by_its_commit(remote: RemoteStore) -> None:
    tokens, kv = prompt_kv(44, 2 * N)
    remote.put_prompt(tiny_identity(), PUBLIC, tokens, kv)
    with pytest.raises(ProtocolError, match="no deferred put"):
        remote._wire.call("put_commit", {})
    conn = remote._wire.conn
    assert conn is not None
    bad = {**_put_args(prompt_kv(45, 2 * N)[0], [1]), "deferred": True}
    conn.sock.sendall(protocol.pack([0, "put", bad]))  # no reply: the error waits
    with pytest.raises(ProtocolError, match="distinct staged extents"):
        remote._wire.call("put_commit", {})
    state = quiet(remote)
    assert state["tentative"] == 0 and state["staged"] == 2  # nothing taken, nothing left
    t2, kv2 = prompt_kv(46, 2 * N)
    assert remote.put_prompt(tiny_identity(), PUBLIC, t2, kv2).stored == 2
    _chunks_equal(remote, t2, kv2, 2)


def test_extents_of_a_replaced_connection_fall_back_to_the_two_phase_put(
    remote: RemoteStore,
) -> None:
    """Another thread reconnected between taking staged extents and using them: the put
    goes the two-phase way on the new connection, with its own bytes."""
    tokens, kv = prompt_kv(47, 2 * N)
    remote.put_prompt(tiny_identity(), PUBLIC, tokens, kv)
    take = remote._puts.take_staged

    def take_then_reconnect(shape: object, count: int) -> object:
        got = take(shape, count)  # type: ignore[arg-type]
        remote._wire.drop()
        remote._wire.call("info", {})  # a new connection, a new session
        return got

    remote._puts.take_staged = take_then_reconnect  # type: ignore[method-assign,assignment]
    t2, kv2 = prompt_kv(48, 2 * N)
    assert remote.put_prompt(tiny_identity(), PUBLIC, t2, kv2).stored == 2
    remote._puts.take_staged = take  # type: ignore[method-assign]
    _chunks_equal(remote, t2, kv2, 2)
    assert quiet(remote)["staged"] == 2  # the new session's, from the fallback's prepare


@pytest.mark.usefixtures("server_hashes_puts")
def test_chunks_said_written_are_sealed_as_written(
    remote: RemoteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A staged put tells the server how many bytes it wrote (``put_written``), here
    after every row, so mid-chunk; the server hashes them then, and the seals match
    the bytes (an audit reads every replica against its seal), the present chunk is
    left alone, nothing failed unanswered, and the bytes load exact."""
    import kvlife.client.puts as client_puts

    monkeypatch.setattr(remote._puts, "notice_bytes", 1)
    monkeypatch.setattr(client_puts, "NOTICES_PER_PUT", 1 << 30)  # a notice per row
    ident = tiny_identity()
    told: list[int] = []
    remote.put_prompt(ident, PUBLIC, *prompt_kv(60, 4 * N))  # stages 4 extents
    pack = protocol.pack

    def spy(msg: object) -> bytes:
        if isinstance(msg, list) and msg[1] == "put_written":
            told.append(msg[2]["bytes"])
        return pack(msg)

    tokens, kv = prompt_kv(61, 4 * N)
    remote.put_prompt(ident, PUBLIC, tokens[:N], kv[:, :, :, :N])  # chunk 0: present below
    monkeypatch.setattr(protocol, "pack", spy)
    res = remote.put_prompt(ident, PUBLIC, tokens, kv)
    monkeypatch.setattr(protocol, "pack", pack)
    assert res.stored == 3 and res.already_present == 1
    size = TINY.chunk_nbytes
    assert told == sorted(told) and told[-1] < 4 * size
    assert any(b % size for b in told), "notices in the middle of chunks"
    assert {b // size for b in told} >= {0, 1, 2, 3}
    report = remote.check()
    assert report.clean, report
    state = quiet(remote)
    assert state["unreplied_errors"] == 0 and state["internal_errors"] == 0
    _chunks_equal(remote, tokens, kv, 4)


@given(
    total=st.integers(min_value=0, max_value=1 << 32),
    step=st.integers(min_value=1, max_value=1 << 30),
    tail=st.integers(min_value=1, max_value=1 << 22),
)
def test_notice_points_step_then_halve_the_rest_down_to_the_tail(
    total: int, step: int, tail: int
) -> None:
    """Every ``step`` bytes, then at halves of what is left down to ``tail``: increasing,
    inside the put, and none at all for a put of at most one step."""
    from kvlife.client.puts import notice_points

    assume(total // step <= 4096)  # a put's notices are a sixteenth of it, or a row
    points = notice_points(total, step, tail)
    regular = list(range(step, total, step))
    assert points[: len(regular)] == regular
    if not regular:
        assert points == []
        return
    assert all(0 < a < b < total for a, b in pairwise(points))
    left = [total - p for p in points[len(regular) - 1 :]]
    for before, after in pairwise(left):
        assert after == before - before // 2  # each halves what was left
    assert left[-1] // 2 < tail  # down to the tail, no further


@pytest.mark.usefixtures("server_hashes_puts")
def test_the_last_step_of_a_put_is_told_in_halves(
    remote: RemoteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a notice per chunk and a tail of 16 KiB, a put of four 128 KiB chunks tells
    the server of 128, 256 and 384 KiB written, then of 448, 480 and 496 KiB: the commit
    hashes the last 16 KiB only. A row of these chunks (a layer) is 64 KiB, so the last
    two notices fall inside one: the copy goes in pieces of whole heads there. The
    seals match the bytes and the chunks load exact."""
    import kvlife.client.puts as client_puts

    layout = KVLayout(
        num_layers=2, num_kv_heads=4, head_dim=64, dtype="float16", tokens_per_chunk=64
    )
    ident = ModelIdentity(layout=layout, model_id="rows", weights_digest="w", tokenizer_digest="t")
    size = layout.chunk_nbytes
    assert size == 128 << 10
    monkeypatch.setattr(remote._puts, "notice_bytes", size)
    monkeypatch.setattr(client_puts, "TAIL_NOTICE_BYTES", 16 << 10)
    rng = np.random.default_rng(5)

    n = layout.tokens_per_chunk

    def kv(tokens: int) -> np.ndarray:
        return rng.standard_normal((2, 2, 4, tokens, 64)).astype(np.float16)

    remote.put_prompt(ident, PUBLIC, list(range(4 * n)), kv(4 * n))  # stages 4 extents
    told: list[int] = []
    pack = protocol.pack

    def spy(msg: object) -> bytes:
        if isinstance(msg, list) and msg[1] == "put_written":
            told.append(msg[2]["bytes"])
        return pack(msg)

    tokens, data = list(range(100, 100 + 4 * n)), kv(4 * n)
    monkeypatch.setattr(protocol, "pack", spy)
    res = remote.put_prompt(ident, PUBLIC, tokens, data)
    monkeypatch.setattr(protocol, "pack", pack)
    assert res.stored == 4
    assert told == [k << 10 for k in (128, 256, 384, 448, 480, 496)]
    assert remote.check().clean
    got = remote.load(remote.lookup(ident, PUBLIC, tokens))
    assert got.loaded == 4
    for i, a in enumerate(got.arrays):
        assert np.array_equal(a.view(np.uint16), data[:, :, :, i * n : (i + 1) * n].view(np.uint16))


@settings(max_examples=60, deadline=None)
@given(
    dims=st.tuples(*(st.integers(1, 4) for _ in range(5))),
    count=st.integers(1, 4),
    step=st.integers(1, 4096),
    tail=st.integers(1, 1024),
    seed=st.integers(0, 2**16),
)
def test_a_put_copies_every_byte_and_tells_each_notice_within_a_head_of_it(
    dims: tuple[int, int, int, int, int], count: int, step: int, tail: int, seed: int
) -> None:
    """``copy_telling`` into C-contiguous extents from strided views of one KV tensor
    (as ``put_prompt`` splits it): every byte lands where it belongs, the counts told
    increase, none is the whole put, and each notice point is told within a row after
    it, within a head once a count in the last step was told (the halved notices:
    pieces of whole heads from there), or not at all where the next piece ends the
    put."""
    from kvlife.client.puts import copy_telling, notice_points

    layers, kv, heads, tokens, dim = dims
    data = np.random.default_rng(seed).integers(
        0, 1 << 16, (layers, kv, heads, tokens * count, dim), np.uint16
    )
    chunks = [data[:, :, :, i * tokens : (i + 1) * tokens] for i in range(count)]
    dsts = [np.zeros((layers, kv, heads, tokens, dim), np.uint16) for _ in range(count)]
    total = data.nbytes
    points = notice_points(total, step, tail)
    told: list[int] = []
    copy_telling(dsts, chunks, step, points, told.append)
    for got, want in zip(dsts, chunks, strict=True):
        assert np.array_equal(got, want)
    assert told == sorted(set(told)) and all(0 < t < total for t in told)
    head = tokens * dim * 2
    row = kv * heads * head
    for p in points:
        after = [t for t in told if t >= p]
        before = max((t for t in told if t < p), default=0)
        near = head if before >= total - step else row  # copied by heads since then
        assert (after and after[0] - p < near) or total - p < near, (p, told)


@pytest.mark.usefixtures("server_hashes_puts")
def test_a_chunk_written_again_after_put_written_is_caught_by_its_seal(
    remote: RemoteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The seal of a chunk the client said was written is the hash of its bytes then: a
    client that writes the chunk again before its commit is caught where seals are
    verified (here the audit), as one that writes after the commit, never sealed as
    the bytes it wrote last."""
    import kvlife.client.puts as client_puts

    monkeypatch.setattr(remote._puts, "notice_bytes", 1)
    monkeypatch.setattr(client_puts, "NOTICES_PER_PUT", 1 << 30)  # a notice per row
    ident = tiny_identity()
    remote.put_prompt(ident, PUBLIC, *prompt_kv(70, 3 * N))  # stages 3 extents
    assert remote.check().clean
    wire = remote._wire
    extents: list[np.ndarray] = []
    view = wire.view

    def spy_view(*args: Any) -> np.ndarray:
        extents.append(view(*args))
        return extents[-1]

    real = np.copyto
    rewritten: list[bool] = []

    class Numpy:
        """The copy of client/puts.py (its stream_copy), which rewrites chunk 0 in its
        extent once the last chunk's copy starts and the server has taken the notices before (a
        request with a reply on the same connection: the server answers in order)."""

        def __getattr__(self, name: str) -> object:
            return getattr(np, name)

        @staticmethod
        def copyto(dst: np.ndarray, src: np.ndarray) -> None:
            if len(extents) == 3 and not rewritten:
                conn = wire.conn
                assert conn is not None
                wire.roundtrip(conn, "state", {})
                real(extents[0], extents[0] + 1)  # chunk 0 written again, after its notice
                rewritten.append(True)
            real(dst, src)

    monkeypatch.setattr(wire, "view", spy_view)
    monkeypatch.setattr(client_puts, "stream_copy", Numpy.copyto)
    tokens, kv = prompt_kv(71, 3 * N)
    res = remote.put_prompt(ident, PUBLIC, tokens, kv)
    monkeypatch.setattr(client_puts, "stream_copy", stream_copy)
    monkeypatch.setattr(wire, "view", view)
    assert res.stored == 3 and len(extents) == 3 and rewritten, "the staged path"
    report = remote.check()
    assert not report.clean
    assert len(report.problems) == 1 and "after it was sealed" in report.problems[0]


@pytest.mark.usefixtures("server_hashes_puts")
def test_the_commit_hashes_a_chunk_the_notices_stopped_in_from_where_they_stopped(
    remote: RemoteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last notice of a put falls inside its last chunk (here: after its first row).
    The ``put_commit`` hashes that chunk from there on (issue 28: not the whole chunk
    again), so its seal covers the first row as the notice found it: a client that
    writes that row again before the commit is caught by the audit, as one that writes
    a chunk it said was written."""
    import kvlife.client.puts as client_puts

    monkeypatch.setattr(remote._puts, "notice_bytes", 1)
    monkeypatch.setattr(client_puts, "NOTICES_PER_PUT", 1 << 30)  # a notice per row
    ident = tiny_identity()
    remote.put_prompt(ident, PUBLIC, *prompt_kv(80, 3 * N))  # stages 3 extents
    assert remote.check().clean
    wire = remote._wire
    extents: list[np.ndarray] = []
    view = wire.view

    def spy_view(*args: Any) -> np.ndarray:
        extents.append(view(*args))
        return extents[-1]

    real = np.copyto
    rows = TINY.chunk_shape[0]
    last_rows: list[int] = []

    class Numpy:
        """The copy of client/puts.py (its stream_copy), which for the last chunk's last
        row first rewrites that chunk's first row, once the server has taken its notice (a request
        with a reply on the same connection: the server answers in order)."""

        def __getattr__(self, name: str) -> object:
            return getattr(np, name)

        @staticmethod
        def copyto(dst: np.ndarray, src: np.ndarray) -> None:
            if len(extents) == 3:
                last_rows.append(1)
                if len(last_rows) == rows:  # the last row: the ones before were noticed
                    conn = wire.conn
                    assert conn is not None
                    wire.roundtrip(conn, "state", {})
                    real(extents[2][0], extents[2][0] + 1)  # row 0 again, after its notice
            real(dst, src)

    pack = protocol.pack
    told: list[int] = []

    def spy(msg: object) -> bytes:
        if isinstance(msg, list) and msg[1] == "put_written":
            told.append(msg[2]["bytes"])
        return pack(msg)

    monkeypatch.setattr(wire, "view", spy_view)
    monkeypatch.setattr(client_puts, "stream_copy", Numpy.copyto)
    monkeypatch.setattr(protocol, "pack", spy)
    tokens, kv = prompt_kv(81, 3 * N)
    res = remote.put_prompt(ident, PUBLIC, tokens, kv)
    monkeypatch.setattr(protocol, "pack", pack)
    monkeypatch.setattr(client_puts, "stream_copy", stream_copy)
    monkeypatch.setattr(wire, "view", view)
    assert res.stored == 3 and len(extents) == 3 and len(last_rows) == rows, "the staged path"
    size = TINY.chunk_nbytes
    assert 2 * size < told[-1] < 3 * size, "the last notice inside the last chunk"
    report = remote.check()
    assert not report.clean
    assert len(report.problems) == 1 and "after it was sealed" in report.problems[0]


def test_a_client_killed_between_its_deferred_put_and_the_commit_leaves_nothing(
    server: ServerProc,
) -> None:
    """The client sent its deferred ``put`` and a ``put_written``, then died while
    copying the next chunk: the server aborts the put with the session. None of its
    chunks is visible, none is TENTATIVE, and every extent it took (the put's, those
    staged for it and their replacements) is back in the arena."""
    code = (
        "import sys, numpy as np; from kvlife.client import RemoteStore\n"
        "import kvlife.client.puts as cp\n"
        "from kvlife.core.identity import PUBLIC\n"
        "from tests.conftest import prompt_kv, tiny_identity, TINY\n"
        "r = RemoteStore(sys.argv[1]); n = 3 * TINY.tokens_per_chunk\n"
        "r.put_prompt(tiny_identity(), PUBLIC, *prompt_kv(52, n))  # stages 3 extents\n"
        "r._puts.notice_bytes = 1; cp.NOTICES_PER_PUT = 1 << 30  # a notice per row\n"
        "r._puts.seal_copies = False  # the server hashes what the notices tell\n"
        "calls = []\n"
        "class Numpy:\n"
        "    def __getattr__(self, name): return getattr(np, name)\n"
        "    @staticmethod\n"
        "    def copyto(dst, src):\n"
        "        calls.append(1)\n"
        "        if len(calls) == 3:  # the put and a notice went out before\n"
        "            print('copying', flush=True); sys.stdin.read()\n"
        "        np.copyto(dst, src)\n"
        "cp.stream_copy = Numpy.copyto\n"
        "r.put_prompt(tiny_identity(), PUBLIC, *prompt_kv(53, n))\n"
    )
    child = client_process(server, code, b"copying")
    watcher = server.client()
    try:
        before = quiet(watcher, sessions=2)
        assert before["tentative"] == 3, "the deferred put was prepared"
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        state = quiet(watcher, sessions=1)
        assert state["staged"] == 0 and state["tentative"] == 0 and state["puts"] == 0
        assert state["shm_replicas"] == 3  # the first put's chunks only
        assert state["arena_extents"] == state["shm_replicas"]
        tokens, _ = prompt_kv(53, 3 * N)
        assert watcher.lookup(tiny_identity(), PUBLIC, tokens).hits == []
    finally:
        watcher.close()


@pytest.mark.usefixtures("server_hashes_puts")
def test_an_invalidation_while_a_deferred_put_is_copied_stores_none_of_it(
    server: ServerProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another client invalidates the namespace while this one copies the chunks of its
    deferred put (after the ``put`` and a ``put_written`` were taken): the commit stores
    none of them (an invalidation covers a put in flight), nothing of it is visible,
    the extents of its new chunks are given back (never staged again, never replicas),
    and the next puts go on the staged path with exact bytes."""
    import kvlife.client.puts as client_puts

    remote, other = server.client(), server.client()
    try:
        monkeypatch.setattr(remote._puts, "notice_bytes", 1)
        monkeypatch.setattr(client_puts, "NOTICES_PER_PUT", 1 << 30)  # a notice per row
        ident = tiny_identity()
        remote.put_prompt(ident, PUBLIC, *prompt_kv(90, 3 * N))  # stages 3 extents
        wire = remote._wire
        real = np.copyto
        calls: list[int] = []

        class Numpy:
            """The copy of client/puts.py (its stream_copy): once its put and a notice were
            taken (a request with a reply on the same connection: the server answers in
            order), the other client invalidates the namespace, then the copy goes on."""

            def __getattr__(self, name: str) -> object:
                return getattr(np, name)

            @staticmethod
            def copyto(dst: np.ndarray, src: np.ndarray) -> None:
                calls.append(1)
                if len(calls) == 3:
                    conn = wire.conn
                    assert conn is not None
                    assert wire.roundtrip(conn, "state", {})["tentative"] == 3
                    other.invalidate(namespace=PUBLIC)
                real(dst, src)

        monkeypatch.setattr(client_puts, "stream_copy", Numpy.copyto)
        tokens, kv = prompt_kv(91, 3 * N)
        res = remote.put_prompt(ident, PUBLIC, tokens, kv)
        monkeypatch.setattr(client_puts, "stream_copy", stream_copy)
        assert len(calls) > 3, "the staged path"
        assert res.stored == 0 and res.tokens_stored_or_present == 0
        assert remote.lookup(ident, PUBLIC, tokens).hits == []
        state = quiet(other, sessions=2)
        assert state["tentative"] == 0 and state["shm_replicas"] == 0
        assert state["arena_extents"] == state["staged"] == 3, "replacements, no leak"
        t2, kv2 = prompt_kv(92, 3 * N)
        assert remote.put_prompt(ident, PUBLIC, t2, kv2).stored == 3
        _chunks_equal(remote, t2, kv2, 3)
        assert remote.check().clean
    finally:
        remote.close()
        other.close()


def _spy_verbs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    """Every request this process sends, (verb, args), from now on."""
    sent: list[tuple[str, dict[str, Any]]] = []
    pack = protocol.pack

    def spy(msg: object) -> bytes:
        if isinstance(msg, list) and len(msg) == 3:
            sent.append((msg[1], dict(msg[2])))
        return pack(msg)

    monkeypatch.setattr(protocol, "pack", spy)
    return sent


def test_a_staged_put_is_sealed_by_the_client_and_the_server_hashes_nothing(
    remote: RemoteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A staged put within ``SEAL_PUT_BYTES`` (where the extension seals as it copies)
    sends no ``put_written`` and a ``put_commit`` with one seal per chunk, each the
    xxh3-128 of that chunk's bytes; the server takes them (its chunks verify: the audit
    is clean) and they load exact. One larger than it tells the server what is written
    instead, as before."""
    import kvlife.client.puts as client_puts
    from kvlife.native.copies import sealing
    from kvlife.tiers.base import seal_of

    if not sealing():
        pytest.skip("no extension: the client does not seal")
    ident = tiny_identity()
    remote.put_prompt(ident, PUBLIC, *prompt_kv(80, 3 * N))  # stages 3 extents
    sent = _spy_verbs(monkeypatch)
    tokens, kv = prompt_kv(81, 3 * N)
    assert remote.put_prompt(ident, PUBLIC, tokens, kv).stored == 3
    verbs = [v for v, _ in sent]
    assert verbs == ["put", "put_commit"], verbs
    seals = sent[1][1]["seals"]
    want = [seal_of(np.ascontiguousarray(kv[:, :, :, i * N : (i + 1) * N])) for i in range(3)]
    assert seals == b"".join(want)
    assert remote.check().clean
    _chunks_equal(remote, tokens, kv, 3)
    # above the threshold: notices, no seals
    monkeypatch.setattr(client_puts, "SEAL_PUT_BYTES", 3 * TINY.chunk_nbytes - 1)
    monkeypatch.setattr(remote._puts, "notice_bytes", 1)
    monkeypatch.setattr(client_puts, "NOTICES_PER_PUT", 1 << 30)
    sent.clear()
    tokens, kv = prompt_kv(82, 3 * N)
    assert remote.put_prompt(ident, PUBLIC, tokens, kv).stored == 3
    assert "put_written" in [v for v, _ in sent]
    assert "seals" not in sent[-1][1]
    assert remote.check().clean
    _chunks_equal(remote, tokens, kv, 3)


def test_seals_of_the_wrong_length_are_a_typed_error_and_the_put_leaves_nothing(
    remote: RemoteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``put_commit`` whose seals are not 16 bytes per chunk is a ProtocolError: the
    put is aborted (no TENTATIVE chunk, nothing indexed), no arena extent is lost, and
    the session goes on (the same prompt is stored whole by the next put)."""
    import kvlife.client.puts as client_puts
    from kvlife.native.copies import sealing

    if not sealing():
        pytest.skip("no extension: the client does not seal")
    ident = tiny_identity()
    remote.put_prompt(ident, PUBLIC, *prompt_kv(83, 3 * N))  # stages 3 extents
    before = quiet(remote)
    real = copy_sealed
    monkeypatch.setattr(client_puts, "copy_sealed", lambda d, s: real(d, s)[:15])
    tokens, kv = prompt_kv(84, 3 * N)
    with pytest.raises(ProtocolError, match="seals"):
        remote.put_prompt(ident, PUBLIC, tokens, kv)
    monkeypatch.setattr(client_puts, "copy_sealed", real)
    state = quiet(remote)
    assert state["tentative"] == 0 and state["puts"] == 0
    assert state["shm_replicas"] == before["shm_replicas"] == 3
    assert remote.lookup(ident, PUBLIC, tokens).hits == []
    assert remote.put_prompt(ident, PUBLIC, tokens, kv).stored == 3
    assert remote.check().clean
    _chunks_equal(remote, tokens, kv, 3)
    state = quiet(remote)
    assert state["internal_errors"] == 0


@pytest.mark.parametrize("verb", ["commit_put", "abort_put"])
def test_a_refused_commit_or_abort_of_a_pending_put_aborts_it(
    remote: RemoteStore, verb: str
) -> None:
    """A two-phase put's ``commit_put`` (or ``abort_put``) whose arguments the decoder
    refuses (an unknown field beside a valid put id) is a ProtocolError, and the pending
    put it names is aborted: nothing TENTATIVE, its budget back (``puts`` 0), the prompt
    stored whole by the next put. Before 2026-12-07 the put stayed pending, its chunks
    TENTATIVE, until the session ended."""
    ident = tiny_identity()
    tokens, kv = prompt_kv(87, 3 * N)
    pending = remote.prepare_put(ident, PUBLIC, tokens, kv)
    assert quiet(remote)["tentative"] == 3
    with pytest.raises(ProtocolError, match="bogus"):
        remote._wire.call(verb, {"put": pending.put, "bogus": 1})
    state = quiet(remote)
    assert state["tentative"] == 0 and state["puts"] == 0, state
    with pytest.raises(ProtocolError, match="no pending put"):
        remote._wire.call("commit_put", {"put": pending.put})
    res = remote.put_prompt(ident, PUBLIC, tokens, kv)
    assert res.stored == 3 and res.in_flight == 0, res
    _chunks_equal(remote, tokens, kv, 3)
    assert quiet(remote)["internal_errors"] == 0


def test_a_seal_that_is_not_the_bytes_is_caught_and_never_served_as_verified(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that sends seals its chunks do not have (a bug, or a lie): the DRAM tier
    takes them as given, as it takes the bytes, but they are caught wherever a seal is
    verified. With ``--verify-dram-on-load`` the load misses (counted) instead of
    serving them; the audit reports them; and a write-through server refuses the put
    (nothing of it stored, nothing on disk)."""
    import kvlife.client.puts as client_puts
    from kvlife.native.copies import sealing

    if not sealing():
        pytest.skip("no extension: the client does not seal")
    real = copy_sealed

    def lying(dst: np.ndarray, src: np.ndarray) -> bytes:
        return bytes(b ^ 1 for b in real(dst, src))

    ident = tiny_identity()
    runs: list[tuple[str, ...]] = [("--verify-dram-on-load",), ("--write-through",)]
    for flags in runs:
        srv = ServerProc(tmp_path / flags[0].strip("-"), extra=flags).start()
        store = srv.client()
        try:
            store.put_prompt(ident, PUBLIC, *prompt_kv(85, 3 * N))  # stages 3 extents
            monkeypatch.setattr(client_puts, "copy_sealed", lying)
            tokens, kv = prompt_kv(86, 3 * N)
            if flags[0] == "--write-through":
                with pytest.raises(ChecksumMismatch, match="sealed"):
                    store.put_prompt(ident, PUBLIC, tokens, kv)
                monkeypatch.setattr(client_puts, "copy_sealed", real)
                assert store.lookup(ident, PUBLIC, tokens).hits == []
                state = quiet(store)
                assert state["tentative"] == 0
                continue
            assert store.put_prompt(ident, PUBLIC, tokens, kv).stored == 3
            monkeypatch.setattr(client_puts, "copy_sealed", real)
            got = store.load(store.lookup(ident, PUBLIC, tokens))
            assert got.loaded == 0, "a chunk whose seal fails is a miss, never served"
            assert store.lookup(ident, PUBLIC, tokens).hits == [], "invalidated"
            assert store.counters.sealed_mismatch >= 1
        finally:
            monkeypatch.setattr(client_puts, "copy_sealed", real)
            store.close()
            srv.stop()

"""Attacks on the budget seam of ``kvlife serve`` (docs/server.md, "Limits"): budgets
charged to the client process (its ``SO_PEERCRED`` pid), a ``put_prompt`` larger than
half the client's put share sent in pieces, the server-wide identity cache, and the
audits and request bodies bounded per client. Real server processes, real client
processes; each test asserts what would fail if the promise broke."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvlife.client import RemoteStore
from kvlife.core.errors import KVLifeError, LimitExceeded
from kvlife.core.identity import PUBLIC, ChunkKey, Namespace, NamespaceKind, prompt_chunk_keys
from kvlife.server import protocol
from kvlife.store.facade import KVStore
from tests.conftest import TINY, prompt_kv, tiny_identity
from tests.server.conftest import ROOT, ServerProc, child_env, quiet
from tests.server.test_limits import Raw

N = TINY.tokens_per_chunk
ONE_CHUNK_SHARE = "0.0008"
"""``--session-put-share`` of about 10 KB of the 12 MiB arena: half of it is one TINY
chunk's page, so a put_prompt goes one chunk a piece."""


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[ServerProc]:
    s = ServerProc(tmp_path / "store").start()
    yield s
    assert s.stop() == 0


@pytest.fixture
def tiny_share(tmp_path: Path) -> Iterator[ServerProc]:
    s = ServerProc(tmp_path / "store", extra=("--session-put-share", ONE_CHUNK_SHARE)).start()
    yield s
    assert s.stop() == 0


def _held(state: dict[str, Any]) -> dict[str, int]:
    """Every budget the sessions hold but the connections themselves."""
    return {
        k: v
        for k, v in state.items()
        if k.startswith("held_") and k not in ("held_connections", "held_descriptors")
    }


# ---------------------------------------------------------------------- pieces


def _forget_staged(client: RemoteStore) -> None:
    """The client forgets its staged extents (the server keeps them, charged): its next
    put is a two-phase ``prepare_put``, charged anew."""
    conn = client._wire.conn
    assert conn is not None
    conn.staged.clear()


def test_pieces_store_the_keys_and_bytes_of_one_embedded_put(
    tiny_share: ServerProc, tmp_path: Path
) -> None:
    """One chunk a piece, a non-zero start after a parent, extra keys and a trailing
    partial chunk: the keys, the result and the bytes loaded are those of the same
    put_prompt on an embedded KVStore."""
    tokens, kv = prompt_kv(11, 9 * N + 5)
    ident = tiny_identity()
    ns = Namespace(NamespaceKind.ORGANISATION, "tenant-a")
    kw: dict[str, Any] = {
        "start": 7 * N,
        "parent": ChunkKey(bytes(range(32))),
        "extra_keys": [b"lora:x", b"\x00img"],
    }
    with KVStore.open(tmp_path / "embedded", dram_bytes=1 << 22, disk_bytes=1 << 24) as local:
        want = local.put_prompt(ident, ns, tokens, kv, **kw)
        want_load = local.get(ident, ns, tokens, **kw)
    with tiny_share.client() as client:
        assert client._puts.piece_chunks(TINY) == 1  # the attack's premise: 9 pieces
        got = client.put_prompt(ident, ns, tokens, kv, **kw)
        assert got == want
        assert got.keys == prompt_chunk_keys(ident, ns, tokens, **kw)
        loaded = client.get(ident, ns, tokens, **kw)
        assert loaded.loaded == want_load.loaded == 9
        for a, b in zip(loaded.arrays, want_load.arrays, strict=True):
            assert np.array_equal(a, b)
        # the same prompt without the extra keys shares none of them
        assert client.lookup(ident, ns, tokens, start=kw["start"], parent=kw["parent"]).hits == []
    with tiny_share.client() as observer:  # the putter gone, nothing is left held
        state = quiet(observer)
        assert _held(state) == dict.fromkeys(_held(state), 0) and state["peers"] == 1


def test_a_failed_piece_leaves_a_counted_prefix(tiny_share: ServerProc) -> None:
    """Piece 3 of 6 refused (the client's share is held by its own pending put on a
    second connection): a typed LimitExceeded, the two pieces before it stored and
    loadable, nothing after them, nothing held for the failed piece."""
    tokens, kv = prompt_kv(12, 6 * N)
    ident = tiny_identity()
    with tiny_share.client() as client, tiny_share.client() as hog:
        calls: dict[str, Any] = {"n": 0}
        real = client._puts._put

        def third_fails(args: dict[str, Any], layout: Any, chunks: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == 3:  # the same process takes its whole share meanwhile
                # (the piece cannot use the extent staged for it: two-phase, charged)
                _forget_staged(client)
                t2, kv2 = prompt_kv(99, N)
                calls["hold"] = hog.prepare_put(ident, PUBLIC, t2, kv2)
            return real(args, layout, chunks)

        client._puts._put = third_fails  # type: ignore[method-assign]
        with pytest.raises(LimitExceeded, match="session-put-share"):
            client.put_prompt(ident, PUBLIC, tokens, kv)
        hog.abort_put(calls["hold"])
        found = client.lookup(ident, PUBLIC, tokens)
        assert len(found.hits) == 2
        state = quiet(client, sessions=2)
        assert state["refused_put_bytes"] == 1 and state["held_puts"] == 0


@pytest.mark.parametrize("how", ["prefix", "namespace", "weights"])
@pytest.mark.parametrize("path", ["staged", "two_phase"])
def test_an_invalidation_between_pieces_covers_the_later_pieces(
    srv: ServerProc, how: str, path: str
) -> None:
    """The rule: an invalidation covers a put prepared before it returned. A put_prompt
    in pieces is one put to its caller, its KV computed before it was called. An
    invalidation of its first chunk that returns between piece 1 and piece 2 left
    pieces 2.. stored, chained after the invalidated chunk; when the prefix was put
    again (its KV recomputed, the same keys), a lookup of the whole prompt served the
    stale chunks after it. Now a piece whose predecessor is gone stores nothing."""
    ident = tiny_identity()
    tokens, kv = prompt_kv(13, 6 * N)
    with srv.client() as client, srv.client() as admin:
        client._puts.piece_chunks = lambda layout: 2  # type: ignore[method-assign]
        calls = {"n": 0}
        real = client._puts._put

        def invalidate_after_first(args: dict[str, Any], layout: Any, chunks: Any) -> Any:
            res = real(args, layout, chunks)
            calls["n"] += 1
            if calls["n"] == 1:
                crits: dict[str, dict[str, Any]] = {
                    "prefix": {"prefix": res.keys[0]},
                    "namespace": {"namespace": PUBLIC},
                    "weights": {"weights_digest": ident.weights_digest},
                }
                assert admin.invalidate(**crits[how]) == 2
            if path == "two_phase":  # no staged extents: the next piece is prepare_put
                _forget_staged(client)
            return res

        client._puts._put = invalidate_after_first  # type: ignore[method-assign]
        aborted0 = client.counters.aborted
        res = client.put_prompt(ident, PUBLIC, tokens, kv)
        client._puts._put = real  # type: ignore[method-assign]
        del client._puts.piece_chunks
        assert res.keys == prompt_chunk_keys(ident, PUBLIC, tokens)
        # piece 1 was stored before the invalidation; the rest were taken out of service
        # at their prepare, counted as aborted, as the embedded store counts a put an
        # invalidation covered (stored 0, dropped 0)
        assert (res.stored, res.dropped, res.tokens_stored_or_present) == (2, 0, 2 * N)
        assert client.counters.aborted - aborted0 == 4
        # the prefix recomputed (other values: stale KV must not be served after it)
        fresh = kv.copy()
        fresh[:] = 1.0
        assert (
            client.put_prompt(ident, PUBLIC, tokens[: 2 * N], fresh[:, :, :, : 2 * N]).stored == 2
        )
        got = client.get(ident, PUBLIC, tokens)
        assert got.loaded == 2, f"{got.loaded - 2} chunks put before the invalidation served"
        # nothing of the prompt after the invalidated chunk was left to be found
        after = client.lookup(ident, PUBLIC, tokens[2 * N :], start=2 * N, parent=res.keys[1])
        assert after.hits == []


# ---------------------------------------------------------------------- accounts

CYCLER = textwrap.dedent(
    """
    import os, sys
    from kvlife.client import RemoteStore
    from kvlife.core.identity import PUBLIC
    from tests.conftest import TINY, prompt_kv, tiny_identity

    sock = sys.argv[1]
    keep = RemoteStore(sock, timeout=30)  # inherited by the child below
    tokens, kv = prompt_kv(1, 4 * TINY.tokens_per_chunk)
    keep.prepare_put(tiny_identity(), PUBLIC, tokens, kv)
    pid = os.fork()
    if pid == 0:  # a child: its own connection, and the parent's inherited one
        mine = RemoteStore(sock, timeout=30)
        t2, kv2 = prompt_kv(2, 4 * TINY.tokens_per_chunk)
        mine.prepare_put(tiny_identity(), PUBLIC, t2, kv2)
        keep.alloc_buffer(4096)  # on the inherited connection, charged to the parent
        print("child", os.getpid(), flush=True)
        os._exit(0)  # nothing closed: the kernel ends both
    os.waitpid(pid, 0)
    for i in range(30):  # connect / hold / drop, many times
        s = RemoteStore(sock, timeout=30)
        t3, kv3 = prompt_kv(100 + i, 2 * TINY.tokens_per_chunk)
        s.prepare_put(tiny_identity(), PUBLIC, t3, kv3)
        s.lookup(tiny_identity(), PUBLIC, t3)
        s.alloc_buffer(3 * 4096)  # a shared buffer (a descriptor, bytes)
        t4, kv4 = prompt_kv(200 + i, 3 * TINY.tokens_per_chunk)
        s.put_prompt(tiny_identity(), PUBLIC, t4, kv4)  # staged extents for the next
        if i % 2:
            s.close()
        else:
            s._wire.conn.sock.close()  # an abrupt end, no goodbye
    print("done", flush=True)
    sys.stdin.readline()
    os._exit(0)
    """
)


def test_accounts_return_to_zero_after_forks_and_many_connections(srv: ServerProc) -> None:
    """A process that forks a child (its own connection and an inherited one), exits
    without closing, and makes and drops connections 30 times: every budget it held
    is given back, the peers it was charged to forgotten."""
    with srv.client() as observer:
        proc = subprocess.Popen(
            [sys.executable, "-c", CYCLER, str(srv.socket)],
            cwd=ROOT,
            env=child_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().startswith("child")
            assert proc.stdout.readline().startswith("done")
            state = quiet(observer, sessions=2)  # the observer and the kept connection
            assert state["peers"] == 2 and state["held_puts"] == 1
        finally:
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(timeout=60)
        state = quiet(observer, sessions=1)
        assert state["peers"] == 1
        assert state["held_connections"] == state["held_descriptors"] == 1
        assert _held(state) == dict.fromkeys(_held(state), 0)
        assert state["puts"] == state["loads"] == state["staged"] == state["tentative"] == 0


def test_a_reused_pid_shares_the_old_account_only_until_its_connections_end() -> None:
    """A process exits while its connection is still being torn down and a new process
    gets its pid: the new one is charged to the same client until the old connection is
    closed (a refusal meanwhile, typed, never more than the share), then has the whole
    share; every budget and the peer are back to zero once both are gone."""
    from kvlife.server.limits import Ledger, Limits, budgets

    ledger = Ledger(budgets(Limits(session_put_share=0.5), arena_bytes=64 * 4096, descriptors=99))
    share = ledger.table["put_bytes"].session
    old = ledger.open(4242)
    ledger.take(old, {"connections": 1, "put_bytes": share}, "the old process")
    new = ledger.open(4242)  # the pid reused before the old connection was closed
    with pytest.raises(LimitExceeded, match="2 connection"):
        ledger.take(new, {"put_bytes": 4096}, "the new process")
    assert ledger.peers == 1
    ledger.close(old)
    ledger.take(new, {"connections": 1, "put_bytes": share}, "the new process")
    ledger.close(new)
    figures = ledger.figures()
    assert figures["peers"] == 0
    assert {k: v for k, v in figures.items() if k.startswith("held_")} == dict.fromkeys(
        (k for k in figures if k.startswith("held_")), 0
    )


# ---------------------------------------------------------------------- identities

_FIELD_VALUES = st.sampled_from(["a", "b", "\u00ff", "y\u0308", "A", "a ", ""])


@settings(max_examples=60, deadline=None)
@example([("model_id", "\u00ff", 1, False), ("model_id", "y\u0308", 1, False)], 12000)
@example([("weights_digest", "a", 2, False), ("weights_digest", "a ", 2, False)], 12000)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["model_id", "weights_digest", "adapter", "engine_digest", "tp"]),
            _FIELD_VALUES,
            st.integers(1, 3),
            st.booleans(),
        ),
        min_size=1,
        max_size=40,
    ),
    st.integers(2048, 12000),
)
def test_the_identity_cache_returns_what_a_fresh_decode_returns(
    steps: list[tuple[str, str, int, bool]], limit: int
) -> None:
    """Identities differing in one field (strings that differ only in case, a trailing
    space, composed or decomposed unicode; a layout int; the field order), through one
    cache of a small budget: every get equals a fresh decode of the same map, and the
    cache is never charged more than its budget nor other than its entries."""
    from kvlife.server.identities import IdentityCache

    cache = IdentityCache(limit)
    base = protocol.encode_identity(tiny_identity())
    for field, value, heads, flip in steps:
        raw = {**base, "layout": {**base["layout"], "num_kv_heads": heads}}
        if field == "adapter":
            raw["adapter_id"], raw["adapter_digest"] = (value, value) if value else ("", "")
        elif field == "tp":
            raw["layout"]["tokens_per_chunk"] = 16 * heads
        elif value or field == "engine_digest":
            raw[field] = value
        if flip:
            raw = dict(reversed(list(raw.items())))
        got = cache.get(raw)
        assert got == protocol.decode_identity(raw)
        assert got.digest == protocol.decode_identity(raw).digest
        assert cache.nbytes <= limit
        assert cache.nbytes == sum(cost for _, cost in cache._entries.values())


def _raw_lookup(conn: Raw, rid: int, identity: dict[str, Any], tokens: bytes) -> list[Any]:
    conn.send(rid, "lookup", {"identity": identity, "namespace": "public", "tokens": tokens})
    return conn.reply()


@pytest.mark.parametrize(
    "change",
    [
        {"weights_digest": "w1"},
        {"tokenizer_digest": "t1"},
        {"model_id": "tiny2"},
        {"position_encoding_digest": "p"},
        {"adapter_id": "a", "adapter_digest": "d"},
        {"engine_digest": "e"},
        {"model_id": "tin\u0079\u0308"},  # y + combining diaeresis, not the composed \u00ff
        {"model_id": "tin\u00ff"},
    ],
)
def test_an_identity_differing_in_one_field_never_shares_an_entry(
    srv: ServerProc, change: dict[str, str]
) -> None:
    """A lookup with the cached identity warms the cache; the same prompt with an
    identity differing in one field (another session) must miss every chunk: an entry
    shared would hand it the first identity's keys (its KV)."""
    tokens, kv = prompt_kv(21, 4 * N)
    with srv.client() as a, srv.client() as b:
        a.put_prompt(tiny_identity(), PUBLIC, tokens, kv)
        assert len(a.lookup(tiny_identity(), PUBLIC, tokens).hits) == 4
        other = tiny_identity(**change)
        assert b.lookup(other, PUBLIC, tokens).hits == []
        assert b.get(other, PUBLIC, tokens).loaded == 0


def test_identity_field_types_and_order_on_the_wire(srv: ServerProc) -> None:
    """An int field sent as a bool or a float (equal in Python, the same hash: a cache
    key of them would be shared) is refused; a layout field sent in another order is
    the same identity (same keys)."""
    tokens, kv = prompt_kv(22, 4 * N)
    base = protocol.encode_identity(tiny_identity())
    with srv.client() as client:
        client.put_prompt(tiny_identity(), PUBLIC, tokens, kv)
        raw = Raw(srv.socket)
        try:
            tok = np.asarray(tokens, "<u4").tobytes()
            ok = _raw_lookup(raw, 1, base, tok)
            assert ok[1] is True
            ints = [k for k, v in base["layout"].items() if type(v) is int]
            assert ints
            rid = 2
            for name in ints:
                for bad in (True, float(base["layout"][name])):
                    ident = {**base, "layout": {**base["layout"], name: bad}}
                    r = _raw_lookup(raw, rid, ident, tok)
                    rid += 1
                    assert r[1] is False, f"{name}={bad!r} accepted"
            flipped = {**base, "layout": dict(reversed(list(base["layout"].items())))}
            flipped = dict(reversed(list(flipped.items())))
            r = _raw_lookup(raw, rid, flipped, tok)
            assert r[1] is True and r[2] == ok[2]
        finally:
            raw.close()


def test_identity_cache_stays_within_its_budget_under_many_clients(tmp_path: Path) -> None:
    """Distinct identities from several connections: the cache never holds more than
    ``--identity-cache-bytes``, and a pushed-out identity is decoded again (right
    keys: a put under it is found after the flood)."""
    s = ServerProc(tmp_path / "store", extra=("--identity-cache-bytes", "20000")).start()
    try:
        tokens, kv = prompt_kv(23, 2 * N)
        with s.client() as client:
            client.put_prompt(tiny_identity(), PUBLIC, tokens, kv)
            base = protocol.encode_identity(tiny_identity())
            conns = [Raw(s.socket) for _ in range(3)]
            try:
                rid = 1
                for c, conn in enumerate(conns):
                    for j in range(40):
                        ident = {**base, "model_id": f"m{c}-{j}".ljust(200, "z")}
                        assert _raw_lookup(conn, rid, ident, b"\0" * 64)[1] is True
                        rid += 1
            finally:
                for conn in conns:
                    conn.close()
            assert len(client.lookup(tiny_identity(), PUBLIC, tokens).hits) == 2
    finally:
        assert s.stop() == 0


# ---------------------------------------------------------------------- audits, bodies

AUDITOR = textwrap.dedent(
    """
    import sys, threading
    from kvlife.client import RemoteStore
    from kvlife.core.errors import LimitExceeded

    stores = [RemoteStore(sys.argv[1], timeout=60) for _ in range(4)]
    outcomes = []
    def audit(s):
        try:
            for _ in range(5):
                s.check()
            outcomes.append("ok")
        except LimitExceeded as exc:
            outcomes.append("refused" if "--audits" in str(exc) else repr(exc))
    ts = [threading.Thread(target=audit, args=(s,)) for s in stores]
    for t in ts: t.start()
    for t in ts: t.join()
    print(" ".join(sorted(outcomes)), flush=True)
    """
)


def test_audits_of_one_process_on_several_connections_stay_bounded(srv: ServerProc) -> None:
    """Four connections of one process audit at once, with ``--audits 1``: whatever
    runs, no more than one audit is held at a time (a refusal is typed and names the
    flag), and the audit budget is back to zero after."""
    with srv.client() as client:
        tokens, kv = prompt_kv(31, 64 * N)
        client.put_prompt(tiny_identity(), PUBLIC, tokens, kv)
        out = subprocess.run(
            [sys.executable, "-c", AUDITOR, str(srv.socket)],
            cwd=ROOT,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        words = out.stdout.split()
        assert len(words) == 4 and set(words) <= {"ok", "refused"}, out.stdout
        state = quiet(client)
        assert state["held_audits"] == 0 and state["limit_audits"] == 1


def test_bodies_of_one_process_on_two_connections_share_its_bound(tmp_path: Path) -> None:
    """``--session-bodies-bytes`` binds the process: two of its connections each start
    a body of 3/4 of the bound and stall; the second is refused (typed, counted), the
    first, completed, is served."""
    bound = 4 << 20
    s = ServerProc(tmp_path / "store", extra=("--session-bodies-bytes", str(bound))).start()
    try:
        # a lookup whose tokens make the body 3 MiB: refused for its args or served, but
        # it is the body budget that counts while it arrives
        tokens = b"\0" * (3 << 20)
        ident = protocol.encode_identity(tiny_identity())
        msg = protocol.pack(
            [5, "lookup", {"identity": ident, "namespace": "public", "tokens": tokens}]
        )
        a, b = Raw(s.socket), Raw(s.socket)
        try:
            a.sock.sendall(msg[: 1 << 20])  # a's body is charged, then stalls
            b.sock.sendall(msg)  # the same process: its share is taken by a
            rb = b.reply()
            assert rb[1] is False and "session-bodies-bytes" in str(rb[2]), rb
            a.sock.sendall(msg[1 << 20 :])
            ra = a.reply()
            assert ra[0] == 5
        finally:
            a.close()
            b.close()
        with s.client() as client:
            state = quiet(client)
            assert state["refused_bodies_bytes"] == 1 and state["held_bodies_bytes"] == 0
    finally:
        assert s.stop() == 0


def test_a_second_connection_racing_the_first_close_is_charged_once(srv: ServerProc) -> None:
    """Connections of one process opened and closed back to back, 50 times, each
    holding a pending put: the process never holds more than one connection's worth
    for long, the peer is forgotten at the end, and a put after it is not refused."""
    ident = tiny_identity()
    tokens, kv = prompt_kv(41, 8 * N)
    with srv.client() as observer:
        prev = None
        for i in range(50):
            cur = srv.client()
            t, k = prompt_kv(1000 + i, 8 * N)
            cur.prepare_put(ident, PUBLIC, t, k)
            if prev is not None:
                prev.close()
            prev = cur
        assert prev is not None
        prev.close()
        state = quiet(observer)
        assert state["peers"] == 1 and _held(state) == dict.fromkeys(_held(state), 0)
        try:
            assert observer.put_prompt(ident, PUBLIC, tokens, kv).stored == 8
        except KVLifeError as exc:  # pragma: no cover - the failure this test is for
            pytest.fail(f"refused after the churn: {exc}")

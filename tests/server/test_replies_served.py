"""A load or put reply the client cannot read is a ProtocolError with nothing kept: a
real ``kvlife serve``'s reply with one field garbled on the way (left out, of another
type, or out of its bounds) is refused whole, the connection dropped so that the server
releases what the session held for it (a grant, a pending put, staged extents), and the
next call, ungarbled, is answered as before."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvlife.client import RemoteStore
from kvlife.core.errors import ProtocolError
from kvlife.core.identity import PUBLIC
from tests.conftest import TINY, prompt_kv, tiny_identity
from tests.server.conftest import ServerProc, quiet

N = TINY.tokens_per_chunk
GRANT = [0, "<f2", [1]]
BAD_GRANTS = [
    None,
    "grants",
    [GRANT] * 5,  # more than the hits
    [["0", "<f2", [1]]],
    [[-4096, "<f2", [1]]],
    [[0.5, "<f2", [1]]],
    [[0, "O", [1]]],
    [[0, "no dtype", [1]]],
    [[0, 5, [1]]],
    [[0, "<f2", "shape"]],
    [[0, "<f2", [-1]]],
    [[0, "<f2"]],
    [[*GRANT, 1]],
]
BAD_TIERS: list[object] = [KeyError, [], {"dram": "1"}, {1: 1}, {"dram": -1}]
BAD_CORRUPT: list[object] = [KeyError, "keys", b"abc", []]
COUNTS = ["load", "streamed", "requested", "vanished", "read_errors"]
LOAD_CASES: list[tuple[str, object]] = [
    *((f, v) for f in COUNTS for v in (KeyError, "1", -1, 1.5, None, True)),
    ("streamed", 1),  # more than came in parts
    *(("grants", g) for g in [KeyError, *BAD_GRANTS]),
    *(("confirmed", v) for v in ("1", -1, 1.5, None, 99)),
    *(("tiers", v) for v in BAD_TIERS),
    *(("corrupt", v) for v in BAD_CORRUPT),
]
PUT_COUNTS = ["chunks", "stored", "already_present", "in_flight", "dropped"]
PUT_CASES: list[tuple[str, str, object]] = [
    *(("prepare_put", f, v) for f in ("put", "present", "in_flight") for v in (KeyError, "1", -1)),
    *(("prepare_put", "keys", v) for v in (KeyError, "k", b"abc")),
    *(
        ("prepare_put", "slots", v)
        for v in (KeyError, None, [[0]], [[9, 0]], [[0, -1]], [[0, 0]] * 2)
    ),
    *(("prepare_put", "staged", v) for v in (None, [[1]], [["1", 0]], [[1, -1]])),
    *(("commit_put", f, v) for f in PUT_COUNTS for v in (KeyError, "1", -1, None)),
    *(("commit_put", "keys", v) for v in (KeyError, b"abc", None)),
    *(("put_commit", "staged", v) for v in (None, [[1]], [["1", 0]])),
    *(("put_commit", "stored", v) for v in (KeyError, "1")),
]


@pytest.fixture(scope="module")
def server(module_server: ServerProc) -> ServerProc:
    return module_server


@pytest.fixture(scope="module")
def client(module_client: RemoteStore) -> RemoteStore:
    return module_client


def _garble(
    monkeypatch: pytest.MonkeyPatch, remote: RemoteStore, verb: str, name: str, value: object
) -> list[str]:
    """Garble field ``name`` of the next reply to ``verb`` (once); the verbs answered."""
    wire = remote._wire
    real = wire.call_on
    seen: list[str] = []

    def garbled(v: str, args: dict[str, Any], *more: Any, **kw: Any) -> tuple[Any, Any]:
        r, conn = real(v, args, *more, **kw)
        seen.append(v)
        if v == verb and seen.count(v) == 1:
            r = dict(r)
            if value is KeyError:
                r.pop(name, None)
            else:
                r[name] = value
        return r, conn

    monkeypatch.setattr(wire, "call_on", garbled)
    return seen


def _held(remote: RemoteStore) -> dict[str, Any]:
    """The server's state once only this client's (new) session is left."""
    return quiet(remote)


@pytest.mark.parametrize("hinted", [False, True])
@pytest.mark.parametrize(("name", "value"), LOAD_CASES)
def test_a_load_reply_with_a_field_the_client_cannot_read_is_refused_keeping_nothing(
    client: RemoteStore, monkeypatch: pytest.MonkeyPatch, name: str, value: object, hinted: bool
) -> None:
    """The reply to a load of four chunks in DRAM (granted, or confirmed from the
    lookup's hints: ``hinted``, into buffers of the layout), one field garbled: a
    ProtocolError, no grant left held by the server, nothing in the caller's hands; the
    same load ungarbled loads the prompt's bytes. (On the client of 32a1b05 these
    failed with TypeError, KeyError or ValueError, after the grant's copies, or were
    read as they came: a ``confirmed`` of True, a negative count.)"""
    ident = tiny_identity(model_id="served-replies")
    tokens, kv = prompt_kv(31, 4 * N)
    client.put_prompt(ident, PUBLIC, tokens, kv)
    hit = client.lookup(ident, PUBLIC, tokens)
    assert len(hit.hits) == 4
    outs = [np.zeros(ident.layout.chunk_shape, np.float16) for _ in range(4)] if hinted else None
    with monkeypatch.context() as m:
        seen = _garble(m, client, "load", name, value)
        with pytest.raises(ProtocolError, match="load reply"):
            client.load(hit, outs)
        assert "load" in seen
    state = _held(client)
    assert state["loads"] == 0, state  # no grant held for the refused reply
    hit = client.lookup(ident, PUBLIC, tokens)  # the connection was dropped: new hints
    got = client.load(hit, outs)
    assert got.loaded == 4
    for i, a in enumerate(got.arrays):
        assert np.array_equal(a, kv[:, :, :, i * N : (i + 1) * N])
    client.invalidate(model="served-replies")


@pytest.mark.parametrize(("verb", "name", "value"), PUT_CASES)
def test_a_put_reply_with_a_field_the_client_cannot_read_is_refused_keeping_nothing(
    client: RemoteStore, monkeypatch: pytest.MonkeyPatch, verb: str, name: str, value: object
) -> None:
    """A put of four chunks (two-phase, asking for staged extents: ``prepare_put`` then
    ``commit_put``; then one into those: ``put_commit``), one field of one reply
    garbled: a ProtocolError, no pending put or staged extent left on the server, none
    kept by the client; the put ungarbled stores the prompt. (On the client of 32a1b05
    these failed with TypeError or KeyError, or were kept as they came: a put id or
    counts of another type, staged extents that were none.)"""
    ident = tiny_identity(model_id="served-put-replies")
    client.invalidate(model="served-put-replies")
    tokens, kv = prompt_kv(32, 4 * N)
    with client._wire.lock:  # a new session: no staged extents (a two-phase put)
        client._wire.drop()
    if verb == "put_commit":  # staged extents first, from an ungarbled two-phase put
        first, kv1 = prompt_kv(33, 4 * N)
        assert client.put_prompt(ident, PUBLIC, first, kv1).stored == 4
    with monkeypatch.context() as m:
        seen = _garble(m, client, verb, name, value)
        with pytest.raises(ProtocolError, match=f"{verb} reply|put reply"):
            client.put_prompt(ident, PUBLIC, tokens, kv)
        assert verb in seen
    state = _held(client)
    assert state["puts"] == 0 and state["staged"] == 0 and state["tentative"] == 0, state
    conn = client._wire.conn
    assert conn is not None and not any(conn.staged.values())
    client.put_prompt(ident, PUBLIC, tokens, kv)
    got = client.load(client.lookup(ident, PUBLIC, tokens))
    assert got.loaded == 4
    assert np.array_equal(got.arrays[3], kv[:, :, :, 3 * N :])
    client.invalidate(model="served-put-replies")

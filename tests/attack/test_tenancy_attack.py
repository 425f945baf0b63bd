"""Attacks on tenants (``kvlife serve --tenants``, kvlife/tenancy, kvlife/server/context.py):
can a principal read, detect, overwrite, evict or invalidate another principal's KV?

The sessions here are the server's own (:class:`~kvlife.server.session.Session` over a
real store and a real :class:`~kvlife.tenancy.Tenancy`, as ``kvlife serve`` builds them)
driven in-process, so that an interleaving two connections can produce (a commit of one
between the checks and the load of the other) is produced deterministically."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvlife.client import RemoteStore
from kvlife.core.errors import InvalidArgument, NotAuthenticated, NotPermitted, ProtocolError
from kvlife.core.identity import (
    PUBLIC,
    ChunkKey,
    Namespace,
    NamespaceKind,
    prompt_chunk_keys,
)
from kvlife.server import protocol
from kvlife.server.server import ServeConfig, open_store
from kvlife.server.session import ServerState, Session
from kvlife.store import KVStore
from kvlife.tenancy import Principal, Tenancy, token_digest
from kvlife.tenancy.principals import REFUSED
from kvlife.tiers.shm import ShmTier
from tests.conftest import TINY, prompt_kv, tiny_identity
from tests.server.conftest import MiB
from tests.server.tenants import TOKENS, tenant_server, write_config

IDENT = tiny_identity()
WIRE_IDENT = protocol.encode_identity(IDENT)
N = TINY.tokens_per_chunk
BRIEF_TOKEN = "brief-token-0123456789"
"""The token of a principal whose token expires a moment after the test starts."""


@pytest.fixture
def state(tmp_path: Path) -> Iterator[ServerState]:
    path = tmp_path / "store"
    store = open_store(ServeConfig(path, dram_bytes=2 * MiB, disk_bytes=8 * MiB, staging_bytes=MiB))
    shm = store.tier("dram")
    assert isinstance(shm, ShmTier)
    brief = (
        "[principal.brief]\n"
        f'token_sha256 = "{token_digest(BRIEF_TOKEN)}"\n'
        f"token_expires = {time.time() + 1.5}\n"
    )
    tenancy = Tenancy.open(path, write_config(tmp_path / "tenants.toml", brief))
    srv = ServerState(store, shm, "none", tenancy=tenancy)
    yield srv
    store.close()


def session(srv: ServerState, token: str) -> Session:
    s = srv.open_session()
    s.handle("hello", {"version": protocol.PROTOCOL_VERSION, "token": token})
    return s


def principal(srv: ServerState, name: str) -> Principal:
    assert srv.tenancy is not None
    p = srv.tenancy.config.by_name(name)
    assert p is not None
    return p


def keyed(srv: ServerState, name: str, kind: NamespaceKind = NamespaceKind.USER) -> Namespace:
    """The stored namespace of ``name``'s scope ``kind`` (what the server keys)."""
    assert srv.tenancy is not None
    return srv.tenancy.scopes.namespace(principal(srv, name), kind)


def tokens_wire(tokens: np.ndarray) -> bytes:
    return np.asarray(tokens, dtype="<u4").tobytes()


def load_args(keys: list[ChunkKey]) -> dict[str, Any]:
    return {
        "keys": b"".join(keys),
        "starts": [i * N for i in range(len(keys))],
        "chunks_total": len(keys),
    }


def indexed(store: KVStore) -> set[ChunkKey]:
    return set(store.indexed_keys())


# ---------------------------------------------------------------- broke, then fixed


def test_a_load_of_a_key_stored_between_its_check_and_its_read_is_a_miss(
    state: ServerState, monkeypatch: pytest.MonkeyPatch
) -> None:
    """alice learnt bob's keys (however: they are keyed, she cannot compute them) and
    loads them while bob's chunks are gone, e.g. evicted. The server checks a load's keys
    (``namespaces_of``) and then loads under another hold of the store's lock; bob's put
    of the same prompt committing in between (a second connection's request) must not
    hand alice bob's KV. Before the fix a key the store did not know at the check was
    let through, and the load served bob's chunks to alice."""
    store = state.store
    tokens, kv = prompt_kv(11, 4 * N)
    bob_ns = keyed(state, "bob")
    stolen = prompt_chunk_keys(IDENT, bob_ns, tokens)
    alice = session(state, TOKENS["alice"])
    real = type(store).namespaces_of
    fired: list[int] = []

    def check_then_bob_commits(self: KVStore, keys: list[ChunkKey]) -> list[str | None]:
        got = real(self, keys)
        if not fired:  # once: bob's put lands right after alice's check
            fired.append(1)
            assert self.put_prompt(IDENT, bob_ns, tokens, kv).stored == 4
        return got

    # token-only principals map no arena: their loads carry the bytes in the reply
    monkeypatch.setattr(type(store), "namespaces_of", check_then_bob_commits)
    reply = alice.handle("load", {**load_args(stolen), "inline": True})
    monkeypatch.undo()
    assert fired
    assert isinstance(reply, dict)
    assert reply["inline"] == [] and reply["grants"] == [], "alice was handed bob's KV"
    # bob's chunks are stored, and his own load of them still serves them
    bob = session(state, TOKENS["bob"])
    mine = bob.handle("load", {**load_args(stolen), "inline": True})
    assert isinstance(mine, dict) and len(mine["inline"]) >= 1
    assert mine["inline"][0][2] == np.ascontiguousarray(kv[:, :, :, :N]).tobytes()


def test_an_expired_token_ends_the_sessions_it_opened(state: ServerState) -> None:
    """A token past ``token_expires`` is refused at ``hello``; a session that said
    hello with it before it expired must not go on being served as its principal
    (before the fix it was, for as long as the connection lived)."""
    brief = session(state, BRIEF_TOKEN)
    tokens, _ = prompt_kv(12, 2 * N)
    lookup = {"identity": WIRE_IDENT, "namespace": "user", "tokens": tokens_wire(tokens)}
    assert brief.handle("lookup", lookup)["keys"] == b""  # type: ignore[index]
    p = principal(state, "brief")
    assert p.token_expires is not None
    time.sleep(max(0.0, p.token_expires - time.time()) + 0.05)
    for verb, args in (
        ("lookup", lookup),
        ("counters", {}),
        ("info", {}),
        ("state", {}),
        ("invalidate", {"namespace": "user:brief"}),
    ):
        with pytest.raises(NotAuthenticated) as err:
            brief.handle(verb, args)
        assert str(err.value) == REFUSED
    # and a new hello with it is refused as before
    with pytest.raises(NotAuthenticated):
        session(state, BRIEF_TOKEN)
    # a principal whose token has no expiry is not affected
    alice = session(state, TOKENS["alice"])
    assert alice.handle("lookup", lookup)["keys"] == b""  # type: ignore[index]


# ---------------------------------------------------------------- held


ODD_SCOPES = [
    "user:bob",
    "user:Alice",
    "User",
    "USER",
    "\uff55ser",  # fullwidth u
    "user:alice\u200b",  # zero-width space
    "user:al\u0456ce",  # Cyrillic i
    "user:alice:bob",
    "user:alice/x",
    "user:",
    "",
    ":",
    "organisation:globex",
    "organisation:",
    "public:",
    "public:x",
    "request",
    "request:",
    "request:bob/r1",
    "request:../bob",
    "request:r1/../../bob",
    "request:" + "a" * 129,
    "user:" + "a" * 100_000,
    "x" * 100_000,
]


def test_odd_scope_spellings_are_refused_typed_and_reach_nobody(state: ServerState) -> None:
    """Every spelling of a scope that is not one of alice's own is refused
    (InvalidArgument or NotPermitted) by lookup, put and invalidate, and leaves bob's
    chunks stored and his."""
    store = state.store
    tokens, kv = prompt_kv(13, 2 * N)
    bob_keys = store.put_prompt(IDENT, keyed(state, "bob"), tokens, kv).keys
    alice = session(state, TOKENS["alice"])
    before = indexed(store)
    for text in ODD_SCOPES:
        prompt = {"identity": WIRE_IDENT, "namespace": text, "tokens": tokens_wire(tokens)}
        for verb, args in (
            ("lookup", prompt),
            ("prepare_put", prompt),
            ("invalidate", {"namespace": text}),
            ("invalidate", {"namespace": text, "prefix": bob_keys[0]}),
        ):
            with pytest.raises((InvalidArgument, NotPermitted)) as err:
                alice.handle(verb, args)
            assert "bob" not in str(err.value) or "bob" in text
    assert indexed(store) == before
    assert store.namespaces_of(bob_keys) == ["user:bob"] * 2


def test_a_prefix_invalidation_reaches_only_its_own_namespace(state: ServerState) -> None:
    """bob's prefix (a key alice may not read) is refused with the message of an unknown
    key; alice's prefix invalidation from a public chunk that bob chained his own chunks
    after takes alice's chunks only."""
    store = state.store
    tokens, kv = prompt_kv(14, 4 * N)
    shared = store.put_prompt(IDENT, PUBLIC, tokens[: 2 * N], kv[:, :, :, : 2 * N]).keys
    after = {"start": 2 * N, "parent": shared[-1]}
    rest, rest_kv = tokens[2 * N :], kv[:, :, :, 2 * N :]
    bobs = store.put_prompt(IDENT, keyed(state, "bob"), rest, rest_kv, **after).keys  # type: ignore[arg-type]
    alices = store.put_prompt(IDENT, keyed(state, "alice"), rest, rest_kv, **after).keys  # type: ignore[arg-type]
    alice = session(state, TOKENS["alice"])
    refusals = []
    for prefix in (bobs[0], bytes([9]) * 32):
        with pytest.raises(NotPermitted) as err:
            alice.handle("invalidate", {"namespace": "user:alice", "prefix": prefix})
        refusals.append(str(err.value))
    assert refusals[0] == refusals[1]
    gone = alice.handle("invalidate", {"namespace": "user:alice", "prefix": shared[0]})
    assert gone == 2
    # the scope is named as a lookup or a put names it (``user``), or in full
    again = store.put_prompt(IDENT, keyed(state, "alice"), rest, rest_kv, **after)  # type: ignore[arg-type]
    assert again.stored == 2
    assert alice.handle("invalidate", {"namespace": "user", "prefix": shared[0]}) == 2
    left = indexed(store)
    assert set(shared) <= left and set(bobs) <= left and not set(alices) & left


def test_a_grant_of_one_connection_is_nobody_elses(state: ServerState) -> None:
    """Two connections of one process with two tokens: a token-only session maps no
    arena, so it takes no load grant at all (a grant would name bytes in a mapping it
    does not have), and no session can release a load id it was not given (ids are per
    session)."""
    store = state.store
    tokens, kv = prompt_kv(15, 2 * N)
    keys = store.put_prompt(IDENT, keyed(state, "bob"), tokens, kv).keys
    bob, alice = session(state, TOKENS["bob"]), session(state, TOKENS["alice"])
    with pytest.raises(NotPermitted):
        bob.handle("load", load_args(keys))
    inline = bob.handle("load", {**load_args(keys), "inline": True})
    assert isinstance(inline, dict) and inline["load"] == 0 and inline["inline"]
    for load_id in (0, 1, 2):
        with pytest.raises(ProtocolError):
            alice.handle("release", {"load": load_id})


def test_a_forged_salt_key_reaches_no_other_tenants_keys(tmp_path: Path) -> None:
    """The embedded API: a namespace keyed with anything but the store's secret (or
    unkeyed) names other keys than the server's, so bob's prompt is a miss for it."""
    path = tmp_path / "store"
    store = open_store(ServeConfig(path, dram_bytes=2 * MiB, disk_bytes=0, staging_bytes=MiB))
    try:
        tenancy = Tenancy.open(path, write_config(tmp_path / "t.toml"))
        bob = tenancy.config.by_name("bob")
        assert bob is not None
        real = tenancy.scopes.namespace(bob, NamespaceKind.USER)
        tokens, kv = prompt_kv(16, 2 * N)
        assert store.put_prompt(IDENT, real, tokens, kv).stored == 2
        for forged in (
            Namespace(NamespaceKind.USER, "bob"),
            Namespace(NamespaceKind.USER, "bob", salt_key=bytes(32)),
            Namespace(NamespaceKind.USER, "bob", salt_key=tenancy.scopes.secret[::-1]),
        ):
            assert store.lookup(IDENT, forged, tokens).hits == []
        assert len(store.lookup(IDENT, real, tokens).hits) == 2
    finally:
        store.close()


def test_a_tenants_invalidate_by_model_or_adapter_stays_in_its_namespace(
    state: ServerState,
) -> None:
    """alice invalidates by model version (and adapter) naming her namespace: bob's
    chunks and public ones of that model stay; naming no namespace is refused whatever
    the other criteria, and removes nothing."""
    store = state.store
    tokens, kv = prompt_kv(17, 2 * N)
    bobs = store.put_prompt(IDENT, keyed(state, "bob"), tokens, kv).keys
    public = store.put_prompt(IDENT, PUBLIC, tokens, kv).keys
    alices = store.put_prompt(IDENT, keyed(state, "alice"), tokens, kv).keys
    alice = session(state, TOKENS["alice"])
    digest = IDENT.weights_digest
    for args in ({"weights_digest": digest}, {"adapter_id": "x"}, {"prefix": public[0]}):
        with pytest.raises(NotPermitted):
            alice.handle("invalidate", args)
    assert indexed(store) == set(bobs) | set(public) | set(alices)
    assert alice.handle("invalidate", {"namespace": "user:alice", "weights_digest": digest}) == 2
    assert indexed(store) == set(bobs) | set(public)


def test_one_token_names_at_most_one_principal(tmp_path: Path) -> None:
    """A configuration giving two principals one token is refused, as one uid for two
    is (before the fix the token named whichever principal came last, silently: the
    first one's holder was the second)."""
    twice = f'[principal.alice2]\ntoken_sha256 = "{token_digest(TOKENS["alice"])}"\n'
    with pytest.raises(InvalidArgument, match="belongs to alice and alice2"):
        Tenancy.open(tmp_path, write_config(tmp_path / "t.toml", twice))


def test_an_expired_token_ends_a_real_servers_connection(tmp_path: Path) -> None:
    """The same through ``kvlife serve`` and its client: a connection that said hello
    before its token expired gets NotAuthenticated (one message) after. The token lives
    3 s, time for the server to start and the put; where the machine was too slow for
    that (the hello or the put already refused), again with more room."""
    for room in (3.0, 10.0, 30.0):
        expires = time.time() + room
        brief = (
            "[principal.brief]\n"
            f'token_sha256 = "{token_digest(BRIEF_TOKEN)}"\n'
            f"token_expires = {expires}\n"
        )
        work = tmp_path / f"room-{room:g}"
        work.mkdir()
        srv = tenant_server(work / "store", write_config(work / "t.toml", brief)).start()
        try:
            tokens, kv = prompt_kv(18, 2 * N)
            try:
                client = RemoteStore(srv.socket, timeout=30, token=BRIEF_TOKEN)
            except NotAuthenticated:
                assert time.time() >= expires, "refused before the token expired"
                continue
            with client:
                try:
                    stored = client.put_prompt(
                        IDENT, Namespace(NamespaceKind.USER, "brief"), tokens, kv
                    )
                except NotAuthenticated:
                    assert time.time() >= expires, "refused before the token expired"
                    continue
                assert stored
                time.sleep(max(0.0, expires - time.time()) + 0.1)
                with pytest.raises(NotAuthenticated) as err:
                    client.lookup(IDENT, Namespace(NamespaceKind.USER, "brief"), tokens)
                assert str(err.value) == REFUSED
                return
        finally:
            srv.stop()
    pytest.fail("the server never started and served a put within 30 s of a token's life")

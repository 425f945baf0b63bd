"""Tenants enforced by ``kvlife serve --tenants``: principals from tokens and from the
peer's Unix credentials, keyed namespaces, scopes, the admin's authority over public
KV and the store-wide verbs, and the typed refusals of bad input (nothing stored,
nothing revealed)."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvlife.client import RemoteStore
from kvlife.core.errors import (
    InvalidArgument,
    NotAuthenticated,
    NotPermitted,
    ProtocolError,
)
from kvlife.core.identity import PUBLIC, ChunkKey, Namespace, NamespaceKind
from kvlife.results import LookupResult
from kvlife.tenancy.principals import REFUSED
from kvlife.tenancy.secret import SECRET_FILE
from tests.conftest import prompt_kv, tiny_identity
from tests.server.conftest import ROOT, ServerProc, child_env
from tests.server.tenants import ORG, TOKENS, USER, as_, tenant_server, write_config

IDENT = tiny_identity()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[ServerProc]:
    srv = tenant_server(tmp_path / "store", write_config(tmp_path / "tenants.toml")).start()
    yield srv
    srv.stop()


def objects(server: ServerProc) -> int:
    with as_(server, "root") as admin:
        return int(admin.info().objects_by_state.get("indexed", 0))


def test_a_token_names_the_principal_and_a_bad_one_gets_nothing(served: ServerProc) -> None:
    with as_(served, "alice") as alice:
        assert alice.server_info()["principal"]["name"] == "alice"
    # forged, expired, or none (this Unix user is no principal): one typed refusal,
    # one message, before anything is served
    for token in ("alice-token-0123456788", TOKENS["old"], None):
        with pytest.raises(NotAuthenticated) as err:
            RemoteStore(served.socket, timeout=30, token=token)
        assert str(err.value) == REFUSED
    # the socket lets any local user connect: each is mapped, or refused
    assert stat.S_IMODE(served.socket.stat().st_mode) == 0o666
    secret = served.path / SECRET_FILE
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and secret.stat().st_size == 32


def test_tenants_never_share_keys_and_public_is_an_admins(served: ServerProc) -> None:
    tokens, kv = prompt_kv(1, 64)
    with as_(served, "alice") as alice, as_(served, "bob") as bob, as_(served, "root") as root:
        mine = alice.put_prompt(IDENT, USER["alice"], tokens, kv)
        assert mine.stored == 4
        assert len(alice.lookup(IDENT, USER["alice"], tokens).hits) == 4
        # bob's every scope misses alice's prompt, and his own copy is new
        assert bob.lookup(IDENT, USER["bob"], tokens).hits == []
        theirs = bob.put_prompt(IDENT, USER["bob"], tokens, kv)
        assert theirs.stored == 4 and set(theirs.keys).isdisjoint(mine.keys)
        # a lookup falls through to the organisation, then to public
        other, kv2 = prompt_kv(2, 64)
        assert alice.put_prompt(IDENT, ORG["alice"], other, kv2).stored == 4
        assert len(alice.lookup(IDENT, Namespace(NamespaceKind.REQUEST, "r9"), other).hits) == 4
        assert bob.lookup(IDENT, USER["bob"], other).hits == []
        # nobody but an admin writes public; nothing of a refused put is kept
        before = objects(served)
        with pytest.raises(NotPermitted):
            alice.put_prompt(IDENT, PUBLIC, other, kv2)
        assert objects(served) == before
        shared, kv3 = prompt_kv(3, 64)
        assert root.put_prompt(IDENT, PUBLIC, shared, kv3).stored == 4
        for who in (alice, bob):
            hit = who.lookup(IDENT, USER["bob" if who is bob else "alice"], shared)
            assert len(hit.hits) == 4
            got = who.load(hit)
            assert got.loaded == 4
            n = IDENT.layout.tokens_per_chunk
            for i, arr in enumerate(got.arrays):
                assert np.array_equal(arr, kv3[:, :, :, i * n : (i + 1) * n])


def test_another_tenants_namespace_or_a_bad_name_is_refused(served: ServerProc) -> None:
    tokens, kv = prompt_kv(4, 64)
    with as_(served, "alice") as alice:
        before = objects(served)
        for ns in (USER["bob"], Namespace(NamespaceKind.ORGANISATION, "globex")):
            with pytest.raises(NotPermitted):
                alice.put_prompt(IDENT, ns, tokens, kv)
            with pytest.raises(NotPermitted):
                alice.lookup(IDENT, ns, tokens)
        for rid in ("a/b", "x:y", "tab\there", "nl\n", "..", "-x", "é"):
            with pytest.raises(InvalidArgument):
                alice.put_prompt(IDENT, Namespace(NamespaceKind.REQUEST, rid), tokens, kv)
        assert objects(served) == before
        # the connection is still good after every refusal
        assert alice.put_prompt(IDENT, USER["alice"], tokens, kv).stored == 4


def test_a_load_of_another_tenants_keys_is_a_load_of_absent_keys(served: ServerProc) -> None:
    """bob got alice's keys somehow (they are keyed: he cannot compute them): loading
    them answers exactly as loading keys that are not stored."""
    tokens, kv = prompt_kv(5, 64)
    with as_(served, "alice") as alice, as_(served, "bob") as bob:
        alice.put_prompt(IDENT, USER["alice"], tokens, kv)
        stolen = alice.lookup(IDENT, USER["alice"], tokens)
        assert len(stolen.hits) == 4
        absent = LookupResult(
            [type(h)(h.index, bytes([7]) * 32, h.start, h.tier) for h in stolen.hits],  # type: ignore[arg-type]
            stolen.chunks_total,
            stolen.tokens_per_chunk,
        )
        a, b = bob.load(stolen), bob.load(absent)
        assert (a.loaded, a.arrays) == (b.loaded, b.arrays) == (0, [])
        assert alice.load(stolen).loaded == 4  # still alice's


def test_store_wide_verbs_are_an_admins_and_figures_are_per_principal(
    served: ServerProc,
) -> None:
    tokens, kv = prompt_kv(6, 64)
    with as_(served, "alice") as alice, as_(served, "bob") as bob, as_(served, "root") as root:
        alice.put_prompt(IDENT, USER["alice"], tokens, kv)
        alice.lookup(IDENT, USER["alice"], tokens)
        for verb in (lambda: bob.flush(), lambda: bob.evict("dram", 1), lambda: bob.check()):
            with pytest.raises(NotPermitted):
                verb()
        assert bob.server_state()["sessions"] == 1  # its own only
        with pytest.raises(NotPermitted):  # a count over everyone's objects: refused
            bob.invalidate(weights_digest="w0")
        assert bob.invalidate(namespace=USER["bob"]) == 0
        # a prefix must be a stored chunk bob may read: alice's or an unknown key alike
        alices = alice.lookup(IDENT, USER["alice"], tokens).hits[0].key
        for key in (alices, ChunkKey(bytes(32))):
            with pytest.raises(NotPermitted) as err:
                bob.invalidate(namespace=USER["bob"], prefix=key)
            assert "may read" in str(err.value)
        own = bob.put_prompt(IDENT, USER["bob"], tokens, kv).keys
        assert bob.invalidate(namespace=USER["bob"], prefix=own[2]) == 2
        mine = alice.counters
        assert (mine.puts, mine.chunks_stored, mine.lookups, mine.lookup_chunks_hit) == (
            1,
            4,
            2,
            8,
        )
        theirs = bob.info()
        assert theirs.objects_by_state == {} and theirs.counters["chunks_stored"] == 4
        assert all(t.used_bytes == 0 and "withheld" in t.details for t in theirs.tiers)
        full = root.server_info()
        assert full["objects_by_state"]["indexed"] == 6
        assert full["principals"]["alice"]["chunks_stored"] == 4
        assert root.counters.chunks_stored == 8
        root.flush()
        # an admin names any namespace in full
        assert root.invalidate(namespace=USER["alice"]) == 4
        assert alice.lookup(IDENT, USER["alice"], tokens).hits == []


def test_keys_survive_a_restart_with_the_same_secret(tmp_path: Path) -> None:
    srv = tenant_server(tmp_path / "store", write_config(tmp_path / "t.toml")).start()
    tokens, kv = prompt_kv(7, 64)
    try:
        with as_(srv, "alice") as alice:
            keys = alice.put_prompt(IDENT, USER["alice"], tokens, kv).keys
    finally:
        srv.stop()  # flushes to disk
    srv.start()
    try:
        with as_(srv, "alice") as alice, as_(srv, "bob") as bob:
            hit = alice.lookup(IDENT, USER["alice"], tokens)
            assert [h.key for h in hit.hits] == keys
            assert bob.lookup(IDENT, USER["bob"], tokens).hits == []
    finally:
        srv.stop()


_RAW_HELLO = textwrap.dedent(
    """
    import os, socket, sys, msgpack
    from kvlife.server import protocol
    os.setgroups([])
    os.setgid(int(sys.argv[3]))
    os.setuid(int(sys.argv[2]))
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sys.argv[1])
    s.sendall(protocol.pack([1, "hello", {"version": protocol.PROTOCOL_VERSION}]))
    reply = msgpack.unpackb(protocol.recv_frame(s), raw=False)
    print(repr(reply[1]), reply[2]["principal"] if reply[1] else reply[2][0])
    """
)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")
def test_a_second_unix_user_is_mapped_by_its_credentials(tmp_path: Path) -> None:
    """SO_PEERCRED: a process of uid 40123 is dave, of gid 40200 is erin (its group);
    another uid is nobody's. The uid is the kernel's word, not the client's."""
    extra = """
[principal.dave]
uids = [40123]

[principal.erin]
gids = [40200]
"""
    config = write_config(tmp_path / "t.toml", extra)
    # the socket in a directory other users can reach (pytest's is 0700)
    sockdir = Path(tempfile.mkdtemp(prefix="kvlife-tenants-"))
    os.chmod(sockdir, 0o755)
    srv = ServerProc(tmp_path / "store", extra=("--tenants", str(config)))
    srv.socket = sockdir / "s.sock"
    try:
        srv.start()
        out = {}
        for uid, gid in ((40123, 40123), (40124, 40200), (40125, 40125)):
            got = subprocess.run(
                [sys.executable, "-c", _RAW_HELLO, str(srv.socket), str(uid), str(gid)],
                cwd=ROOT,
                env=child_env(),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert got.returncode == 0, got.stderr
            out[uid] = got.stdout.split()
        assert out[40123] == ["True", "dave"]
        assert out[40124] == ["True", "erin"]
        assert out[40125] == ["False", "NotAuthenticated"]
    finally:
        srv.stop()
        for f in sockdir.iterdir():
            f.unlink()
        sockdir.rmdir()


def test_an_unauthenticated_connection_is_served_nothing_but_hello(served: ServerProc) -> None:
    from kvlife.server import protocol

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(str(served.socket))
        import msgpack

        for rid, verb in enumerate(("info", "counters", "flush", "hello"), start=1):
            args = {"version": protocol.PROTOCOL_VERSION} if verb == "hello" else {}
            s.sendall(protocol.pack([rid, verb, args]))
            body = protocol.recv_frame(s)
            assert body is not None
            reply = msgpack.unpackb(body, raw=False)
            assert reply[1] is False and reply[2][0] == "NotAuthenticated", (verb, reply)
        s.sendall(protocol.pack([9, "hello", {"version": 3, "token": "x" * 300}]))
        body = protocol.recv_frame(s)
        assert body is not None
        assert msgpack.unpackb(body, raw=False)[2][0] == ProtocolError.__name__


def test_an_embedded_process_names_its_tenant_and_the_server_agrees(tmp_path: Path) -> None:
    """The embedded store's process is trusted: it keys alice's namespace with the
    store's secret itself, and alice finds the KV through the server later."""
    from kvlife.core.identity import NamespaceKind as Kind
    from kvlife.store import KVStore
    from kvlife.tenancy import Principal, Scopes, store_secret

    path = tmp_path / "store"
    path.mkdir()
    tokens, kv = prompt_kv(8, 64)
    ns = Scopes(store_secret(path)).namespace(Principal("alice", organisation="acme"), Kind.USER)
    with KVStore.open(path, dram_bytes=8 << 20, disk_bytes=64 << 20) as store:
        keys = store.put_prompt(IDENT, ns, tokens, kv).keys
    srv = tenant_server(path, write_config(tmp_path / "t.toml")).start()
    try:
        with as_(srv, "alice") as alice, as_(srv, "bob") as bob:
            assert [h.key for h in alice.lookup(IDENT, USER["alice"], tokens).hits] == keys
            assert bob.lookup(IDENT, USER["bob"], tokens).hits == []
    finally:
        srv.stop()

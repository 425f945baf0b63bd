"""No existence oracle: two worlds, real ``kvlife serve --tenants`` processes that differ
only in whether tenant alice stored a secret prompt, and every non-timing observation of
tenant bob is the same in both.

bob observes everything a tenant can: lookups of the secret prompt (and of a prompt
sharing its first chunks) in every scope he may name, of his own and public prompts,
loads of what they found, a load of alice's very keys (the test computes them with the
store's secret, which no client has), a put chained after alice's last chunk (the wire's
``chained`` stores nothing when its parent is gone), a prompt put after alice's second
chunk and a prefix invalidation from her first (the store follows chains), his put of
the secret prompt itself, the errors of forbidden requests, ``info``, ``counters`` and
``state``, and his invalidation's count. The chained put and the prefix invalidation
were oracles until this test found them (each failed it; fixed in
:meth:`kvlife.server.context.SessionContext.visible` and ``Session.invalidate``).
The worlds share the store's secret (the same file in both store directories), so
keys are comparable.

Arena addresses are compared too: bob's principal has a Unix user (this process's), so
his sessions map his own arena (docs/server.md, "Tenants' arenas") and the ``hints`` of
a raw lookup reply and the offsets of his put's extents describe that arena only; they
must be the same in both worlds, up to the random point where an arena's allocation
generations start (each world's generations are compared relative to its first). alice
and the admin are principals by token only: they put and load through the socket.
(Before per-principal arenas the hints and offsets differed between the worlds: every
tenant's replicas shared one arena.) No event stream is
delivered to clients (lifecycle events go to the server's sink only), so there is none
to compare. Eviction by another tenant's burst is out of this test (ample DRAM): per-
tenant quotas are not built yet.
"""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path
from typing import Any

import msgpack

from kvlife.core.errors import KVLifeError
from kvlife.core.identity import PUBLIC, ChunkKey, Namespace, NamespaceKind, prompt_chunk_keys
from kvlife.core.objects import PromptRef, TierName
from kvlife.results import ChunkHit, LookupResult
from kvlife.server import protocol
from kvlife.tenancy import Principal, Scopes
from kvlife.tenancy.secret import SECRET_FILE
from tests.conftest import prompt_kv, tiny_identity
from tests.server.tenants import ORG, SCOPES_OF_BOB, TOKENS, USER, as_, tenant_server, write_config

IDENT = tiny_identity()
SECRET = bytes(range(100, 132))
"""The store's secret in both worlds."""
ALICE = Principal("alice", organisation="acme")


def _prompts() -> dict[str, Any]:
    secret, secret_kv = prompt_kv(100, 64)
    near = secret.copy()
    near[32:] = prompt_kv(101, 32)[0]  # the secret's first two chunks, then others
    return {
        "secret": (secret, secret_kv),
        "near": (near, prompt_kv(101, 64)[1]),
        "bob_own": prompt_kv(102, 64),
        "bob_org": prompt_kv(103, 64),
        "public": prompt_kv(104, 64),
        "alice_other": prompt_kv(105, 64),
        "bob_tail": prompt_kv(106, 64),
    }


def _hits(res: LookupResult) -> list[Any]:
    return [
        [h.key.hex(), h.tier, h.transform, h.exactness, h.stored_nbytes, h.decode_nbytes]
        for h in res.hits
    ] + [res.chunks_total, res.refused, res.refusal]


def _error(call: Any) -> Any:
    try:
        out = call()
    except KVLifeError as exc:
        return ["error", type(exc).__name__, str(exc)]
    return ["ok", out]


def _call(s: socket.socket, rid: int, verb: str, args: dict[str, Any]) -> Any:
    s.sendall(protocol.pack([rid, verb, args]))
    body = protocol.recv_frame(s)
    assert body is not None
    reply = msgpack.unpackb(body, raw=False)
    assert reply[1] is True, reply
    return reply[2]


def _as_bob(sock_path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(str(sock_path))
    _call(s, 1, "hello", {"version": protocol.PROTOCOL_VERSION, "token": TOKENS["bob"]})
    return s


def _raw_lookup(sock_path: Path, ns: Namespace, tokens: Any) -> dict[str, Any]:
    """bob's lookup as the wire answers it (every field)."""
    with _as_bob(sock_path) as s:
        out: dict[str, Any] = _call(
            s, 2, "lookup", protocol.encode_prompt(PromptRef(IDENT, ns, tokens))
        )
        return out


def _chained_put(sock_path: Path, tokens: Any, parent: bytes, addresses: list[Any]) -> list[Any]:
    """bob's put chained after ``parent`` (the wire's ``chained``: it stores nothing if
    its parent is gone), prepared and committed; the arena offsets of its extents go to
    ``addresses``."""
    with _as_bob(sock_path) as s:
        prompt = PromptRef(IDENT, USER["bob"], tokens, parent=ChunkKey(parent))
        args = protocol.encode_prompt(prompt)
        prepared = _call(s, 2, "prepare_put", {**args, "chained": True})
        slots = prepared.pop("slots")
        addresses.append(["slots", slots])
        committed = _call(s, 3, "commit_put", {"put": prepared.pop("put")})
        return [prepared, [i for i, _ in slots], committed]


def _world(base: Path, alice_stores_secret: bool) -> tuple[list[Any], list[Any], int]:
    """bob's observations, his arena addresses (hints, extents), and the admin's
    object count."""
    store = base / "store"
    store.mkdir(parents=True)
    fd = os.open(store / SECRET_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, SECRET)
    os.close(fd)
    p = _prompts()
    config = write_config(base / "tenants.toml", bob_uid=os.geteuid())
    srv = tenant_server(store, config).start()
    seen: list[Any] = []
    hints: list[Any] = []
    try:
        with as_(srv, "root") as root, as_(srv, "alice") as alice, as_(srv, "bob") as bob:
            root.put_prompt(IDENT, PUBLIC, *p["public"])
            alice.put_prompt(IDENT, USER["alice"], *p["alice_other"])
            if alice_stores_secret:
                for ns in (USER["alice"], ORG["alice"], Namespace(NamespaceKind.REQUEST, "q")):
                    alice.put_prompt(IDENT, ns, *p["secret"])
            bob.put_prompt(IDENT, USER["bob"], *p["bob_own"])
            bob.put_prompt(IDENT, SCOPES_OF_BOB[1], *p["bob_org"])
            for name in ("secret", "near", "bob_own", "bob_org", "public"):
                tokens = p[name][0]
                for ns in SCOPES_OF_BOB:
                    res = bob.lookup(IDENT, ns, tokens)
                    got = bob.load(res)
                    seen.append([name, str(ns), _hits(res), got.loaded])
                    seen.append([hashlib.sha256(a.tobytes()).hexdigest() for a in got.arrays])
                    raw = _raw_lookup(srv.socket, ns, tokens)
                    hints.append(["hints", raw.pop("hints")])
                    seen.append(raw)
            # alice's keys of the secret (bob could not compute them; the test can)
            scopes = Scopes(SECRET)
            for ns_text in ("user", "organisation", "request:q"):
                keys = prompt_chunk_keys(IDENT, scopes.named(ALICE, ns_text), p["secret"][0])
                stolen = LookupResult(
                    [ChunkHit(i, k, 16 * i, TierName("dram")) for i, k in enumerate(keys)],
                    len(keys),
                    16,
                )
                got = bob.load(stolen)
                seen.append(["stolen", ns_text, got.loaded, len(got.arrays)])
            # a put chained after alice's last chunk of the secret: whether it is live
            # must not show in what the put stores
            keys = prompt_chunk_keys(IDENT, scopes.named(ALICE, "user"), p["secret"][0])
            seen.append(_chained_put(srv.socket, p["bob_tail"][0], keys[-1], hints))
            # bob's prompt put after alice's second chunk, then invalidated from her
            # first: the chain between them is alice's, and must not be followed
            tail2, tail2_kv = prompt_kv(107, 64)
            after = bob.put_prompt(IDENT, USER["bob"], tail2, tail2_kv, start=32, parent=keys[1])
            seen.append(["after", after.stored, [k.hex() for k in after.keys]])
            seen.append(_error(lambda: bob.invalidate(namespace=USER["bob"], prefix=keys[0])))
            seen.append(len(bob.lookup(IDENT, USER["bob"], tail2, start=32, parent=keys[1]).hits))
            # forbidden requests
            secret_tokens, secret_kv = p["secret"]
            seen.append(_error(lambda: bob.put_prompt(IDENT, USER["alice"], *p["secret"])))
            seen.append(_error(lambda: bob.lookup(IDENT, ORG["alice"], secret_tokens)))
            seen.append(_error(lambda: bob.put_prompt(IDENT, PUBLIC, *p["secret"])))
            seen.append(_error(lambda: bob.invalidate(weights_digest=IDENT.weights_digest)))
            seen.append(_error(lambda: bob.flush()))
            # his own copy of the secret prompt: all new, no sign of alice's
            put = bob.put_prompt(IDENT, USER["bob"], secret_tokens, secret_kv)
            seen.append(["put", put.chunks, put.stored, put.already_present, put.in_flight])
            seen.append([put.dropped, [k.hex() for k in put.keys]])
            seen.append(bob.info().to_json())
            seen.append(bob.server_info())
            seen.append(bob.counters.as_dict())
            seen.append(bob.server_state())
            seen.append(bob.invalidate(namespace=USER["bob"]))
            seen.append(bob.counters.as_dict())
            admin_objects = int(root.info().objects_by_state.get("indexed", 0))
    finally:
        srv.stop()
    # the worlds differ only by paths: name them alike
    text = repr(seen).replace(str(base), "<world>")
    return [text], hints, admin_objects


def _relative(addresses: list[Any]) -> list[Any]:
    """Hints with each generation relative to the world's first (an arena's
    generations start at a random point, so that a stale hint names nothing)."""
    gens = [g for kind, h in addresses if kind == "hints" for g in h[1::2] if g]
    first = min(gens, default=0)
    out: list[Any] = []
    for kind, h in addresses:
        if kind == "hints":
            h = [x if i % 2 == 0 or not x else x - first for i, x in enumerate(h)]
        out.append([kind, h])
    return out


def test_bob_observes_nothing_of_alices_secret_prompt(tmp_path: Path) -> None:
    without, where0, objects0 = _world(tmp_path / "w0", alice_stores_secret=False)
    with_, where1, objects1 = _world(tmp_path / "w1", alice_stores_secret=True)
    assert objects1 == objects0 + 12  # the worlds do differ: alice's three copies
    assert with_ == without
    # bob's own arena: the same addresses in both worlds, and some DRAM hits among them
    assert _relative(where1) == _relative(where0)
    assert any(g for kind, h in where0 if kind == "hints" for g in h[1::2])

"""The message decoder and the verb handlers under hostile input: every frame either
decodes into a request whose fields all have their declared types and ranges, or raises
ProtocolError; every decoded request either succeeds or raises a typed KVLifeError
(never anything else, never a corrupted store). Plus a real client process that sends
garbage to a live server, which goes on serving."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlife.core.errors import InvalidArgument, KVLifeError, ProtocolError, RemoteError
from kvlife.core.identity import PUBLIC, Namespace, NamespaceKind
from kvlife.server import protocol
from kvlife.server.server import ServeConfig, open_store
from kvlife.server.session import ServerState
from kvlife.store import Accept
from kvlife.tiers.shm import ShmTier
from tests.conftest import TINY, budget, prompt_kv, tiny_identity
from tests.server.conftest import ROOT, MiB, ServerProc, child_env, quiet

values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=40)
    | st.binary(max_size=80),
    lambda inner: (
        st.lists(inner, max_size=6)
        | st.dictionaries(st.text(max_size=12) | st.integers(0, 5), inner, max_size=6)
    ),
    max_leaves=30,
)

IDENT = protocol.encode_identity(tiny_identity())
TOKENS = np.arange(3 * TINY.tokens_per_chunk, dtype="<u4").tobytes()
VALID: dict[str, dict[str, Any]] = {
    "hello": {"version": 1},
    "lookup": {"identity": IDENT, "namespace": "public", "tokens": TOKENS},
    "load": {"keys": b"\1" * 64, "starts": [0, 16], "chunks_total": 3},
    "release": {"load": 1},
    "alloc_buffer": {"nbytes": 4096},
    "free_buffer": {"buffer": 1},
    "prepare_put": {"identity": IDENT, "namespace": "public", "tokens": TOKENS},
    "commit_put": {"put": 1},
    "abort_put": {"put": 1},
    "invalidate": {"namespace": "user:x"},
    "evict": {"tier": "dram", "nbytes": 0},
    "flush": {},
    "info": {},
    "state": {},
    "stats": {"since": 0, "events": 8},
}


def check_typed(req: protocol.Request) -> None:
    """Every field of a decoded request has its declared kind."""
    schema = protocol.VERBS[req.verb]
    assert set(req.args) <= set(schema)
    for name, spec in schema.items():
        if spec.required:
            assert name in req.args
        if name in req.args and spec.kind == "int":
            v = req.args[name]
            assert type(v) is int and spec.lo <= v <= spec.hi


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_decode_or_raise_protocol_error(body: bytes) -> None:
    try:
        req = protocol.decode_request(body)
    except ProtocolError:
        return
    check_typed(req)


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 5), st.sampled_from([*sorted(protocol.VERBS), "nope", ""]), values)
def test_random_structures_decode_or_raise_protocol_error(rid: int, verb: str, args: Any) -> None:
    body = msgpack.packb([rid, verb, args], use_bin_type=True)
    try:
        req = protocol.decode_request(body)
    except ProtocolError:
        return
    check_typed(req)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(sorted(VALID)), st.data())
def test_one_bad_field_is_named(verb: str, data: st.DataObject) -> None:
    args = dict(VALID[verb])
    name = data.draw(st.sampled_from([*protocol.VERBS[verb], "bogus"]))
    args[name] = data.draw(values)
    try:
        req = protocol.decode_request(msgpack.packb([1, verb, args], use_bin_type=True))
    except ProtocolError as exc:
        # the field is named (a map with int keys is refused by the msgpack decoder)
        assert any(w in str(exc) for w in (name, "identity", "layout", "msgpack", "option"))
        return
    check_typed(req)


def test_identity_round_trips_the_wire_with_every_field() -> None:
    """The wire form is built from the dataclasses' own fields: nothing is dropped."""
    import dataclasses

    ident = tiny_identity(adapter_id="lora", adapter_digest="d")
    wire = protocol.encode_identity(ident)
    protocol.check_identity(wire)
    back = protocol.decode_identity(wire)
    assert back == ident and back.digest == ident.digest
    names = {f.name for f in dataclasses.fields(type(ident)) if f.init}
    assert set(wire) == names
    assert set(wire["layout"]) == {f.name for f in dataclasses.fields(TINY) if f.init}
    with pytest.raises(ProtocolError, match="exactly"):
        protocol.check_identity({**wire, "layout": {**wire["layout"], "extra": 1}})


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerState]:
    path = tmp_path_factory.mktemp("fuzz") / "store"
    store = open_store(ServeConfig(path, dram_bytes=2 * MiB, disk_bytes=8 * MiB, staging_bytes=MiB))
    shm = store.tier("dram")
    assert isinstance(shm, ShmTier)
    yield ServerState(store, shm, "none")
    store.close()


def _layout(sizes: list[int], dtype: str) -> dict[str, Any]:
    """A layout on the wire with hostile sizes (every other field as TINY's)."""
    lay = protocol.encode_layout(TINY)
    lay.update(num_layers=sizes[0], num_kv_heads=sizes[1], head_dim=sizes[2], dtype=dtype)
    lay["tokens_per_chunk"] = sizes[3]
    return lay


def _mutate(data: st.DataObject, verb: str) -> dict[str, Any]:
    """Schema-valid arguments with hostile values: unknown ids, huge layouts, other
    sessions' ids, tokens of odd length, bad namespaces, keys nobody stored."""
    args = dict(VALID[verb])
    if verb in ("lookup", "prepare_put"):
        lay = data.draw(st.lists(st.integers(1, 1 << 20), min_size=4, max_size=4))
        ident = dict(IDENT)
        ident["layout"] = _layout(lay, data.draw(st.sampled_from(["float16", "bf", "int8"])))
        ident["model_id"] = data.draw(st.sampled_from(["m", ""]))
        args["identity"] = ident
        args["tokens"] = data.draw(st.binary(max_size=64))
        args["namespace"] = data.draw(st.sampled_from(["public", "user:", "user:a", "x:y", ""]))
        args["start"] = data.draw(st.integers(0, 2**40))
    elif verb == "load":
        n = data.draw(st.integers(0, 4))
        args = {
            "keys": data.draw(st.binary(min_size=32 * n, max_size=32 * n)),
            "starts": data.draw(st.lists(st.integers(0, 100), min_size=0, max_size=5)),
            "chunks_total": data.draw(st.integers(0, 5)),
        }
        if data.draw(st.booleans()):
            lay = data.draw(st.lists(st.integers(1, 1 << 20), min_size=4, max_size=4))
            args["layout"] = _layout(lay, "float16")
        if data.draw(st.booleans()):  # targets in buffers this session may or may not own
            args["into"] = data.draw(st.lists(st.integers(0, 1 << 20), max_size=8))
    elif verb in ("release", "commit_put", "abort_put"):
        args = {"load" if verb == "release" else "put": data.draw(st.integers(1, 2**63 - 1))}
    elif verb == "alloc_buffer":
        args = {"nbytes": data.draw(st.integers(1, 1 << 36))}
    elif verb == "free_buffer":
        args = {"buffer": data.draw(st.integers(1, 50))}
    elif verb == "evict":
        args = {
            "tier": data.draw(st.sampled_from(["dram", "disk", "x"])),
            "nbytes": data.draw(st.integers(0, 1 << 60)),
        }
    elif verb == "invalidate":
        args = {"namespace": data.draw(st.sampled_from(["user:x", "bad", "public"]))}
    elif verb == "stats":
        args = {
            "since": data.draw(st.integers(0, 2**63 - 1)),
            "events": data.draw(st.integers(0, 256)),
        }
    return args


HANDLER_FUZZ = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}


@settings(max_examples=budget(20, 40), **HANDLER_FUZZ)  # type: ignore[arg-type]
@given(st.data())
def test_handlers_raise_only_typed_errors(state: ServerState, data: st.DataObject) -> None:
    fuzz_handlers(state, data)


@pytest.mark.slow
@settings(max_examples=1000, **HANDLER_FUZZ)  # type: ignore[arg-type]
@given(st.data())
def test_handlers_raise_only_typed_errors_long(state: ServerState, data: st.DataObject) -> None:
    fuzz_handlers(state, data)


def fuzz_handlers(state: ServerState, data: st.DataObject) -> None:
    """Random verbs with random (often invalid) arguments on one session: every refusal
    is a typed KVLifeError, nothing is left held, a kept prompt loads its own bytes or
    misses, and the store still works."""
    ident = tiny_identity()
    keep = Namespace(NamespaceKind.ORGANISATION, "keep")  # no mutation invalidates it
    tokens, kv = prompt_kv(1, 2 * TINY.tokens_per_chunk)
    state.store.put_prompt(ident, keep, tokens, kv)
    session = state.open_session()
    try:
        for _ in range(3):
            verb = data.draw(st.sampled_from(sorted(VALID)))
            args = _mutate(data, verb)
            body = msgpack.packb([1, verb, args], use_bin_type=True)
            try:
                req = protocol.decode_request(body)
                session.handle(req.verb, req.args)
            except RemoteError:
                raise
            except KVLifeError:
                pass
    finally:
        state.close_session(session)
    snap = state.snapshot()
    assert snap["puts"] == 0 and snap["loads"] == 0 and snap["tentative"] == 0
    got = state.store.load(state.store.lookup(ident, keep, tokens))  # evictions may miss
    n = TINY.tokens_per_chunk
    for i, arr in enumerate(got.arrays):  # but never serve wrong bytes
        assert np.array_equal(arr, kv[:, :, :, i * n : (i + 1) * n])
    state.store.put_prompt(ident, keep, tokens, kv)  # and the store still works
    assert state.store.get(ident, keep, tokens).loaded == 2


def test_garbage_from_a_client_process_gets_typed_errors(tmp_path: Path) -> None:
    srv = ServerProc(tmp_path / "store").start()
    try:
        out = subprocess.run(
            [sys.executable, "-m", "tests.server.workers", "garbage", str(srv.socket)],
            cwd=ROOT,
            env=child_env(),
            capture_output=True,
            timeout=120,
            check=True,
        )
        replies = json.loads(out.stdout)
        assert replies["not_msgpack"] == "ProtocolError"
        assert replies["unknown_verb"] == "ProtocolError"
        assert replies["wrong_type"] == "ProtocolError"
        assert replies["missing_field"] == "ProtocolError"
        assert replies["unknown_load"] == "ProtocolError"
        assert replies["unknown_put"] == "ProtocolError"
        assert replies["bad_identity"] == "InvalidArgument"
        assert replies["odd_tokens"] == "ProtocolError"
        assert replies["huge_frame"] == "ProtocolError"
        assert replies["huge_frame_closed"] is True
        # the server serves a well-behaved client afterwards, and holds no lease
        with srv.client() as client:
            tokens, kv = prompt_kv(3, 32)
            assert client.put_prompt(tiny_identity(), PUBLIC, tokens, kv).stored == 2
            assert client.get(tiny_identity(), PUBLIC, tokens).loaded == 2
            snap = quiet(client)
            assert snap["puts"] == snap["loads"] == snap["tentative"] == 0
    finally:
        assert srv.stop() == 0


@settings(max_examples=200, deadline=None)
@given(
    exactness=st.sampled_from(["exact", "lossless", "lossy"]),
    kl=st.none() | st.floats(0, 10),
    names=st.none() | st.lists(st.sampled_from(["int8", "int4", "lossless"]), max_size=3),
)
def test_an_accept_round_trips_on_the_wire(
    exactness: str, kl: float | None, names: list[str] | None
) -> None:
    accept = (
        Accept.lossy(max_kl=kl, transforms=names)
        if exactness == "lossy"
        else (Accept.EXACT if exactness == "exact" else Accept.LOSSLESS)
    )
    wire = msgpack.unpackb(msgpack.packb(protocol.encode_accept(accept)))
    protocol.check_accept(wire)
    assert protocol.decode_accept(wire) == accept


@settings(max_examples=300, deadline=None)
@given(value=values)
def test_a_hostile_accept_is_a_typed_error(value: object) -> None:
    try:
        protocol.check_accept(value)
    except ProtocolError:
        return
    assert isinstance(value, list)
    with contextlib.suppress(KVLifeError):  # bad values: a typed error, nothing else
        protocol.decode_accept(value)


def test_an_accept_of_sparse_replicas_is_refused_by_name() -> None:
    wire = ["lossy-sparse", None, None, None]
    protocol.check_accept(wire)  # well formed ...
    with pytest.raises(InvalidArgument, match="lossy-sparse"):
        protocol.decode_accept(wire)  # ... but no Accept takes sparse replicas

"""The served lookup in one pass (issue 28) answers what a plain per-chunk reference
answers: the DRAM tier's hints of every key at once against ``hint`` of each key; the
client's hit records of a reply against one record built per hit, call after call (the
records it keeps are reused only while they say the same); and a real ``kvlife serve``'s
lookups against the chunk keys and the stored prefixes of random prompts. A reply that
names a tier or a representation the client cannot read is a ProtocolError."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from kvlife.client import RemoteStore
from kvlife.client.handles import RemoteLookup
from kvlife.client.loads import Loads
from kvlife.core.errors import ProtocolError
from kvlife.core.identity import KEY_BYTES, PUBLIC, ChunkKey, prompt_chunk_keys
from kvlife.core.objects import TierName
from kvlife.results import ChunkHit
from kvlife.tiers.base import ReplicaMeta
from kvlife.tiers.shm import Arena, Owner, ShmTier
from tests.conftest import TINY, prompt_kv, tiny_identity
from tests.server.conftest import ServerProc

N = TINY.tokens_per_chunk
SETTINGS = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
FORMS = (
    ("exact", "exact", 1024, 0, 0.0),
    ("lossless", "lossless", 700, 1024, 0.0001),
    ("int4", "lossy", 300, 1024, 0.0002),
    ("int4", "lossy", 301, 1024, 0.0002),  # another size: another representation
)


@pytest.fixture(scope="module")
def server(module_server: ServerProc) -> ServerProc:
    return module_server


@pytest.fixture(scope="module")
def client(module_client: RemoteStore) -> RemoteStore:
    return module_client


def _loads(remote: RemoteStore) -> Loads:
    loads = remote._loads
    assert isinstance(loads, Loads)
    return loads


def reference(
    names: list[str], blob: bytes, tiers: list[int], forms: list[list[Any]], start: int, n: int
) -> list[ChunkHit]:
    """One hit record per hit, built from the reply's fields one at a time."""
    return [
        ChunkHit(
            i,
            ChunkKey(blob[i * KEY_BYTES : (i + 1) * KEY_BYTES]),
            start + i * n,
            TierName(names[t]),
            *f,
        )
        for i, (t, f) in enumerate(zip(tiers, forms, strict=True))
    ]


reply = st.integers(0, 12).flatmap(
    lambda count: st.tuples(
        st.binary(min_size=count * KEY_BYTES, max_size=count * KEY_BYTES),
        st.lists(st.integers(0, 1), min_size=count, max_size=count),
        st.lists(st.sampled_from(FORMS).map(list), min_size=count, max_size=count),
        st.integers(0, 4).map(lambda c: c * N),
    )
)


@SETTINGS
@given(replies=st.lists(reply, min_size=1, max_size=6), clear=st.booleans())
def test_client_hit_records_equal_one_record_per_hit(
    client: RemoteStore, replies: list[tuple[bytes, list[int], list[list[Any]], int]], clear: bool
) -> None:
    loads = _loads(client)
    names = list(loads.wire.names)
    if clear:
        loads._known.clear()
    for blob, tiers, forms, start in replies + replies:  # each reply twice: kept records
        got = loads._hits(blob, tiers, forms, start, N)
        assert got == reference(names, blob, tiers, forms, start, N)
        assert all(type(h) is ChunkHit for h in got)


@pytest.mark.parametrize("tier", [-1, 2, 255])
def test_a_reply_naming_a_tier_the_client_does_not_know_is_a_protocol_error(
    client: RemoteStore, tier: int
) -> None:
    loads = _loads(client)
    assert len(loads.wire.names) == 2
    with pytest.raises(ProtocolError, match="tier"):
        loads._hits(bytes(2 * KEY_BYTES), [0, tier], [list(FORMS[0])] * 2, 0, N)


def test_a_reply_with_a_representation_of_other_fields_is_a_protocol_error(
    client: RemoteStore,
) -> None:
    loads = _loads(client)
    loads._known.clear()
    with pytest.raises(ProtocolError, match="representation"):
        loads._hits(bytes(KEY_BYTES), [0], [["exact", "exact", 1024, 0]], 0, N)


junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.floats(allow_nan=False),
    st.text(max_size=3),
    st.binary(max_size=3),
    st.lists(st.integers(0, 2), max_size=2),
)
field = st.one_of(st.sampled_from(FORMS).map(list), st.lists(junk, max_size=6), junk)


@SETTINGS
@given(
    count=st.integers(0, 4),
    tiers=st.lists(st.one_of(st.integers(-1, 2), junk), max_size=5),
    forms=st.one_of(st.lists(field, max_size=5), junk),
    blob_kind=st.sampled_from(("bytes", "short", "text")),
)
def test_a_garbled_lookup_reply_is_a_protocol_error_or_the_records_it_says(
    client: RemoteStore, count: int, tiers: Any, forms: Any, blob_kind: str
) -> None:
    """Whatever a reply holds, the client answers the records it says (each field of
    its type) or raises ProtocolError, keeping nothing of a reply it refused."""
    loads = _loads(client)
    names = list(loads.wire.names)
    blob: Any = bytes(range(count)) * KEY_BYTES
    if blob_kind == "short":
        blob = blob[:-1]
    elif blob_kind == "text":
        blob = "k" * len(blob)
    before = dict(loads._known)
    try:
        got = loads._hits(blob, tiers, forms, 0, N)
    except ProtocolError:
        assert loads._known == before
        return
    assert got == reference(names, blob, tiers, forms, 0, N)
    for h in got:
        assert type(h.transform) is str and type(h.exactness) is str
        assert type(h.stored_nbytes) is int and type(h.decode_nbytes) is int
        assert type(h.decode_seconds) in (float, int)


@SETTINGS
@given(
    held=st.lists(st.sampled_from(("home", "other", "gone")), min_size=1, max_size=10),
    asked=st.lists(st.integers(0, 11), max_size=14),
)
def test_shm_hints_of_every_key_equal_the_hint_of_each(
    tmp_path_factory: pytest.TempPathFactory, held: list[str], asked: list[int]
) -> None:
    tmp = tmp_path_factory.mktemp("hints")
    tier = ShmTier(1 << 20, TierName("dram"), tmp / "a", 1 << 20)
    other = Arena(tmp / "b", 1 << 20, populate_pages=False, owner=Owner(os.geteuid(), os.getegid()))
    tier.add_arena("b", other)
    tier.home = lambda meta: other if meta.info == b"b" else None
    try:
        keys = [ChunkKey(bytes([i]) * 32) for i in range(12)]
        payload = np.full(4096, 7, np.uint8)
        for key, where in zip(keys, held, strict=False):
            info = b"b" if where == "other" else b""
            tier.store([ReplicaMeta(key, "uint8", (4096,), info=info)], [payload])
            if where == "gone":
                tier.delete(key)
        probe = [keys[i] for i in asked]
        for arena in (tier.arena, other):
            want = [tier.hint(k, arena) or (0, 0) for k in probe]
            assert tier.hints(probe, arena) == want
    finally:
        tier.close()  # its arenas with it


@SETTINGS
@given(
    stored=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 6)), min_size=1, max_size=4),
    looked=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 8)), min_size=1, max_size=4),
)
def test_served_lookups_equal_the_per_chunk_reference(
    client: RemoteStore, stored: list[tuple[int, int]], looked: list[tuple[int, int]]
) -> None:
    """Prompts of seeds 0-3 (a seed's prompts share their prefixes): some stored to some
    length, then looked up to another; each answer is the chunk keys' longest stored
    run, hit for hit, with a hint (offset, generation) for every DRAM hit and none for
    the others. A small DRAM tier (16 KiB, 8 chunks) sends some chunks to disk."""
    ident = tiny_identity(model_id="served-pass")
    client.invalidate(model="served-pass")
    kept: dict[ChunkKey, None] = {}
    for seed, chunks in stored:
        tokens, kv = prompt_kv(seed, 8 * N)
        client.put_prompt(ident, PUBLIC, tokens[: chunks * N], kv[:, :, :, : chunks * N])
        kept.update(dict.fromkeys(prompt_chunk_keys(ident, PUBLIC, tokens[: chunks * N])))
    names = client.tier_names
    for seed, chunks in looked:
        tokens, _ = prompt_kv(seed, 8 * N)
        keys = prompt_chunk_keys(ident, PUBLIC, tokens[: chunks * N])
        res = client.lookup(ident, PUBLIC, tokens[: chunks * N])
        assert isinstance(res, RemoteLookup)
        run = 0
        while run < len(keys) and keys[run] in kept:
            run += 1
        assert res.chunks_total == len(keys)
        assert [(h.index, h.key, h.start) for h in res.hits] == [
            (i, keys[i], i * N) for i in range(run)
        ]
        assert all(h.tier in names and h.transform == "exact" for h in res.hits)
        assert all(h.stored_nbytes == TINY.chunk_nbytes for h in res.hits)
        hints = res.hints
        assert len(hints) == 2 * run
        for i, h in enumerate(res.hits):
            assert (hints[2 * i + 1] != 0) == (h.tier == names[0]), (h.tier, hints)


def test_a_served_lookup_answers_dram_and_disk_hits_with_hints_for_dram_only(
    client: RemoteStore,
) -> None:
    """The example the property test must reach: a run of hits over both tiers."""
    ident = tiny_identity(model_id="served-mixed")
    tokens, kv = prompt_kv(9, 16 * N)
    client.put_prompt(ident, PUBLIC, tokens, kv)
    res = client.lookup(ident, PUBLIC, tokens)
    assert isinstance(res, RemoteLookup)
    names = client.tier_names
    assert len(res.hits) == 16
    assert {h.tier for h in res.hits} == set(names[:2])
    assert [g != 0 for g in res.hints[1::2]] == [h.tier == names[0] for h in res.hits]
    client.invalidate(model="served-mixed")


def test_the_served_lookup_keeps_nothing_from_a_tier_it_refused(tmp_path: Path) -> None:
    """A reply that failed (a tier out of range) leaves no record kept: the same reply
    fixed answers records built afresh, equal to the reference."""
    srv = ServerProc(tmp_path / "srv").start()
    try:
        with srv.client() as remote:
            loads = _loads(remote)
            blob = bytes(range(KEY_BYTES)) * 2
            with pytest.raises(ProtocolError):
                loads._hits(blob, [0, 7], [list(FORMS[0])] * 2, 0, N)
            assert not loads._known
            names = list(loads.wire.names)
            forms = [list(FORMS[0])] * 2
            assert loads._hits(blob, [0, 1], forms, 0, N) == reference(
                names, blob, [0, 1], forms, 0, N
            )
    finally:
        srv.stop()


GARBLED_FIELDS = [
    ("hints", None),
    ("hints", 5),
    ("hints", ["a"] * 8),
    ("hints", [1.5] * 8),
    ("hints", [-8, 1] * 4),
    ("hints", [True] * 8),
    ("hints", [0, 1] * 3),  # two numbers for three of the four hits
    ("chunks_total", None),
    ("chunks_total", "4"),
    ("chunks_total", -1),
    ("chunks_total", 3),  # fewer chunks than the reply's hits
    ("refusal", None),
    ("refusal", 7),
    ("keys", KeyError),
    ("tiers", KeyError),
    ("forms", KeyError),
    ("refusal", KeyError),
    ("chunks_total", KeyError),
]


@pytest.mark.parametrize(("name", "value"), GARBLED_FIELDS)
def test_a_lookup_reply_with_a_field_the_client_cannot_read_is_refused_keeping_nothing(
    client: RemoteStore, monkeypatch: pytest.MonkeyPatch, name: str, value: object
) -> None:
    """The real server's reply to a lookup of four stored chunks, one field garbled on
    the way (``KeyError``: left out): the whole reply is a ProtocolError, and no hit
    record of it is kept (it failed with TypeError or KeyError on the client of
    7046ddf, which had kept the reply's records, or answered a lookup whose refusal
    read ``'None'``, whose chunks_total was None or below its hits, or whose hints
    were not offsets)."""
    ident = tiny_identity(model_id="served-garbled")
    tokens, kv = prompt_kv(11, 4 * N)
    client.put_prompt(ident, PUBLIC, tokens, kv)
    loads = _loads(client)
    real = loads.wire.call_on

    def garbled(verb: str, args: dict[str, Any], *more: Any) -> tuple[Any, Any]:
        r, conn = real(verb, args, *more)
        if verb == "lookup":
            assert len(r["tiers"]) == 4
            r = dict(r)
            if value is KeyError:
                del r[name]
            else:
                r[name] = value
        return r, conn

    loads._known.clear()
    monkeypatch.setattr(loads.wire, "call_on", garbled)
    with pytest.raises(ProtocolError, match="lookup reply"):
        client.lookup(ident, PUBLIC, tokens)
    assert not loads._known
    monkeypatch.undo()
    res = client.lookup(ident, PUBLIC, tokens)  # the same reply, ungarbled: read
    assert len(res.hits) == 4 and res.refused == 0
    client.invalidate(model="served-garbled")


@pytest.mark.parametrize("again", [True, False])
def test_held_a_stale_hint_whose_extent_holds_another_chunk_is_never_served(
    tmp_path: Path, again: bool
) -> None:
    """A lookup's hints, then its prompt invalidated and another prompt put into the
    extents the hints name (and the prompt put again elsewhere, or not): the load with
    buffers of the layout (the hinted path: the client copies from the hints at once)
    serves the prompt's own bytes or misses, never the other prompt's that its hints
    now point at (the server confirms no hint whose extent was reallocated). Checked
    to fail with a server that confirmed every hint whose chunk it served from the
    arena, wherever the hint pointed."""
    srv = ServerProc(tmp_path / "srv", dram=16 << 10).start()
    try:
        with srv.client() as client:
            _stale_hint(client, again)
    finally:
        srv.stop()


def _stale_hint(client: RemoteStore, again: bool) -> None:
    ident = tiny_identity(model_id="served-stale")
    tokens, kv = prompt_kv(20, 4 * N)
    client.invalidate(model="served-stale")
    client.put_prompt(ident, PUBLIC, tokens, kv)
    stale = client.lookup(ident, PUBLIC, tokens)
    assert isinstance(stale, RemoteLookup) and len(stale.hits) == 4
    assert all(stale.hints[1::2])  # every hit in DRAM, with a hint
    # other prompts until one lies where the stale hints point (an extent is freed
    # when its last view dies, which may be a put later)
    for seed in range(21, 29):
        client.invalidate(model="served-stale")
        other_tokens, other_kv = prompt_kv(seed, 4 * N)
        client.put_prompt(ident, PUBLIC, other_tokens, other_kv)
        other = client.lookup(ident, PUBLIC, other_tokens)
        assert isinstance(other, RemoteLookup)
        if set(stale.hints[0::2]) & set(other.hints[0::2]):
            break
    else:
        raise AssertionError("no other prompt was put into the stale hints' extents")
    if again:
        client.put_prompt(ident, PUBLIC, tokens, kv)
    outs = [np.full(TINY.chunk_shape, np.nan, np.float16) for _ in stale.hits]
    got = client.load(stale, outs)
    assert got.loaded == (4 if again else 0)
    for i, arr in enumerate(got.arrays):
        want = kv[:, :, :, i * N : (i + 1) * N]
        assert np.array_equal(arr, want) and np.array_equal(outs[i], want)
    client.invalidate(model="served-stale")

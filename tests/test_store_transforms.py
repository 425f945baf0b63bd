"""Transforms in the store: replicas typed by their transform, ``lookup(accept=...)``
refusing what it must, tiers that encode on the way down, restart, unknown transforms and
corrupt frames as counted misses."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Self

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.core.errors import InvalidArgument
from kvlife.core.events import MemorySink
from kvlife.core.identity import PUBLIC, ChunkKey, ModelIdentity
from kvlife.core.objects import Representation
from kvlife.faults.damage import flip, scan_frames
from kvlife.store import Accept, KVStore, StoreConfig, TierSpec
from kvlife.tiers.disk.catalog import CATALOG_VERSION
from kvlife.transforms import ErrorBound, Exactness, make_transform
from kvlife.transforms import registry as transform_registry
from kvlife.transforms.base import Param
from kvlife.transforms.contract import Contract, contract_for
from kvlife.transforms.exact import ExactTransform
from kvlife.transforms.quant import QuantTransform
from tests.conftest import TINY, prompt_kv

CHUNK = TINY.chunk_nbytes
N = TINY.tokens_per_chunk
INT4 = (("key_group", 16), ("value_group", 8))
DISK_OPTS = (("segment_bytes", 1 << 20),)
Demoted = tuple[KVStore, tuple[np.ndarray, np.ndarray], list[ChunkKey]]


class ProbeTransform(ExactTransform):
    """A lossless transform the ``probe`` fixture registers for one test (so that the
    test can take it away or change its version, like a reader that lacks it)."""

    name = "t12probe"
    version = 1
    exactness = Exactness.LOSSLESS

    @classmethod
    def from_params(cls, params: Mapping[str, Param]) -> Self:
        return cls()


def chain(
    dram_chunks: int = 8,
    disk: str = "int4",
    params: tuple[tuple[str, int | float | bool | str], ...] = INT4,
) -> StoreConfig:
    return StoreConfig(
        tiers=(
            TierSpec("memory", "dram", dram_chunks * CHUNK),
            TierSpec(
                "disk",
                "disk",
                1 << 24,
                options=DISK_OPTS,
                transform=disk,
                transform_params=params,
            ),
        )
    )


def chunk_of(kv: np.ndarray, i: int) -> np.ndarray:
    return np.ascontiguousarray(kv[:, :, :, i * N : (i + 1) * N, :])


def within_bound(name: str, params: object, got: np.ndarray, want: np.ndarray) -> bool:
    t = make_transform(name, dict(params))  # type: ignore[call-overload]
    bound = t.element_bounds(want)
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    return bool(bound is None and np.array_equal(got, want)) or bool(
        bound is not None and np.all(err <= bound)
    )


@pytest.fixture
def demoted(tmp_path: Path, identity: ModelIdentity) -> Iterator[Demoted]:
    """Four chunks in DRAM (exact) and flushed to an int4 disk tier, then evicted from
    DRAM: the disk holds the only (lossy) replicas."""
    tokens, kv = prompt_kv(3, 4 * N)
    store = KVStore(tmp_path, chain())
    keys = store.put_prompt(identity, PUBLIC, tokens, kv).keys
    assert store.flush() == 4
    store.evict("dram", 8 * CHUNK)
    yield store, (tokens, kv), keys
    store.close()


def test_exact_lookup_refuses_lossy_replicas(demoted: Demoted, identity: ModelIdentity) -> None:
    store, (tokens, kv), keys = demoted
    miss = store.lookup(identity, PUBLIC, tokens)
    assert miss.hits == [] and miss.refused == 1
    assert "int4 is lossy" in miss.refusal and "accepts exact" in miss.refusal
    assert store.lookup(identity, PUBLIC, tokens, accept=Accept.LOSSLESS).hits == []
    assert store.counters.lookup_chunks_refused == 2
    hit = store.lookup(identity, PUBLIC, tokens, accept=Accept.lossy())
    assert [h.key for h in hit.hits] == keys
    for h in hit.hits:
        assert (h.tier, h.transform, h.exactness) == ("disk", "int4", "lossy")
        assert 0 < h.stored_nbytes < CHUNK and h.decode_nbytes == CHUNK
        assert h.decode_seconds > 0
    outs = [np.full(TINY.chunk_shape, np.nan, np.float16) for _ in hit.hits]
    res = store.load(hit, outs)
    assert res.loaded == 4 and res.decoded == 4 and res.representations == {"int4": 4}
    for i, arr in enumerate(res.arrays):
        assert arr is outs[i], "decoded somewhere else than the caller's buffer"
        assert within_bound("int4", INT4, arr, chunk_of(kv, i))
        assert not np.array_equal(arr, chunk_of(kv, i)), "int4 of random KV cannot be exact"


def test_bounded_lossy_accept_refuses_looser_transforms(
    demoted: Demoted, identity: ModelIdentity
) -> None:
    store, (tokens, _), _ = demoted
    tight = ErrorBound(0.01, 0.01, 0.01)  # int4's half step is 0.5/15 of the range
    refused = store.lookup(identity, PUBLIC, tokens, accept=Accept.lossy(max_bound=tight))
    assert refused.hits == [] and "looser" in refused.refusal
    only_int8 = store.lookup(identity, PUBLIC, tokens, accept=Accept.lossy(transforms=["int8"]))
    assert only_int8.hits == [] and "not among" in only_int8.refusal
    unmeasured = store.lookup(identity, PUBLIC, tokens, accept=Accept.lossy(max_kl=1.0))
    assert unmeasured.hits == [] and "no measured KL" in unmeasured.refusal
    loose = ErrorBound(0.5, 0.5, 1.0)
    assert len(store.lookup(identity, PUBLIC, tokens, accept=Accept.lossy(max_bound=loose)).hits)


def test_one_object_exact_in_dram_lossy_on_disk(tmp_path: Path, identity: ModelIdentity) -> None:
    """An exact lookup is served the exact DRAM replica even where a lossy disk replica
    exists; once DRAM lets go, only a lossy lookup is served, and it says so."""
    tokens, kv = prompt_kv(4, 2 * N)
    with KVStore(tmp_path, chain()) as store:
        store.put_prompt(identity, PUBLIC, tokens, kv)
        store.flush()
        exact = store.lookup(identity, PUBLIC, tokens)
        assert [(h.tier, h.transform, h.decode_nbytes) for h in exact.hits] == [
            ("dram", "exact", 0)
        ] * 2
        res = store.load(exact)
        assert all(np.array_equal(a, chunk_of(kv, i)) for i, a in enumerate(res.arrays))
        lossy = store.lookup(identity, PUBLIC, tokens, accept=Accept.lossy())
        assert [h.tier for h in lossy.hits] == ["dram"] * 2, "the faster exact replica first"
        store.evict("dram", 2 * CHUNK)
        assert store.lookup(identity, PUBLIC, tokens).hits == []
        assert [
            h.exactness for h in store.lookup(identity, PUBLIC, tokens, accept=Accept.lossy()).hits
        ] == ["lossy"] * 2


def test_lossy_replica_promoted_stays_lossy(demoted: Demoted, identity: ModelIdentity) -> None:
    """A disk hit is promoted into DRAM decoded (no decode on the next hit) and typed
    int4: it is never served to an exact lookup."""
    store, (tokens, _), _ = demoted
    first = store.load(store.lookup(identity, PUBLIC, tokens, accept=Accept.lossy()))
    store.drain()
    assert store.counters.promotions == 4
    again = store.lookup(identity, PUBLIC, tokens, accept=Accept.lossy())
    assert [(h.tier, h.transform, h.exactness, h.decode_nbytes) for h in again.hits] == [
        ("dram", "int4", "lossy", 0)
    ] * 4
    second = store.load(again)
    assert second.decoded == 0 and second.representations == {"int4": 4}
    for a, b in zip(first.arrays, second.arrays, strict=True):
        assert np.array_equal(a, b)
    assert store.lookup(identity, PUBLIC, tokens).hits == [], "promotion made it exact"


def test_lossless_tier_round_trip_is_bit_exact_and_not_exact(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    tokens, kv = prompt_kv(5, 3 * N)
    sink = MemorySink()
    with KVStore(tmp_path, chain(1, "lossless", ()), sink=sink) as store:
        store.put_prompt(identity, PUBLIC, tokens, kv)  # two go straight to disk, encoded
        store.evict("dram", CHUNK)  # the third is demoted, encoded
        assert store.counters.encoded == 3
        assert store.lookup(identity, PUBLIC, tokens).hits == []
        hit = store.lookup(identity, PUBLIC, tokens, accept=Accept.LOSSLESS)
        assert [(h.transform, h.exactness) for h in hit.hits] == [("lossless", "lossless")] * 3
        res = store.load(hit)
        assert res.loaded == 3
        assert all(np.array_equal(a, chunk_of(kv, i)) for i, a in enumerate(res.arrays))
    kinds = {(e.kind, e.transform) for e in sink.take()}
    assert ("transform", "lossless") in kinds and ("offload", "lossless") in kinds
    assert ("load", "lossless") in kinds


def test_restart_keeps_the_transform_record(tmp_path: Path, identity: ModelIdentity) -> None:
    tokens, kv = prompt_kv(6, 3 * N)
    with KVStore(tmp_path, chain()) as store:
        store.put_prompt(identity, PUBLIC, tokens, kv)
        before = store.load(store.lookup(identity, PUBLIC, tokens)).arrays
        assert len(before) == 3
    db = sqlite3.connect(tmp_path / "disk" / "catalog.sqlite")
    try:
        rows = db.execute("SELECT transform, dtype, length(form) FROM replicas").fetchall()
        (version,) = db.execute("SELECT v FROM meta WHERE k = 'catalog_version'").fetchone()
    finally:
        db.close()
    assert int(version) == CATALOG_VERSION == 4
    assert rows and all(r[0] == "int4" and r[1] == "uint8" and r[2] > 0 for r in rows)
    # reopened with another config: the record, not the config, says what the replica is
    with KVStore(tmp_path, chain(disk="int8", params=())) as store:
        disk_info = store.info().tiers[1].details
        assert disk_info["transform"] == "int8" and "key_group" in disk_info["transform_params"]
        assert "transform" not in store.info().tiers[0].details
        assert store.lookup(identity, PUBLIC, tokens).hits == []
        hit = store.lookup(identity, PUBLIC, tokens, accept=Accept.lossy())
        assert [h.transform for h in hit.hits] == ["int4"] * 3
        res = store.load(hit)
        assert res.loaded == 3
        for i, arr in enumerate(res.arrays):
            assert within_bound("int4", INT4, arr, chunk_of(kv, i))
        assert store.check().clean


def test_version_2_catalog_is_migrated_to_3(tmp_path: Path, identity: ModelIdentity) -> None:
    tokens, kv = prompt_kv(7, 2 * N)
    config = StoreConfig(dram_bytes=0, disk_bytes=1 << 24, segment_bytes=1 << 20)
    with KVStore(tmp_path, config) as store:
        store.put_prompt(identity, PUBLIC, tokens, kv)
    db = sqlite3.connect(tmp_path / "disk" / "catalog.sqlite")
    try:
        with db:
            db.execute("ALTER TABLE replicas DROP COLUMN form")
            db.execute("UPDATE meta SET v = '2' WHERE k = 'catalog_version'")
    finally:
        db.close()
    with KVStore(tmp_path, config) as store:
        res = store.load(store.lookup(identity, PUBLIC, tokens))
        assert res.loaded == 2
        assert all(np.array_equal(a, chunk_of(kv, i)) for i, a in enumerate(res.arrays))
        assert store.check().clean


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    transform_registry.transform_names()  # built-ins first
    monkeypatch.setitem(transform_registry._REGISTRY, ProbeTransform.name, ProbeTransform)
    contract_for.cache_clear()
    yield
    contract_for.cache_clear()


def _probe_store(path: Path, sink: MemorySink | None = None) -> KVStore:
    cfg = StoreConfig(
        tiers=(TierSpec("disk", "disk", 1 << 24, options=DISK_OPTS, transform="t12probe"),)
    )
    return KVStore(path, cfg, sink=sink)


def test_unknown_transform_version_is_a_counted_miss(
    tmp_path: Path, identity: ModelIdentity, monkeypatch: pytest.MonkeyPatch, probe: None
) -> None:
    tokens, kv = prompt_kv(8, 2 * N)
    with _probe_store(tmp_path) as store:
        store.put_prompt(identity, PUBLIC, tokens, kv)
        assert len(store.lookup(identity, PUBLIC, tokens, accept=Accept.LOSSLESS).hits) == 2
    monkeypatch.setattr(ProbeTransform, "version", 2)  # this reader only knows version 2
    contract_for.cache_clear()
    sink = MemorySink()
    with _probe_store(tmp_path, sink) as store:
        for _ in range(2):
            miss = store.lookup(identity, PUBLIC, tokens, accept=Accept.lossy())
            assert miss.hits == [] and miss.refused == 1
            assert "version 1 is not known" in miss.refusal
        assert store.counters.unknown_transform == 1, "counted once per replica"
        assert store.counters.lookup_chunks_refused == 2
        refusals = [e for e in sink.take() if e.kind == "refuse"]
        assert len(refusals) == 1 and "unknown transform" in refusals[0].reason
        assert refusals[0].transform == "t12probe"
        assert len(store.indexed_keys()) == 2, "an unreadable replica is kept, not dropped"
    monkeypatch.setattr(ProbeTransform, "version", 1)
    contract_for.cache_clear()
    with _probe_store(tmp_path) as store:  # a reader that knows it serves it again
        res = store.load(store.lookup(identity, PUBLIC, tokens, accept=Accept.LOSSLESS))
        assert res.loaded == 2
        assert all(np.array_equal(a, chunk_of(kv, i)) for i, a in enumerate(res.arrays))


def test_unknown_transform_name_is_a_miss_not_a_crash(
    tmp_path: Path, identity: ModelIdentity, monkeypatch: pytest.MonkeyPatch, probe: None
) -> None:
    tokens, kv = prompt_kv(9, N)
    with _probe_store(tmp_path) as store:
        store.put_prompt(identity, PUBLIC, tokens, kv)
    monkeypatch.delitem(transform_registry._REGISTRY, "t12probe")
    contract_for.cache_clear()
    with KVStore(tmp_path, StoreConfig(dram_bytes=0, disk_bytes=1 << 24)) as store:
        miss = store.lookup(identity, PUBLIC, tokens, accept=Accept.lossy())
        assert miss.hits == [] and "unknown transform 't12probe'" in miss.refusal
        assert store.counters.unknown_transform == 1
        assert store.load(miss).loaded == 0


def test_corrupt_compressed_frame_on_disk_is_a_miss_and_invalidated(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    tokens, kv = prompt_kv(10, 3 * N)
    with KVStore(tmp_path, chain(1, "lossless", ())) as store:
        keys = store.put_prompt(identity, PUBLIC, tokens, kv).keys
        store.evict("dram", CHUNK)
    frame = next(f for f in scan_frames(tmp_path) if f.key == keys[1])
    flip(frame.segment, frame.payload_offset + 40, 2)
    with KVStore(tmp_path, chain(1, "lossless", ())) as store:
        hit = store.lookup(identity, PUBLIC, tokens, accept=Accept.LOSSLESS)
        assert len(hit.hits) == 3
        res = store.load(hit)
        assert res.loaded == 1 and res.corrupt == [keys[1]]
        assert store.counters.corrupt == 1
        assert keys[1] not in store.indexed_keys()


def test_corrupt_frame_a_tier_did_not_catch_is_a_miss(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """A tier without checksums (a second memory tier, standing in for a remote one)
    hands back a damaged frame: the frame's own verification makes it a miss, the object
    is invalidated as corrupt and the frame counted."""
    tokens, kv = prompt_kv(11, 2 * N)
    cfg = StoreConfig(
        tiers=(
            TierSpec("memory", "dram", CHUNK),
            TierSpec("memory", "remote", 1 << 20, transform="lossless"),
        )
    )
    with KVStore(tmp_path, cfg) as store:
        keys = store.put_prompt(identity, PUBLIC, tokens, kv).keys
        remote = store.tier("remote")
        meta = remote.meta(keys[1])
        bad = remote.read(keys[1]).copy()
        bad[len(bad) // 2] ^= 0x10
        assert remote.store([meta], [bad])  # the remote end now returns damaged bytes
        hit = store.lookup(identity, PUBLIC, tokens, accept=Accept.LOSSLESS)
        assert [h.tier for h in hit.hits] == ["dram", "remote"]
        res = store.load(hit)
        assert res.loaded == 1 and res.corrupt == [keys[1]]
        assert store.counters.corrupt_frames == 1 and store.counters.corrupt == 1
        assert keys[1] not in store.indexed_keys()


def test_a_transforming_tier_is_checked_at_open(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match=r"'disk'.*nope"):
        KVStore(tmp_path / "a", chain(disk="nope", params=()))
    with pytest.raises(InvalidArgument, match="leave transform empty"):
        KVStore(tmp_path / "b", chain(disk="exact", params=()))
    with pytest.raises(InvalidArgument, match="bogus"):
        KVStore(tmp_path / "c", chain(disk="int4", params=(("bogus", 1),)))
    with pytest.raises(InvalidArgument, match="without a transform"):
        TierSpec("memory", "m", 10, transform_params=(("level", 1),))


def test_placement_charges_a_transforming_tier_its_frames(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """An int2 tier of 4 exact chunks' budget holds about four times more chunks."""
    tokens, kv = prompt_kv(12, 16 * N)
    disk_budget = 32 * (CHUNK + 4096)
    cfg = StoreConfig(
        tiers=(
            TierSpec("memory", "dram", CHUNK),
            TierSpec("memory", "remote", 4 * CHUNK, transform="int2", transform_params=INT4),
            TierSpec("disk", "disk", disk_budget, options=DISK_OPTS),
        )
    )
    with KVStore(tmp_path, cfg) as store:
        store.put_prompt(identity, PUBLIC, tokens, kv)
        remote = store.tier("remote")
        held = len(remote.replica_keys())
        assert held > 8, held
        assert remote.used_bytes <= remote.capacity_bytes


# ------------------------------------------------------------------ Accept, as a model

EXACTNESS = list(Exactness)
bounds = st.builds(
    ErrorBound,
    st.floats(0, 1, allow_nan=False),
    st.floats(0, 1, allow_nan=False),
    st.floats(0, 1, allow_nan=False),
)
contracts = st.builds(
    Contract,
    st.sampled_from(["int8", "int4", "sparse", "lossless", "exact"]),
    st.integers(1, 3),
    st.sampled_from(EXACTNESS),
    st.one_of(st.none(), bounds),
    st.one_of(st.none(), st.floats(0, 1, allow_nan=False)),
)
accepts = st.one_of(
    st.just(Accept.EXACT),
    st.just(Accept.LOSSLESS),
    st.builds(
        Accept.lossy,
        max_kl=st.one_of(st.none(), st.floats(0, 1, allow_nan=False)),
        max_bound=st.one_of(st.none(), bounds),
        transforms=st.one_of(st.none(), st.sets(st.sampled_from(["int8", "int4", "sparse"]))),
    ),
)


@settings(max_examples=400, deadline=None)
@given(c=contracts, a=accepts)
def test_accept_takes_exactly_what_its_limits_allow(c: Contract, a: Accept) -> None:
    rank = {Exactness.EXACT: 0, Exactness.LOSSLESS: 1, Exactness.LOSSY: 2}
    # a class no Accept ranks (lossy-sparse) is taken by none
    takes = c.exactness in rank and rank[c.exactness] <= rank[a.exactness]
    if takes and c.exactness is Exactness.LOSSY:
        if a.transforms is not None:
            takes = c.name in a.transforms
        if takes and a.max_bound is not None:
            b = c.bound
            takes = b is not None and all(
                getattr(b, f) <= getattr(a.max_bound, f)
                for f in ("range_factor", "magnitude_factor", "absolute")
            )
        if takes and a.max_kl is not None:
            takes = c.measured_kl is not None and c.measured_kl <= a.max_kl
    assert (a.refusal(c) == "") == takes, (c, a, a.refusal(c))
    if c.exactness is Exactness.LOSSY:
        assert Accept.EXACT.refusal(c) and Accept.LOSSLESS.refusal(c), "lossy served as exact"


def test_accept_limits_need_the_lossy_class() -> None:
    with pytest.raises(InvalidArgument):
        Accept(Exactness.EXACT, max_kl=0.1)
    with pytest.raises(InvalidArgument):
        Accept.lossy(max_kl=-1.0)


def test_async_load_decodes_frames_into_the_callers_buffers(
    demoted: Demoted, identity: ModelIdentity
) -> None:
    store, (tokens, kv), _ = demoted
    hit = store.lookup(identity, PUBLIC, tokens, accept=Accept.lossy())
    outs = [np.zeros(TINY.chunk_shape, np.float16) for _ in hit.hits]
    handle = store.load_async(hit, outs)
    for i in range(len(handle)):
        arr = handle.chunk(i, timeout=10.0)
        assert arr is outs[i]
        assert within_bound("int4", INT4, arr, chunk_of(kv, i))
    res = handle.wait(timeout=10.0)
    assert res.loaded == 4 and res.decoded == 4
    again = store.lookup(identity, PUBLIC, tokens, accept=Accept.lossy())
    assert all(h.decode_seconds > 0 for h in again.hits if h.decode_nbytes)


def test_a_tampered_representation_record_is_quarantined(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """The catalog row checksum covers the representation record: a changed byte in it
    (say, int4 turned into another transform) quarantines the row; nothing is served."""
    tokens, kv = prompt_kv(13, 2 * N)
    with KVStore(tmp_path, chain(1)) as store:
        store.put_prompt(identity, PUBLIC, tokens, kv)  # chunk 1 goes straight to disk
    db = sqlite3.connect(tmp_path / "disk" / "catalog.sqlite")
    try:
        with db:
            ((rowid, form),) = db.execute(
                "SELECT rowid, form FROM replicas ORDER BY rowid LIMIT 1"
            ).fetchall()
            bad = bytearray(form)
            bad[len(bad) // 3] ^= 0x01
            db.execute("UPDATE replicas SET form = ? WHERE rowid = ?", (bytes(bad), rowid))
    finally:
        db.close()
    with KVStore(tmp_path, chain(1)) as store:
        assert store.counters.recovery_dropped == 1
        assert len(store.indexed_keys()) == 1
        assert not store.check().clean


forms = st.builds(
    Representation,
    st.sampled_from(["int4", "int8", "lossless", "t12probe"]),
    st.integers(1, 5),
    st.dictionaries(
        st.text("abcdefgh_", min_size=1, max_size=8),
        st.one_of(st.integers(-5, 99), st.booleans(), st.floats(0, 1), st.text(max_size=4)),
        max_size=4,
    ).map(lambda d: tuple(sorted(d.items()))),
    st.booleans(),
    st.binary(max_size=64),
)


@settings(max_examples=200, deadline=None)
@given(form=forms, shape=st.lists(st.integers(0, 9), max_size=5), flip=st.integers(0, 10_000))
def test_representation_record_round_trips_and_damage_is_typed(
    form: Representation, shape: list[int], flip: int
) -> None:
    blob = form.encode("float16", tuple(shape))
    assert Representation.decode(blob) == (form, "float16", tuple(shape))
    bad = bytearray(blob)
    bad[flip % len(bad)] ^= 1 << (flip % 8)
    for data in (bytes(bad), blob[: flip % len(blob)]):
        with contextlib.suppress(InvalidArgument):  # typed; anything else fails the test
            Representation.decode(data)


def test_write_through_to_a_transforming_tier(tmp_path: Path, identity: ModelIdentity) -> None:
    """Write-through copies are encoded too: durable at once, and after a restart only
    the int8 replica is left, served to a lossy lookup only."""
    tokens, kv = prompt_kv(14, 3 * N)
    base = chain(8, "int8", ())
    cfg = StoreConfig(tiers=base.tiers, write_through=True)
    with KVStore(tmp_path, cfg) as store:
        store.put_prompt(identity, PUBLIC, tokens, kv)
        assert store.counters.encoded == 3
        assert [h.tier for h in store.lookup(identity, PUBLIC, tokens).hits] == ["dram"] * 3
    with KVStore(tmp_path, cfg) as store:
        assert store.lookup(identity, PUBLIC, tokens).hits == []
        hit = store.lookup(identity, PUBLIC, tokens, accept=Accept.lossy(transforms=["int8"]))
        res = store.load(hit)
        assert res.loaded == 3
        for i, arr in enumerate(res.arrays):
            assert within_bound("int8", (), arr, chunk_of(kv, i))


# ------------------------------------------------------------------ sinks and chunk sizes


SINKS4 = (*INT4, ("sink_tokens", 4))


def test_sinks_only_in_the_chunk_at_the_sequence_start(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """The store tells the tier's transform each chunk's absolute start: the chunk at the
    sequence start keeps its 4 sinks bit-exact, the later ones keep none and take fewer
    bytes; a prompt continued from position 2N (a parent chunk) gets no sinks either."""
    tokens, kv = prompt_kv(21, 3 * N)
    with KVStore(tmp_path, chain(params=SINKS4)) as store:
        keys = store.put_prompt(identity, PUBLIC, tokens, kv).keys
        assert store.flush() == 3
        store.evict("dram", 8 * CHUNK)
        hit = store.lookup(identity, PUBLIC, tokens, accept=Accept.lossy())
        sizes = [h.stored_nbytes for h in hit.hits]
        assert len(sizes) == 3 and sizes[0] > sizes[1] == sizes[2]
        res = store.load(hit)
        first, later = res.arrays[0], res.arrays[1]
        assert np.array_equal(first[:, :, :, :4], chunk_of(kv, 0)[:, :, :, :4])
        assert not np.array_equal(later[:, :, :, :4], chunk_of(kv, 1)[:, :, :, :4])
        # each replica is within the bound of its own layout (no sinks after the first)
        t = make_transform("int4", dict(SINKS4))
        assert isinstance(t, QuantTransform)
        for i, arr in enumerate(res.arrays):
            bound = t.element_bounds(chunk_of(kv, i), start=i * N)
            err = np.abs(arr.astype(np.float64) - chunk_of(kv, i).astype(np.float64))
            assert (err <= bound).all()
        # the same tokens' KV put as a continuation at position 2N is not a sequence start
        more_tokens, more_kv = prompt_kv(22, N)
        cont = store.put_prompt(
            identity, PUBLIC, more_tokens, more_kv, start=3 * N, parent=keys[-1]
        ).keys
        assert store.flush() == 1
        store.evict("dram", 8 * CHUNK)
        got = store.lookup(
            identity, PUBLIC, more_tokens, start=3 * N, parent=keys[-1], accept=Accept.lossy()
        )
        assert [h.key for h in got.hits] == cont and got.hits[0].stored_nbytes == sizes[1]


def test_a_kl_bounded_lookup_uses_the_figure_for_the_layouts_chunk_size(tmp_path: Path) -> None:
    """The KL a lookup bounds is the one measured at the replica's own chunk size (64
    tokens here), read from its frame; the refusal says which chunk size it holds for."""
    from kvlife.core.identity import KVLayout
    from kvlife.transforms.quant import INT4_TUNED, MEASURED_KL

    layout = KVLayout(
        num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", tokens_per_chunk=64
    )
    ident = ModelIdentity(layout=layout, model_id="m64", weights_digest="w", tokenizer_digest="t")
    tuned = next(e for e in MEASURED_KL if e.params == INT4_TUNED and not e.sinks_per_chunk)
    at64 = tuned.kl[64]
    tokens, kv = prompt_kv(23, 2 * 64, layout)
    params = tuple(sorted(INT4_TUNED.items()))
    cfg = StoreConfig(
        tiers=(
            TierSpec("memory", "dram", 4 * layout.chunk_nbytes),
            TierSpec(
                "disk",
                "disk",
                1 << 24,
                options=DISK_OPTS,
                transform="int4",
                transform_params=params,
            ),
        )
    )
    with KVStore(tmp_path, cfg) as store:
        store.put_prompt(ident, PUBLIC, tokens, kv)
        assert store.flush() == 2
        store.evict("dram", 4 * layout.chunk_nbytes)
        ok = store.lookup(ident, PUBLIC, tokens, accept=Accept.lossy(max_kl=at64))
        assert len(ok.hits) == 2
        refused = store.lookup(ident, PUBLIC, tokens, accept=Accept.lossy(max_kl=at64 * 0.99))
        assert refused.hits == []
        assert f"measured KL {at64} at 64-token chunks" in refused.refusal


def test_encoded_nbytes_is_the_frame_at_a_start_and_the_worst_case_without() -> None:
    from kvlife.store.forms import encoded_nbytes

    t = make_transform("int4", dict(SINKS4))
    _, kv = prompt_kv(24, 2 * N)
    frames = [len(t.encode(chunk_of(kv, i), start=i * N).to_frame()) for i in range(2)]
    shape = TINY.chunk_shape
    assert [encoded_nbytes(t, shape, "float16", start=i * N) for i in range(2)] == frames
    assert encoded_nbytes(t, shape, "float16") == max(frames) > min(frames)


def test_placement_charges_each_chunk_its_own_frame_with_or_without_sinks(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """Placement charges a quantising tier the frame each chunk really takes: the chunk
    at the sequence start with its sinks, a later one without (it charged every chunk
    the larger frame). A tier whose budget is exactly those frames holds the prompt's
    three chunks, the tier's own accounting agrees to the byte, and a fourth chunk
    does not fit without an eviction."""
    t = make_transform("int4", dict(SINKS4))
    tokens, kv = prompt_kv(25, 4 * N)
    frames = [len(t.encode(chunk_of(kv, i), start=i * N).to_frame()) for i in range(4)]
    assert frames[0] > frames[1] == frames[2] == frames[3]
    budget = sum(frames[:3])
    cfg = StoreConfig(
        tiers=(
            TierSpec("memory", "q", budget, transform="int4", transform_params=SINKS4),
            TierSpec("disk", "disk", 1 << 24, options=DISK_OPTS),
        )
    )
    with KVStore(tmp_path, cfg) as store:
        keys = store.put_prompt(identity, PUBLIC, tokens[: 3 * N], kv[:, :, :, : 3 * N]).keys
        q = store.tier("q")
        assert sorted(q.replica_keys()) == sorted(keys), "a chunk was charged more than its frame"
        assert q.used_bytes == budget == q.capacity_bytes
        hit = store.lookup(identity, PUBLIC, tokens[: 3 * N], accept=Accept.lossy())
        assert [(h.tier, h.stored_nbytes) for h in hit.hits] == [("q", f) for f in frames[:3]]
        assert store.counters.tier("q").evictions == 0
        # one more chunk (start 3N, no sinks) needs its own frame's room: one goes down
        more = store.put_prompt(
            identity, PUBLIC, tokens[3 * N :], kv[:, :, :, 3 * N :], start=3 * N, parent=keys[-1]
        )
        assert more.stored == 1
        assert store.counters.tier("q").evictions == 1
        assert q.used_bytes <= q.capacity_bytes

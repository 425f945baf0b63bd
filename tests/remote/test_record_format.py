"""The publication record and rule encodings: round trips, and any damage is caught
(property-based)."""

from __future__ import annotations

import blake3
import msgpack
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.core.errors import InvalidArgument
from kvlife.core.identity import ChunkKey
from kvlife.core.objects import EpochStamp, ObjectInfo
from kvlife.globalindex import InvalidationRule, RemoteRecord
from kvlife.globalindex.record import RecordError
from kvlife.tiers.base import ReplicaMeta

KEY = ChunkKey(blake3.blake3(b"rec").digest())


def info(ns: str = "organisation:acme", adapter: str = "", parent: bytes = bytes(32)) -> ObjectInfo:
    return ObjectInfo(b"d" * 32, "w0", adapter, ns, ChunkKey(parent), 16, 16, "tiny")


def record(payload: np.ndarray, token: int = 7, epoch: int = 3) -> RemoteRecord:
    born = EpochStamp("inc-1", epoch).encode()
    meta = ReplicaMeta(KEY, payload.dtype.name, payload.shape, "exact", info().encode(), born=born)
    return RemoteRecord.for_payload(meta, payload, "host-a", token, "loc/1")


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 2000),
    token=st.integers(0, 2**62),
    epoch=st.integers(0, 2**40),
)
def test_record_round_trips_and_verifies_its_payload(n: int, token: int, epoch: int) -> None:
    a = np.random.default_rng(n).standard_normal(n).astype(np.float16)
    rec = record(a, token, epoch)
    back = RemoteRecord.decode(rec.encode())
    assert back == rec and back.blob() == rec.encode()
    assert back.born == EpochStamp("inc-1", epoch)  # the creation epoch travels
    assert EpochStamp.decode(back.replica_meta().born) == back.born
    assert np.array_equal(back.verify(KEY, a.tobytes()), a)
    assert back.replica_meta().checksum == rec.header.checksum


@settings(max_examples=200, deadline=None)
@given(pos=st.integers(0, 10_000), bit=st.integers(0, 7))
def test_any_flipped_bit_in_a_record_is_caught(pos: int, bit: int) -> None:
    blob = bytearray(record(np.arange(64, dtype=np.float16)).encode())
    blob[pos % len(blob)] ^= 1 << bit
    with pytest.raises(RecordError):
        RemoteRecord.decode(bytes(blob))


@settings(max_examples=200, deadline=None)
@given(pos=st.integers(0, 127), bit=st.integers(0, 7), cut=st.integers(0, 127))
def test_a_damaged_short_or_empty_payload_never_verifies(pos: int, bit: int, cut: int) -> None:
    a = np.arange(64, dtype=np.float16)
    rec = record(a)
    raw = bytearray(a.tobytes())
    raw[pos] ^= 1 << bit
    with pytest.raises(RecordError):
        rec.verify(KEY, bytes(raw))
    with pytest.raises(RecordError):
        rec.verify(KEY, a.tobytes()[:cut])
    with pytest.raises(RecordError, match="another key"):
        rec.verify(ChunkKey(bytes(32)), a.tobytes())


@given(
    ns=st.sampled_from([None, "organisation:acme", "organisation:globex"]),
    adapter=st.sampled_from([None, "", "lora-1"]),
    weights=st.sampled_from([None, "w0", "w1"]),
    use_prefix=st.booleans(),
)
def test_rule_matching_is_the_intersection_of_its_criteria(
    ns: str | None, adapter: str | None, weights: str | None, use_prefix: bool
) -> None:
    prefix = bytes(KEY) if use_prefix else None
    if ns is None and adapter is None and weights is None and prefix is None:
        with pytest.raises(InvalidArgument):
            InvalidationRule(1, ns, adapter, weights, prefix)
        return
    rule = InvalidationRule(4, ns, adapter, weights, prefix, "why")
    assert InvalidationRule.from_body(4, "", rule.body()) == rule
    obj = info("organisation:acme", "lora-1")
    expect = (
        (ns is None or ns == "organisation:acme")
        and (adapter is None or adapter == "lora-1")
        and (weights is None or weights == "w0")
    )
    child = ChunkKey(blake3.blake3(b"child").digest())
    assert rule.matches(bytes(KEY), obj) == expect
    # a chunk whose parent is the prefix is covered; an unrelated one is not
    assert rule.matches(bytes(child), info("organisation:acme", "lora-1", bytes(KEY))) == expect
    if use_prefix:
        assert not rule.matches(bytes(child), obj)


def test_the_representation_record_travels_and_a_version_1_record_reads_as_exact() -> None:
    a = np.arange(64, dtype=np.float16)
    meta = ReplicaMeta(KEY, "float16", a.shape, "int8", info().encode(), form=b"\x93form")
    rec = RemoteRecord.for_payload(meta, a, "host-a", 1, "")
    back = RemoteRecord.decode(rec.encode())
    assert back.form == b"\x93form" and back.replica_meta().form == b"\x93form"
    back.check_meta(meta)
    with pytest.raises(InvalidArgument):
        back.check_meta(ReplicaMeta(KEY, "float16", a.shape, "int8", info().encode()))
    body = msgpack.unpackb(rec.encode()[:-8])
    v1 = bytes(msgpack.packb([1, *body[1:7]]))
    old = RemoteRecord.decode(v1 + xxhash.xxh3_64_intdigest(v1).to_bytes(8, "little"))
    assert old.form == b"" and old.header == rec.header
    assert not old.born.known  # a record of an unknown incarnation: adopted by no one
    v2 = bytes(msgpack.packb([2, *body[1:8]]))
    older = RemoteRecord.decode(v2 + xxhash.xxh3_64_intdigest(v2).to_bytes(8, "little"))
    assert older.form == b"\x93form" and not older.born.known


@pytest.mark.parametrize("ns", ["acme", "org:acme", "organisation:", "public:x", ""])
def test_a_rule_that_names_no_namespace_is_refused_when_written(ns: str) -> None:
    with pytest.raises(InvalidArgument, match="namespace"):
        InvalidationRule(1, ns)


@settings(max_examples=100, deadline=None)
@given(blob=st.binary(max_size=64) | st.none())
def test_an_unreadable_rule_covers_everything(blob: bytes | None) -> None:
    rule = InvalidationRule.from_body(5, "inc", blob)
    if not rule.everything:  # a well-formed rule happened to be drawn
        assert InvalidationRule.from_body(5, "inc", rule.body()) == rule
        return
    assert rule.matches(bytes(KEY), info("user:x"))
    assert rule.covers_born(EpochStamp("inc", 4)) and not rule.covers_born(EpochStamp("inc", 5))
    assert rule.covers_born(EpochStamp("other", 9)) and rule.covers_born(EpochStamp())

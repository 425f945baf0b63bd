"""Many hosts, one truth: global invalidation, fencing and record identity under
restarts and races (issue 29), each sequence tried as a user of several hosts would:
in-process hosts (one KVStore each) against one real redis-server, and against a real
Mooncake master (the ``mooncake`` parameter runs inside the private network namespace,
from tests/remote/test_mooncake.py)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
import redis

from kvlife.core.errors import InvalidArgument, LeaseError, RemoteTierError
from kvlife.core.identity import ROOT_PARENT, ChunkKey, Namespace, NamespaceKind
from kvlife.core.objects import ObjectInfo
from kvlife.faults.proxy import Fault, FaultProxy
from kvlife.globalindex import GlobalIndex, Health, IndexConfig, RemoteRecord
from kvlife.tiers.base import ReplicaMeta, Reservation
from kvlife.tiers.mooncake import MooncakeTier
from kvlife.tiers.mooncake.server import MooncakeMaster
from kvlife.tiers.redis.published import PublishedTier
from kvlife.tiers.redis.server import RedisClusterServers, RedisServer
from kvlife.tiers.redis.unsettled import UnknownOutcomes
from tests.conftest import TINY, prompt_kv, tiny_identity
from tests.remote.fleet import (
    ACME,
    GLOBEX,
    KINDS,
    Fleet,
    assert_exact,
    hits,
    index_of,
    look,
    put,
    served,
    shared_kind,
    shared_of,
)
from tests.remote.replies import losing

T = TypeVar("T")


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return shared_kind(request)


def _master(kind: str, request: pytest.FixtureRequest) -> MooncakeMaster | None:
    if kind != "mooncake":
        return None
    m: MooncakeMaster = request.getfixturevalue("mooncake_master")
    return m


@pytest.fixture
def fleet(
    tmp_path: Path,
    kind: str,
    redis_server: RedisServer,
    index_ns: str,
    request: pytest.FixtureRequest,
) -> Iterator[Fleet]:
    f = Fleet(tmp_path, kind, redis_server.url, index_ns, _master(kind, request))
    yield f
    f.close()


@pytest.fixture
def private(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test alone (it is restarted or emptied)."""
    server = RedisServer(tmp_path / "private-redis").start()
    yield server
    server.stop()


def retrying(fn: Callable[[], T], timeout_s: float = 10.0) -> T:
    """``fn`` once the connection came back (a restarted server: the first calls fail
    and start the client's backoff)."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            return fn()
        except RemoteTierError:
            if time.monotonic() > end:
                raise
            time.sleep(0.1)


def acl_url(server_url: str, user: str, *rules: str) -> str:
    """A Redis account with only ``rules``; the URL that logs in with it."""
    raw = redis.Redis.from_url(server_url)
    raw.execute_command("ACL", "SETUSER", user, "reset", "on", ">pw", *rules)  # type: ignore[no-untyped-call]
    raw.close()
    host = server_url.split("//", 1)[1]
    return f"redis://{user}:pw@{host}"


def idx_key(index_ns: str, name: str) -> str:
    return f"{{kvl:{index_ns}:idx}}:{name}"


# ---------------------------------------------------------------------- item 1


def test_kv_put_before_a_rule_and_flushed_after_it_is_never_served(fleet: Fleet) -> None:
    a, b, c = fleet.host("a"), fleet.host("b"), fleet.host("c")
    assert put(b, 1) == 4  # in B's DRAM only
    index_of(a).invalidate(namespace=ACME)
    b.flush()  # before B's next lookup: B never applied the rule
    assert hits(c, 1) == 0, "KV computed before the invalidation was served by another host"
    assert hits(b, 1) == 0
    put(b, 1)  # computed after the rule (B has read it): served everywhere
    b.flush()
    assert served(c, 1) == 4


# ---------------------------------------------------------------------- item 2 + hole 5


@pytest.mark.parametrize("lookup_between", [True, False], ids=["synced", "not-synced"])
def test_a_put_in_flight_when_a_rule_is_recorded_is_never_served(
    fleet: Fleet, lookup_between: bool
) -> None:
    a, b, c = fleet.host("a"), fleet.host("b"), fleet.host("c")
    tokens, kv = prompt_kv(2, 64)
    pending = b.prepare_put(tiny_identity(), ACME, tokens, kv)
    index_of(a).invalidate(namespace=ACME)
    if lookup_between:
        assert hits(b, 3) == 0  # B applies the rule while its put is in flight
    b.commit_put(pending)
    b.flush()
    assert hits(c, 2) == 0, "a put in flight across a rule was published as fresh"
    assert hits(b, 2) == 0


def test_a_rule_applied_between_a_puts_stamp_and_its_objects_still_covers_it(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stamp of a put is read before the index lock (the first read may do I/O). A
    lookup on another thread that syncs and applies a new rule in between finds none of
    the put's objects yet; made afterwards with the older stamp, they must still be
    taken out, on this host as on the others."""
    import kvlife.store.writes as writes

    a, b = fleet.host("a"), fleet.host("b")
    hits(b, 9)  # B has read the index: its stamps are known
    real = writes.creation_stamp  # type: ignore[attr-defined]

    def stamp_then_a_rule_arrives(core: object) -> object:
        born = real(core)  # type: ignore[arg-type]
        index_of(a).invalidate(namespace=ACME)
        hits(b, 9)  # another of B's threads: syncs the rule and applies it
        return born

    monkeypatch.setattr(writes, "creation_stamp", stamp_then_a_rule_arrives)
    tokens, kv = prompt_kv(2, 64)
    pending = b.prepare_put(tiny_identity(), ACME, tokens, kv)
    monkeypatch.setattr(writes, "creation_stamp", real)
    b.commit_put(pending)
    assert hits(b, 2) == 0, "KV created before a rule served on the host that applied it"
    b.flush()
    assert hits(fleet.host("c"), 2) == 0


# ---------------------------------------------------------------------- item 3


def test_a_record_replaced_by_another_form_is_never_served_as_exact(fleet: Fleet) -> None:
    a, b = fleet.host("a"), fleet.host("b")
    c = fleet.host("c", transform="int8")
    put(a, 4)
    a.flush()
    found = look(b, 4)
    assert [h.tier for h in found.hits] == ["shared"] * 4  # adopted, not read yet
    put(c, 4)
    c.flush()  # C's int8 frames replace A's exact records
    got = b.load(found)
    assert_exact(got, 4)  # whatever is served is the exact KV: never a frame
    b.drain()
    assert served(b, 4) == 0  # nothing exact left for B (and nothing promoted)
    assert served(a, 4) == 4


# ---------------------------------------------------------------------- item 4 and FLUSHALL


def test_an_index_that_lost_its_state_is_new_to_every_host(
    tmp_path: Path, kind: str, private: RedisServer, request: pytest.FixtureRequest
) -> None:
    fleet = Fleet(tmp_path, kind, private.url, "lost", _master(kind, request))
    try:
        a, b = fleet.host("a"), fleet.host("b")
        for i in range(3):  # epochs 1-3
            index_of(a).invalidate(namespace=Namespace(NamespaceKind.ORGANISATION, f"x{i}"))
        assert put(a, 5, GLOBEX) == 4  # the issuer's own DRAM copy
        assert hits(b, 99) == 0  # B reads epoch 3
        assert put(b, 6) == 4
        private.restart()  # no persistence: the index is empty now
        retrying(b.flush)  # published under what B knew before the restart
        retrying(lambda: index_of(a).invalidate(namespace=ACME))  # the new epoch 1
        index_of(a).invalidate(namespace=GLOBEX)
        d = fleet.host("d")
        assert hits(d, 6) == 0, "a record of the lost index was served by a fresh host"
        assert hits(b, 6) == 0, "a long-running host kept serving across the index loss"
        assert hits(a, 5, GLOBEX) == 0, "the host that issued a rule kept serving its copy"
        assert shared_of(b).details()["index_resets"] == 1
        put(b, 7)  # the new index works as any other
        b.flush()
        assert served(d, 7) == 4
    finally:
        fleet.close()


def _one_write(t: PublishedTier, seed: int) -> tuple[ReplicaMeta, np.ndarray, Reservation]:
    """A prepared write of one replica (its meta, its payload, the reservation)."""
    key = ChunkKey(bytes([seed]) * 32)
    arr = np.random.default_rng(seed).standard_normal(4096).astype(np.float16)
    meta = ReplicaMeta(key, "float16", (4096,), "exact", b"info")
    res = t.prepare_store([meta])
    assert isinstance(res, Reservation)
    return meta, arr, res


@pytest.mark.parametrize("revoked", [False, True])
def test_a_write_prepared_before_the_index_was_emptied_is_refused_whatever_its_token(
    tmp_path: Path, kind: str, private: RedisServer, request: pytest.FixtureRequest, revoked: bool
) -> None:
    """A write prepared under a lease of an index that then lost its state (after
    revoking the host, or not), committed once the host took a lease of the new index
    whose token has the same number (tokens count from 1 again): refused before its
    publish script (KVLRESET), nothing published, its payloads removed; the next write
    publishes. Without the check every bucket of the new index took the old token."""
    fleet = Fleet(tmp_path, kind, private.url, "renew", _master(kind, request))
    try:
        t = shared_of(fleet.host("a"))
        meta, arr, res = _one_write(t, 41)
        if revoked:
            index_of(fleet.host("admin")).revoke("a", ban_ms=60_000)
        raw = redis.Redis.from_url(private.url)
        raw.flushall()  # the index loses its state: its tokens, fences and bans with it
        t.index.refresh()
        again = t.index.lease()  # another of the host's threads takes a lease there
        assert again.token == res.state.lease.token  # the premise: the same number
        with pytest.raises(LeaseError, match="KVLRESET"):
            t.commit_store(res, [arr])
        assert raw.exists(t.index.record_key(meta.key)) == 0
        raw.close()
        assert t.used_bytes == 0 and not t.contains(meta.key)
        assert t.index.counters.publishes_refused == 1
        if isinstance(t, MooncakeTier):
            assert t.mc.is_exist(t._location(meta.key, res.state)) != 1
        assert t.store([meta], [arr])  # a write prepared now publishes
        assert np.array_equal(t.read(meta.key), arr)
    finally:
        fleet.close()


def test_a_reply_read_before_the_index_lost_its_state_never_rolls_a_host_back(
    tmp_path: Path, kind: str, private: RedisServer, request: pytest.FixtureRequest
) -> None:
    """Two threads of one host refresh: one's reply was read before the index lost its
    state and is taken in after the other's, read since. It is not taken in (replies are
    taken in in the order their reads were sent): the host stays on the new incarnation,
    counts one reset, and its rules and stamps are the new index's. Found by a red team:
    the stale reply rolled the host back to the lost incarnation, its rules cleared."""
    fleet = Fleet(tmp_path, kind, private.url, "stale", _master(kind, request))
    try:
        c = index_of(fleet.host("c"))
        c.refresh()
        lost = c.incarnation
        real = c.run_script
        read, release = threading.Event(), threading.Event()
        held = [True]

        def slow(name: str, keys: Sequence[str], args: Sequence[object]) -> object:
            out = real(name, keys, args)
            if name == "STATE" and held[0]:
                held[0] = False
                read.set()
                release.wait(10)  # the reply waits here, read before the loss
            return out

        c.run_script = slow  # type: ignore[method-assign]
        late = threading.Thread(target=c.refresh)
        late.start()
        assert read.wait(10)
        raw = redis.Redis.from_url(private.url)
        raw.flushall()  # the index loses its state
        raw.close()
        c.refresh()  # another thread of the host reads the new index first
        new = c.incarnation
        assert new != lost
        release.set()
        late.join(10)
        assert c.incarnation == new, "a stale reply rolled the host back to the lost index"
        assert c.counters.index_resets == 1 and c.counters.stale_replies == 1
        assert c.stamp().incarnation == new
    finally:
        fleet.close()


def test_an_index_unreachable_at_the_commit_leaves_no_payload_and_no_record(
    tmp_path: Path, kind: str, private: RedisServer, request: pytest.FixtureRequest
) -> None:
    """The index cut off after the prepare: the commit raises and publishes nothing; its
    Mooncake payloads, kept while the publish's outcome is unknown, are removed once the
    index answers again; then the write publishes."""
    port = int(private.url.rsplit(":", 1)[1].split("/")[0])
    fleet = Fleet(tmp_path, kind, private.url, "cut", _master(kind, request))
    try:
        with FaultProxy(("127.0.0.1", port)) as proxy:
            url = f"redis://127.0.0.1:{proxy.port}/0"
            t = shared_of(fleet.host("a", url=url, socket_timeout_s=1.0))
            meta, arr, res = _one_write(t, 42)
            proxy.set(Fault.partition())
            with pytest.raises(RemoteTierError):
                t.commit_store(res, [arr])
            proxy.set(Fault.none())
            assert t.used_bytes == 0 and t.details()["publish_failed"] == 1
            if isinstance(t, MooncakeTier):  # kept while the publish's outcome is unknown
                assert t.settle_removals(timeout_s=10) == 0
                assert t.mc.is_exist(t._location(meta.key, res.state)) != 1
            reader = shared_of(fleet.host("b"))
            assert retrying(lambda: reader.probe([meta.key], [meta.info])) == []
            assert retrying(lambda: t.store([meta], [arr]))  # the index is back: it publishes
            assert np.array_equal(t.read(meta.key), arr)
    finally:
        fleet.close()


def _commit_losing_replies(
    t: PublishedTier, res: Reservation, arrs: list[np.ndarray], ran: bool
) -> None:
    """Commit ``res`` through a publish whose replies are lost (the script ran, or not:
    ``ran``): the commit raises RemoteTierError."""
    real = t.index.client.pipeline
    t.index.client.pipeline = losing(real, 1, ran)
    try:
        with pytest.raises(RemoteTierError):
            t.commit_store(res, arrs)
    finally:
        t.index.client.pipeline = real


@pytest.mark.parametrize("ran", [True, False])
def test_a_publish_whose_replies_are_lost_is_taken_back_once_the_index_answers(
    fleet: Fleet, ran: bool
) -> None:
    """The connection fails after the publish script was sent, and it ran (``ran``) or
    not: the write raises; once the index answers, the record still the write's is
    taken back (a fenced delete: on Redis with its frame), counted, and the write then
    publishes. Before 2026-12-06 the Redis tier left such a record visible, held by no
    host and never deleted by its writer (docs/remote.md, Limits)."""
    t = shared_of(fleet.host("a"))
    meta, arr, res = _one_write(t, 43)
    _commit_losing_replies(t, res, [arr], ran=ran)
    idx = t.index
    raw = redis.Redis.from_url(fleet.url)
    try:
        assert raw.exists(idx.record_key(meta.key)) == (1 if ran else 0)
        assert t.details()["unknown_pending"] == 1
        assert t.settle_removals(timeout_s=10) == 0  # once the index's backoff is over
        assert raw.exists(idx.record_key(meta.key), idx.frame_key(meta.key)) == 0
        d = t.details()
        assert d["publishes_unknown"] == 1 and d["unknown_taken_back"] == (1 if ran else 0)
        assert d["publish_failed"] == 1 and t.used_bytes == 0
        assert t.store([meta], [arr])
        assert np.array_equal(t.read(meta.key), arr)
    finally:
        raw.close()


def test_settling_a_lost_publish_spares_the_same_record_published_again(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A publish whose replies were lost (it ran), then the same bytes published again
    under the same lease before the first is settled (another thread's write; the
    settle at the write's start is held off here to make that order certain): on Redis
    the two records are byte for byte the same. Settling the first must not take back
    the second, which its host holds: the replica stays and reads back."""
    t = shared_of(fleet.host("a"))
    meta, arr, res = _one_write(t, 44)
    _commit_losing_replies(t, res, [arr], ran=True)
    with monkeypatch.context() as m:
        m.setattr(UnknownOutcomes, "settle", lambda self, settle_one: None)
        assert retrying(lambda: t.store([meta], [arr]))
    assert t.settle_removals(timeout_s=10) == 0
    assert t.details()["unknown_taken_back"] == 0
    assert t.contains(meta.key) and np.array_equal(t.read(meta.key), arr)


def test_a_write_waits_for_a_settlement_under_way_and_keeps_its_replica(fleet: Fleet) -> None:
    """A publish whose replies were lost (it ran) is being settled by another thread's
    write (held inside its fenced delete here, the delete itself unchanged) when this
    thread stores the same bytes under the same lease: the store waits until the
    settlement is done, then publishes; its replica is held, present and read back.
    Before, the store published meanwhile and the settlement's delete, comparing equal
    bytes, took the new replica (found by a red team, 2026-12-06)."""
    t = shared_of(fleet.host("a"))
    meta, arr, res = _one_write(t, 46)
    _commit_losing_replies(t, res, [arr], ran=True)
    time.sleep(0.5)  # the index's backoff after the cut is over
    _, other_arr, other_res = _one_write(t, 47)
    at_delete, go = threading.Event(), threading.Event()
    real_delete = t._delete_records

    def held_open(
        keys: Sequence[ChunkKey], records: Sequence[RemoteRecord], frames: bool
    ) -> list[int]:
        if threading.current_thread().name == "settler" and not at_delete.is_set():
            at_delete.set()
            assert go.wait(20)
        return real_delete(keys, records, frames)

    t._delete_records = held_open  # type: ignore[method-assign]
    errors: list[BaseException] = []

    def run(fn: Callable[[], object]) -> Callable[[], None]:
        def body() -> None:
            try:
                fn()
            except BaseException as exc:
                errors.append(exc)

        return body

    settler = threading.Thread(
        target=run(lambda: t.commit_store(other_res, [other_arr])), name="settler"
    )
    settler.start()
    assert at_delete.wait(20)  # the settlement read what the host holds; about to delete
    again = threading.Thread(target=run(lambda: t.store([meta], [arr])))
    again.start()
    again.join(0.5)
    assert again.is_alive(), "a write published while a settlement was under way"
    go.set()
    settler.join(20)
    again.join(20)
    assert errors == []
    raw = redis.Redis.from_url(fleet.url)
    try:
        assert raw.exists(t.index.record_key(meta.key)) == 1
    finally:
        raw.close()
    assert meta.key in t.replica_keys() and np.array_equal(t.read(meta.key), arr)
    assert t.details()["unknown_taken_back"] == 1  # the lost publish's, before the new one


def test_a_store_closed_with_a_lost_publish_unsettled_logs_it(
    tmp_path: Path,
    kind: str,
    private: RedisServer,
    request: pytest.FixtureRequest,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A publish whose replies were lost, and the index cut off before the store
    closes: ``close`` tries once, returns, and logs what it leaves unsettled (the
    record, if published, stays visible: complete and verified). Before, it said
    nothing."""
    port = int(private.url.rsplit(":", 1)[1].split("/")[0])
    fleet = Fleet(tmp_path, kind, private.url, "closing", _master(kind, request))
    try:
        with FaultProxy(("127.0.0.1", port)) as proxy:
            url = f"redis://127.0.0.1:{proxy.port}/0"
            store = fleet.host("a", url=url, socket_timeout_s=1.0)
            t = shared_of(store)
            _, arr, res = _one_write(t, 48)
            _commit_losing_replies(t, res, [arr], ran=True)
            proxy.set(Fault.partition())
            with caplog.at_level(logging.WARNING, logger="kvlife.tiers.redis.published"):
                store.close(flush=False)
            assert "1 writes of unknown outcome unsettled" in caplog.text
            assert t.unknown.pending() == 1
    finally:
        fleet.close()


def test_a_write_the_tier_cannot_take_is_a_typed_error_that_leaves_nothing(
    fleet: Fleet,
) -> None:
    """A replica of more dimensions than a record's header holds is refused before
    anything is sent (InvalidArgument: nothing staged or put, nothing charged, the tier
    still healthy); a write after the tier closed is a RemoteTierError at once. Found by
    a red team (2026-12-06): the first raised a bare ValueError from the record's
    encoding once that moved beside the send, the second the thread pool's
    RuntimeError."""
    store = fleet.host("a")
    t = shared_of(store)
    shape = (1,) * 8 + (16,)
    meta = ReplicaMeta(ChunkKey(bytes([9]) * 32), "float16", shape, "exact", b"info")
    with pytest.raises(InvalidArgument, match="9 dimensions"):
        t.store([meta], [np.ones(shape, np.float16)])
    assert t.used_bytes == 0 and t.health.healthy and t.unknown.pending() == 0
    staged = t.index.client.keys(f"{{kvl:{t.index.config.namespace}:b*}}:s:*")
    assert not staged, "a payload was staged"
    arr = np.random.default_rng(50).standard_normal(4096).astype(np.float16)
    assert t.store([_one_write_meta(50)], [arr])  # the tier writes on
    store.close(flush=False)
    with pytest.raises(RemoteTierError, match="closed"):
        t.store([_one_write_meta(51)], [arr])


def _one_write_meta(seed: int) -> ReplicaMeta:
    return ReplicaMeta(ChunkKey(bytes([seed]) * 32), "float16", (4096,), "exact", b"info")


def test_a_take_back_whose_replies_are_lost_is_settled_later(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch over two buckets, one of which refuses it (one publish script per
    bucket: a cluster, forced here on one server for the Mooncake tier): the bucket
    that published is taken back, and that take-back's replies are lost. The write
    raises the refusal; the records are settled later, none left. Before 2026-12-06
    the Redis tier ignored the failed take-back (records left, held by no host)."""
    monkeypatch.setattr(GlobalIndex, "standalone", property(lambda self: False))
    t = shared_of(fleet.host("a"))
    keys = [ChunkKey(bytes([0, 1]) * 16), ChunkKey(bytes([0, 2]) * 16)]  # two buckets
    arrs = [np.full(2048, i, np.float16) for i in range(2)]
    metas = [ReplicaMeta(k, "float16", (2048,), "exact", b"info") for k in keys]
    res = t.prepare_store(metas)
    assert isinstance(res, Reservation)
    lease = res.state.lease
    raw = redis.Redis.from_url(fleet.url)
    try:
        raw.hset(t.index.fence_key(keys[1]), f"t:{lease.host}", lease.token + 99)
        real = t.index.client.pipeline
        t.index.client.pipeline = losing(real, 2, True)  # take-back
        try:
            with pytest.raises(LeaseError, match="KVLLOST"):
                t.commit_store(res, arrs)
        finally:
            t.index.client.pipeline = real
        names = [t.index.record_key(k) for k in keys]
        assert raw.exists(*names) == 0  # the take-back ran, only its replies were lost
        assert t.details()["unknown_pending"] == 1
        assert t.settle_removals(timeout_s=10) == 0
        assert raw.exists(*names, *[t.index.frame_key(k) for k in keys]) == 0
        assert t.details()["publishes_unknown"] == 1 and t.used_bytes == 0
    finally:
        raw.close()


def test_a_batch_refused_in_one_of_its_buckets_publishes_nothing(fleet: Fleet) -> None:
    """A batch over several buckets whose lease one bucket no longer holds (a token
    superseded there alone) is refused whole: no record of it visible to a reader, its
    Mooncake payloads removed; the next batch, under a fresh lease, publishes. On one
    server the Mooncake tier publishes a batch in one script (PUBLISH_RECORDS_ALL)."""
    t = shared_of(fleet.host("a"))
    keys = [ChunkKey(bytes([0, i]) * 16) for i in range(6)]  # first two bytes: six buckets
    arrs = [np.full(2048, i, np.float16) for i in range(6)]
    metas = [ReplicaMeta(k, "float16", (2048,), "exact", b"info") for k in keys]
    res = t.prepare_store(metas)
    assert isinstance(res, Reservation)
    idx = t.index
    assert len({idx.tag(k) for k in keys}) == 6
    raw = redis.Redis.from_url(fleet.url)
    raw.hset(idx.fence_key(keys[3]), f"t:{res.state.lease.host}", res.state.lease.token + 99)
    try:
        with pytest.raises(LeaseError, match="KVLLOST"):
            t.commit_store(res, arrs)
        records = [idx.record_key(k) for k in keys]
        assert raw.exists(*records) == 0, "part of a refused batch was published"
        assert t.used_bytes == 0 and not any(t.contains(k) for k in keys)
        if isinstance(t, MooncakeTier):
            assert all(t.mc.is_exist(t._location(k, res.state)) != 1 for k in keys)
        idx.drop_lease()  # the bucket's lease is another's now: a new token everywhere
        assert t.store(metas, arrs)
        assert raw.exists(*records) == 6
    finally:
        raw.close()
    for k, a in zip(keys, arrs, strict=True):
        assert np.array_equal(t.read(k), a)


def test_a_batch_naming_a_key_twice_publishes_the_last_one(fleet: Fleet) -> None:
    """One key twice in a batch (beside another key of its bucket): the last payload
    wins, every record of the batch is published and reads back exact, the counters
    count replicas, not entries. Found by a red team: the Redis tier's publish script
    renamed the first staged frame, failed on the second and left the records before
    it visible after a failed write."""
    t = shared_of(fleet.host("a"))
    k1 = ChunkKey(bytes([0, 1]) * 16)
    k2 = ChunkKey(bytes([0, 1]) + bytes([9]) * 30)
    assert t.index.tag(k1) == t.index.tag(k2)
    metas = [ReplicaMeta(k, "float16", (64,), "exact", b"info") for k in (k2, k1, k1)]
    arrs = [np.full(64, v, np.float16) for v in (1, 2, 3)]
    assert t.store(metas, arrs)
    assert np.array_equal(t.read(k2), arrs[0]) and np.array_equal(t.read(k1), arrs[2])
    d = t.details()
    assert d["published"] == 2 and d["publish_failed"] == 0 and d["corrupt"] == 0


def test_an_emptied_index_drops_what_hosts_adopted(
    tmp_path: Path, kind: str, private: RedisServer, request: pytest.FixtureRequest
) -> None:
    fleet = Fleet(tmp_path, kind, private.url, "gone", _master(kind, request))
    try:
        a, b = fleet.host("a"), fleet.host("b")
        put(a, 15)
        a.flush()
        assert [h.tier for h in look(b, 15).hits] == ["shared"] * 4  # adopted
        raw = redis.Redis.from_url(private.url)
        raw.flushall()
        raw.close()
        assert hits(b, 15) == 0
        b.drain()  # the dropped entries' deletes run in the background
        assert shared_of(b).used_bytes == 0, "adopted entries of the lost index stayed"
        assert shared_of(b).details()["index_resets"] == 1
        assert hits(a, 15) == 0  # A's copy was born under the lost index too
        put(a, 15)
        a.flush()
        assert served(b, 15) == 4
    finally:
        fleet.close()


def _chunks(kv: np.ndarray) -> list[np.ndarray]:
    n = TINY.tokens_per_chunk
    return [np.ascontiguousarray(kv[:, :, :, i * n : (i + 1) * n]) for i in range(4)]


def test_a_delete_planned_before_a_key_is_adopted_again_spares_the_new_replica(
    tmp_path: Path,
    kind: str,
    private: RedisServer,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by the multi-host model (seed 6, 400 steps): the lookup that finds the
    index emptied drops what B had adopted and plans the deletes of those replicas in
    the background, then adopts the keys again from C's new records. A delete that ran
    after the adoption (here: its first call slowed down, as a loaded machine did)
    deleted C's new records and left B's new replicas unheld; B then read whatever
    record came next unchecked, and served another host's int8 frames as exact KV."""
    fleet = Fleet(tmp_path, kind, private.url, "again", _master(kind, request))
    try:
        a, b, c = fleet.host("a"), fleet.host("b"), fleet.host("c")
        put(a, 31)
        a.flush()
        assert [h.tier for h in look(b, 31).hits] == ["shared"] * 4  # adopted from A
        raw = redis.Redis.from_url(private.url)
        raw.flushall()
        raw.close()
        tokens, _ = prompt_kv(31, 64)
        _, other = prompt_kv(32, 64)  # C computed other bytes for the same tokens
        retrying(lambda: c.put_prompt(tiny_identity(), ACME, tokens, other))
        c.flush()
        tier = shared_of(b)
        real = tier.contains

        def slow(key: ChunkKey) -> bool:  # the background delete's first call
            time.sleep(0.3)
            return real(key)

        monkeypatch.setattr(tier, "contains", slow)
        found = look(b, 31)  # the reset, then C's records adopted
        b.drain()
        monkeypatch.undo()
        assert len(found.hits) == 4
        e = fleet.host("e")
        got = e.load(look(e, 31))
        assert got.loaded == 4, "B's delete removed C's new records"
        for arr, want in zip(got.arrays, _chunks(other), strict=True):
            assert np.array_equal(arr, want)
        d = fleet.host("d", transform="int8")
        put(d, 31)
        d.flush()  # D's int8 frames replace C's records
        assert b.load(found).loaded == 0  # a miss, never D's frames as exact KV
    finally:
        fleet.close()


def test_letting_go_of_a_replica_keeps_another_hosts_record_of_the_same_bytes(
    fleet: Fleet,
) -> None:
    """Found by the multi-host model: B held A's record; C republished the same bytes
    (another record: C's host, token and stamp); B's read took C's record for its own
    ("the same replica"), so B's delete, when it let go, removed C's record."""
    a, b, c = fleet.host("a"), fleet.host("b"), fleet.host("c")
    put(a, 33)
    a.flush()
    assert len(look(b, 33).hits) == 4  # B holds A's records
    put(c, 33)
    c.flush()  # the same bytes, C's records now
    assert served(b, 33) == 4  # B reads them: the same replica
    b.evict("shared", 64 << 20)  # B lets go of everything it held there
    assert served(fleet.host("e"), 33) == 4, "B's delete removed C's record"


# ---------------------------------------------------------------------- item 5


def test_a_malformed_rule_is_refused_when_written(fleet: Fleet) -> None:
    a, b = fleet.host("a"), fleet.host("b")
    put(a, 8, GLOBEX)
    a.flush()
    assert served(b, 8, GLOBEX) == 4  # B holds its own copy now
    with pytest.raises(InvalidArgument, match="namespace"):
        index_of(a).invalidate(namespace="acme")  # a plain string: no namespace kind
    index_of(a).invalidate(namespace=GLOBEX)
    assert hits(b, 8, GLOBEX) == 0
    assert hits(a, 8, GLOBEX) == 0


def test_an_unreadable_rule_covers_everything_older_and_breaks_no_host(
    fleet: Fleet, index_ns: str
) -> None:
    a, b, c = fleet.host("a"), fleet.host("b"), fleet.host("c")
    put(a, 9)
    a.flush()
    assert served(b, 9) == 4
    raw = redis.Redis.from_url(fleet.url)  # a writer that is not kvlife (or a newer one)
    epoch = raw.incr(idx_key(index_ns, "epoch"))
    raw.hset(idx_key(index_ns, "rules"), str(epoch), b"\xc1 not a rule")
    raw.close()
    assert hits(b, 9) == 0  # what it might cover is not served
    put(b, 10)  # and the hosts keep working
    b.flush()
    assert served(c, 10) == 4
    assert shared_of(b).details()["rules_malformed"] == 1


# ---------------------------------------------------------------------- item 6


def test_kv_created_after_a_rule_survives_a_restart(fleet: Fleet) -> None:
    a = fleet.host("a")
    b = fleet.host("b", disk=True)
    index_of(a).invalidate(namespace=ACME)
    assert hits(b, 11) == 0  # B has read the rule
    assert put(b, 11) == 4
    b.flush()  # to B's disk, its first durable tier
    b.close()
    b = fleet.host("b", disk=True)  # a fresh index handle hands out every rule again
    assert served(b, 11) == 4, "acknowledged KV created after a rule was wiped at restart"
    put(b, 12)  # created before the next rule, on disk while B is down: covered
    b.close()
    index_of(a).invalidate(namespace=ACME)
    b = fleet.host("b", disk=True)
    assert hits(b, 12) == 0
    assert served(b, 11) == 0


# ---------------------------------------------------------------------- item 7


def test_a_revoke_leaves_no_moment_where_a_banned_host_publishes(
    fleet: Fleet, index_ns: str
) -> None:
    a, b, c = fleet.host("a"), fleet.host("b"), fleet.host("c")
    put(b, 30)
    b.flush()  # B holds a live lease
    put(b, 13)
    # an operator's account that may touch the index keys but not the buckets' keys: a
    # revoke in two steps does its first step and fails its second
    url = acl_url(fleet.url, f"op-{index_ns}", f"~{{kvl:{index_ns}:idx}}*", "+@all")
    operator = GlobalIndex(
        redis.Redis.from_url(url), IndexConfig(namespace=index_ns, host="op"), Health("op")
    )
    with pytest.raises(RemoteTierError):
        operator.revoke("b", ban_ms=60_000)
    raw = redis.Redis.from_url(fleet.url)
    banned = bool(raw.exists(idx_key(index_ns, "ban:b")))
    raw.close()
    with contextlib.suppress(LeaseError):
        b.flush()
    if banned:  # the revoke happened (in part): then the host is fenced everywhere
        assert hits(c, 13) == 0, "a banned host whose lease was revoked still published"
    index_of(a).revoke("b", ban_ms=60_000)  # a complete revoke
    put(b, 14)
    with pytest.raises(LeaseError):
        b.flush()
    assert hits(c, 14) == 0


def test_a_shorter_ban_never_cuts_a_longer_one_short(fleet: Fleet) -> None:
    """Found by the multi-host model's soak (seed 12): A was revoked with a ban of
    1500 ms, then again with 300 ms; the second ban replaced the first, and A published
    1.2 s before its first ban was over."""
    a, b = fleet.host("a"), fleet.host("b")
    index_of(b).revoke("a", ban_ms=5_000)
    index_of(b).revoke("a", ban_ms=100)
    time.sleep(0.4)  # the second ban is over, the first is not
    put(a, 34)
    with pytest.raises(LeaseError, match="KVLBANNED"):
        a.flush()
    assert hits(fleet.host("c"), 34) == 0


def test_publish_is_refused_once_the_lease_lapsed_whatever_the_client_claims(
    fleet: Fleet,
) -> None:
    t = shared_of(fleet.host("a", lease_ttl_ms=300))
    key = ChunkKey(bytes(range(32)))
    meta = ReplicaMeta(key, "float16", (512,), "exact", b"info")
    res = t.prepare_store([meta])
    assert isinstance(res, Reservation)
    time.sleep(0.6)  # the lease lapses between prepare and commit (a pause, a partition)
    lease = res.state.lease
    object.__setattr__(lease, "local_deadline", time.monotonic() + 60)  # a lying clock
    object.__setattr__(lease, "deadline_ms", int(time.time() * 1000) + 60_000)  # and deadline
    with pytest.raises(LeaseError):
        t.commit_store(res, [np.zeros(512, np.float16)])
    assert not t.contains(key)


# ---------------------------------------------------------------------- also


def test_store_invalidate_reaches_every_host(fleet: Fleet) -> None:
    a, b, c = fleet.host("a"), fleet.host("b"), fleet.host("c")
    put(a, 16)
    a.flush()
    assert served(b, 16) == 4  # B holds its own copy now
    assert look(c, 16).hits  # C adopted the records
    assert a.invalidate(namespace=ACME) >= 4
    for h in (a, b, c, fleet.host("d")):
        assert hits(h, 16) == 0, "KVStore.invalidate did not reach every host"


def test_a_revoked_host_cannot_delete_other_hosts_records(fleet: Fleet) -> None:
    a, b, c = fleet.host("a"), fleet.host("b"), fleet.host("c")
    put(a, 17)
    a.flush()
    assert len(look(b, 17).hits) == 4  # adopted by B
    index_of(a).revoke(index_of(b).host, ban_ms=60_000)
    b.evict("shared", 64 << 20)  # B lets go of everything it held there
    assert served(c, 17) == 4, "a revoked host deleted another host's records"


def test_a_delete_never_removes_a_record_published_after_it_was_read(fleet: Fleet) -> None:
    ta, tb = shared_of(fleet.host("a")), shared_of(fleet.host("b"))
    key = ChunkKey(bytes(range(1, 33)))
    info = ObjectInfo.for_chunk(tiny_identity(), ACME, ROOT_PARENT, 0).encode()
    born = ta.creation_stamp().encode()  # a record of no known epoch is adopted by no one
    meta = ReplicaMeta(key, "float16", (512,), "exact", info, born=born)
    x = np.full(512, 1, np.float16)
    y = np.full(512, 2, np.float16)
    ta.store([meta], [x])
    assert [m.key for m in tb.probe([key], [info])] == [key]  # B holds A's record
    ta.store([meta], [y])  # republished: a new record
    tb.delete(key)  # B lets go of what it held: the old record, not the new one
    assert np.array_equal(ta.read(key), y), "a delete removed a record published after it"


def test_hosts_with_different_bucket_counts_are_refused(fleet: Fleet) -> None:
    a = fleet.host("a")
    put(a, 18)
    a.flush()
    b = fleet.host("b", buckets=8)
    with pytest.raises(InvalidArgument, match="buckets"):
        look(b, 18)


def test_an_invalidation_refused_for_its_bucket_count_records_nothing(
    fleet: Fleet, index_ns: str
) -> None:
    """Found by the multi-host model: the misconfigured host's ``KVStore.invalidate``
    raised IndexMismatch, but the rule was in the index and every host applied it."""
    a = fleet.host("a")
    put(a, 19)
    a.flush()
    b = fleet.host("b", buckets=8)
    with pytest.raises(InvalidArgument, match="buckets"):
        b.invalidate(namespace=ACME)
    with pytest.raises(InvalidArgument, match="buckets"):
        index_of(b).invalidate(namespace=ACME)
    raw = redis.Redis.from_url(fleet.url)
    assert raw.hlen(idx_key(index_ns, "rules")) == 0, "a refused invalidation was recorded"
    raw.close()
    assert served(fleet.host("c"), 19) == 4


def test_two_lookups_racing_over_new_rules_both_trim(fleet: Fleet) -> None:
    port = int(fleet.url.rsplit(":", 1)[1].split("/")[0])
    with FaultProxy(("127.0.0.1", port)) as proxy:
        a = fleet.host("a")
        b = fleet.host("b", url=f"redis://127.0.0.1:{proxy.port}/0", socket_timeout_s=5.0)
        put(a, 19, GLOBEX)
        a.flush()
        assert len(look(b, 19, GLOBEX).hits) == 4  # adopted: applying a rule deletes them
        assert put(b, 20) == 4
        assert hits(b, 20) == 4
        index_of(a).invalidate(namespace=GLOBEX)
        index_of(a).invalidate(namespace=ACME)
        proxy.set(Fault.delay(0.1))  # every round trip of B takes 0.2 s now
        first = threading.Thread(target=lambda: look(b, 21))  # applies the new rules
        first.start()
        time.sleep(0.8)
        second = look(b, 20)  # started after both rules returned
        first.join()
        proxy.set(Fault.none())
        assert second.hits == [], "a lookup racing another over new rules was not trimmed"


def test_a_failed_delete_while_applying_rules_loses_no_rule(fleet: Fleet, index_ns: str) -> None:
    url = acl_url(fleet.url, f"nodel-{index_ns}", "~*", "+@all", "-del")
    a, b = fleet.host("a"), fleet.host("b", url=url)
    put(a, 22, GLOBEX)
    a.flush()
    assert len(look(b, 22, GLOBEX).hits) == 4  # adopted: B will fail to delete them
    put(a, 23)
    a.flush()
    assert served(b, 23) == 4  # B's own copy
    index_of(a).invalidate(namespace=GLOBEX)
    index_of(a).invalidate(namespace=ACME)
    look(b, 24)  # applies both rules; deleting the first one's records fails
    assert hits(b, 23) == 0, "the rule after a failed delete was lost"


def test_on_a_cluster_a_revoked_host_neither_publishes_nor_deletes(
    tmp_path: Path, redis_cluster: RedisClusterServers, index_ns: str
) -> None:
    """The cluster path of leases: grants, revocation and the lease check of publish
    and delete run one script per bucket (each atomic on its node)."""
    fleet = Fleet(tmp_path, "redis", "", index_ns)
    try:
        a, b, c = (fleet.host(n, cluster=redis_cluster.seeds) for n in "abc")
        put(a, 40)
        a.flush()
        assert len(look(b, 40).hits) == 4  # adopted by B
        put(b, 41)
        index_of(a).revoke(index_of(b).host, ban_ms=60_000)
        with pytest.raises(LeaseError):
            b.flush()
        b.evict("shared", 64 << 20)  # B lets go: A's records stay
        assert served(c, 40) == 4
        assert hits(c, 41) == 0
        assert index_of(b).counters.deletes_refused >= 4
    finally:
        fleet.close()

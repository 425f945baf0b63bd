"""Mooncake Store tier against a real master, inside a private network namespace.

The outer test (run in the default suite) starts ``pytest`` again under ``unshare -n``
with loopback (and a namespace-only veth) up, running the tier contract suite over the
Mooncake tier and the tests below; inside, those run against a master, a metadata
server and a Redis index started there."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import blake3
import numpy as np
import pytest
import redis
import xxhash

from kvlife.core.errors import (
    ChecksumMismatch,
    LeaseError,
    RemoteTierError,
    ReplicaNotFound,
    ReplicaReadError,
)
from kvlife.core.identity import ChunkKey
from kvlife.globalindex import GlobalIndex, IndexConfig, RemoteRecord
from kvlife.tiers.base import ReplicaMeta, Reservation
from kvlife.tiers.disk.frame import payload_checksum
from kvlife.tiers.mooncake import MooncakeConfig, MooncakeTier
from kvlife.tiers.mooncake.server import MooncakeMaster, in_private_netns, netns_command
from kvlife.tiers.mooncake.tier import _schedule
from kvlife.tiers.redis import RedisEndpoint
from kvlife.tiers.redis.server import RedisServer
from tests.remote.replies import losing

ROOT = Path(__file__).resolve().parents[2]


# Tests of test_global_rules.py whose rules live wholly in the Redis index (bans, leases,
# bucket counts, malformed rules, a lost index): the payload tier plays no part in them, and
# their redis parameter runs in the default suite. Their Mooncake parameter runs in the slow
# tier (each costs seconds of Mooncake client teardown); every global-rules test that
# publishes, adopts, replaces or deletes Mooncake payloads runs in the default suite.
INDEX_ONLY_RULES = (
    "malformed_rule",
    "unreadable_rule",
    "shorter_ban",
    "revoke_leaves_no_moment",
    "different_bucket_counts",
    "refused_for_its_bucket_count",
    "two_lookups_racing",
    "failed_delete_while_applying",
    "lost_its_state",
)


SHARDS = 5
"""Inner pytest processes run side by side (tests/remote/shard.py): the inner tests
mostly wait on Mooncake clients' closes (a second or two each, the GIL held), so five
shards, each in its own namespace with its own master and Redis, finish the same tests
in a fraction of the wall time of one (five: 48-51 s, three: 55-58 s, 2026-12-03)."""


MODEL = "tests/remote/test_multihost_model.py::test_mooncake_model_inner"
"""The multi-host model on Mooncake: in the default suite it runs beside the shards of
:func:`test_mooncake_suite_in_a_private_network_namespace`, a process (and namespace) of
its own (its runner in test_multihost_model.py is in the slow tier)."""


def _run_in_private_netns(
    files: list[str], select: str, at_least: int, beside: tuple[str, ...] = ()
) -> None:
    """``pytest files -k select`` under ``unshare -n``, as :data:`SHARDS` shards at once
    (each its own namespace), and each test of ``beside`` in a process of its own beside
    them: every process passes; at least ``at_least`` tests passed in all."""
    if os.geteuid() != 0:
        pytest.skip("unshare -n needs root (CI runs as root)")
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, text=True)
    if probe.returncode != 0:  # e.g. a container without CAP_SYS_ADMIN
        pytest.skip(f"no private network namespace here: {probe.stderr.strip()}")
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    inner = [*base, "-p", "tests.remote.shard", *files, "-k", select]
    commands = [[*inner, "--shard", f"{i}/{SHARDS}"] for i in range(SHARDS)]
    commands += [[*base, test] for test in beside]
    shards = [
        subprocess.Popen(
            netns_command(command),
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),  # children import this tree
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for command in commands
    ]
    total = 0
    try:
        for shard in shards:
            out, _ = shard.communicate(timeout=580)  # the summary is on stdout
            tail = out[-3000:]
            assert shard.returncode == 0, tail
            assert not re.search(r"\d+ failed", tail), tail
            passed = re.search(r"\b(\d+) passed", tail)
            assert passed, tail
            total += int(passed.group(1))
    finally:
        for shard in shards:
            if shard.poll() is None:
                shard.kill()
                shard.wait(timeout=10)
    assert total >= at_least, f"{total} tests passed in all, expected at least {at_least}"


@pytest.mark.skipif(in_private_netns(), reason="this is the runner; it runs outside")
def test_mooncake_suite_in_a_private_network_namespace() -> None:
    _run_in_private_netns(
        [
            "tests/test_tier_contract.py",
            "tests/remote/test_mooncake.py",
            "tests/remote/test_global_rules.py",
        ],
        f"mooncake and not ({' or '.join(INDEX_ONLY_RULES)})",
        at_least=31,
        beside=(MODEL,),
    )


@pytest.mark.slow  # the Mooncake parameter of the index-only rules (see INDEX_ONLY_RULES)
@pytest.mark.skipif(in_private_netns(), reason="this is the runner; it runs outside")
def test_mooncake_index_only_rules_in_a_private_network_namespace() -> None:
    _run_in_private_netns(
        ["tests/remote/test_global_rules.py"],
        f"mooncake and ({' or '.join(INDEX_ONLY_RULES)})",
        at_least=len(INDEX_ONLY_RULES),
    )


HOLDER = """
import sys, time
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
rc = s.setup("127.0.0.1", sys.argv[2], 128 << 20, 16 << 20, "tcp", "", sys.argv[1])
print("up", rc, flush=True)
time.sleep(600)
"""


def k(i: int) -> ChunkKey:
    return ChunkKey(blake3.blake3(b"mc%d" % i).digest())


@pytest.mark.skipif(not in_private_netns(), reason="runs inside the private namespace")
def test_mooncake_payload_lost_with_its_holder_is_a_miss(
    mooncake_master: MooncakeMaster, redis_server: RedisServer, index_ns: str
) -> None:
    """A segment holder dies: ``is_exist`` may still say yes while ``get`` is empty; the
    tier reports a miss (or, once the record goes, not found), never short bytes."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, mooncake_master.master, mooncake_master.metadata],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().startswith("up 0")
        cfg = MooncakeConfig(mooncake_master.master, mooncake_master.metadata, segment_bytes=0)
        tier = MooncakeTier(
            cfg, RedisEndpoint(url=redis_server.url), 1 << 28, index=IndexConfig(namespace=index_ns)
        )
        arrs = [
            np.random.default_rng(i).standard_normal(1 << 17).astype(np.float16) for i in range(4)
        ]
        metas = [ReplicaMeta(k(i), "float16", a.shape, "exact", b"i") for i, a in enumerate(arrs)]
        assert tier.store(metas, arrs)
        assert all(np.array_equal(tier.read(k(i)), arrs[i]) for i in range(4))
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=10)
        time.sleep(0.5)
        wrong = 0
        for _ in range(3):
            try:
                got = tier.read_batch([k(i) for i in range(4)])
            except ReplicaNotFound:
                continue
            for i, g in enumerate(got):
                if isinstance(g, np.ndarray):
                    wrong += int(not np.array_equal(g, arrs[i]))
                else:
                    assert isinstance(g, ReplicaReadError), g
        assert wrong == 0
        tier.close()
    finally:
        if holder.poll() is None:
            os.kill(holder.pid, signal.SIGKILL)
            holder.wait(timeout=10)


def _tier(m: MooncakeMaster, redis_server: RedisServer, ns: str, **cfg: object) -> MooncakeTier:
    config = MooncakeConfig(m.master, m.metadata, segment_bytes=128 << 20, **cfg)  # type: ignore[arg-type]
    return MooncakeTier(
        config, RedisEndpoint(url=redis_server.url), 1 << 28, index=IndexConfig(namespace=ns)
    )


def _chunks(n: int, elems: int) -> list[np.ndarray]:
    return [
        np.random.default_rng(100 + i).standard_normal(elems).astype(np.float16) for i in range(n)
    ]


@pytest.mark.skipif(not in_private_netns(), reason="runs inside the private namespace")
def test_mooncake_removal_waits_for_the_read_lease_of_a_reader(
    mooncake_master: MooncakeMaster, redis_server: RedisServer, index_ns: str
) -> None:
    """A deleted object that was just read keeps its bytes (Mooncake's read lease: a
    forced remove let the next put reuse the memory under a reader); its removal is
    deferred, counted, and done once the lease lapsed."""
    tier = _tier(mooncake_master, redis_server, index_ns, read_lease_s=0.5)
    try:
        arrs = _chunks(2, 1 << 16)
        metas = [ReplicaMeta(k(i), "float16", a.shape, "exact", b"i") for i, a in enumerate(arrs)]
        assert tier.store(metas, arrs)
        locs = []
        for i in range(2):
            rec = tier._records([k(i)])[0]
            assert not isinstance(rec, Exception) and rec is not None
            locs.append(rec.location)
        got = tier.read_batch([k(0), k(1)])
        assert all(
            isinstance(g, np.ndarray) and np.array_equal(g, a)
            for g, a in zip(got, arrs, strict=True)
        )
        tier.delete_batch([k(0), k(1)])
        with pytest.raises(ReplicaNotFound):
            tier.read_batch([k(0)])
        d = tier.details()
        assert d["removals_deferred"] == 2 and d["removals_pending"] == 2
        assert [tier.mc.is_exist(loc) for loc in locs] == [1, 1]  # still held for the reader
        assert tier.settle_removals(timeout_s=10.0) == 0  # the master's lease here: 2 s
        assert [tier.mc.is_exist(loc) for loc in locs] == [0, 0]
        assert tier.details()["removals_reaped"] == 2
    finally:
        tier.close()


@pytest.mark.skipif(not in_private_netns(), reason="runs inside the private namespace")
@pytest.mark.parametrize("register", [False, True])
def test_mooncake_large_batch_with_a_repeated_key_reads_exact_bytes(
    mooncake_master: MooncakeMaster, redis_server: RedisServer, index_ns: str, register: bool
) -> None:
    """A batch of 24 MiB (fetched in groups while verified) asking one key three times:
    each answer is that key's exact bytes (Mooncake fills only one of two destinations
    of a key repeated in one batch_get_into), into ``outs`` or new arrays, with and
    without registering the buffers."""
    tier = _tier(mooncake_master, redis_server, index_ns, register_buffers=register)
    try:
        arrs = _chunks(12, 1 << 20)  # 2 MiB each
        metas = [ReplicaMeta(k(i), "float16", a.shape, "exact", b"i") for i, a in enumerate(arrs)]
        assert tier.store(metas, arrs)
        order = [0, 1, 0, *range(2, 12), 0]
        outs: list[np.ndarray | None] = [
            np.empty(1 << 20, np.float16) if j % 2 else None for j in range(len(order))
        ]
        for dest in (None, outs):
            got = tier.read_batch([k(i) for i in order], dest)
            for j, (i, g) in enumerate(zip(order, got, strict=True)):
                assert isinstance(g, np.ndarray) and np.array_equal(g, arrs[i]), (j, i)
                if dest is not None and outs[j] is not None:
                    assert g is outs[j]
        d = tier.details()
        assert d["corrupt"] == 0 and d["reread_ok"] == 0 and d["read_misses"] == 0
    finally:
        tier.close()


@pytest.mark.skipif(not in_private_netns(), reason="runs inside the private namespace")
def test_mooncake_takes_the_checksum_a_payload_is_known_by_or_checks_it(
    mooncake_master: MooncakeMaster, redis_server: RedisServer, index_ns: str
) -> None:
    """A copy's checksum (a replica the store verified or sealed) is taken as given, not
    hashed again; with ``verify_checksum`` a payload that differs fails the write (typed,
    nothing published, nothing charged); a wrong checksum taken as given is a counted
    corrupt replica on the read, never its bytes."""
    tier = _tier(mooncake_master, redis_server, index_ns)
    try:
        (a,) = _chunks(1, 1 << 15)
        right = bytes(xxhash.xxh3_128_digest(a.tobytes()))
        wrong = bytes(16)
        k1, k2, k3, k4 = (k(40 + i) for i in range(4))

        def meta(key: ChunkKey, checksum: bytes = b"", verify: bool = False) -> ReplicaMeta:
            return ReplicaMeta(
                key, "float16", a.shape, "exact", b"i", checksum=checksum, verify_checksum=verify
            )

        res = tier.prepare_store([meta(k1, wrong, True)])
        assert isinstance(res, Reservation)
        with pytest.raises(ChecksumMismatch):  # found beside the copy, which went ahead
            tier.commit_store(res, [a])
        assert not tier.contains(k1) and tier.used_bytes == 0
        assert tier.mc.is_exist(tier._location(k1, res.state)) != 1  # and was removed
        assert tier.details()["publish_failed"] == 1
        tier.store([meta(k2, right, True)], [a])
        tier.store([meta(k3)], [a])
        assert tier.meta(k2).checksum == tier.meta(k3).checksum == right
        tier.store([meta(k4, wrong)], [a])  # vouched for: not hashed
        assert tier.meta(k4).checksum == wrong
        got = tier.read_batch([k2, k3, k4])
        assert all(isinstance(g, np.ndarray) and np.array_equal(g, a) for g in got[:2])
        assert isinstance(got[2], ChecksumMismatch), "a wrong checksum taken as given is a miss"
        assert tier.details()["corrupt"] == 1
    finally:
        tier.close()


@pytest.mark.skipif(not in_private_netns(), reason="runs inside the private namespace")
def test_mooncake_copy_that_fails_beside_the_records_leaves_nothing(
    mooncake_master: MooncakeMaster, redis_server: RedisServer, index_ns: str
) -> None:
    """The copy runs on a worker while the writer's thread builds the records: a batch
    Mooncake cannot place (320 MiB into segments of 128 MiB: a real refusal, not a
    stub) raises a typed error, publishes no record, leaves no payload of the batch
    behind (the part Mooncake did place is removed) and charges nothing; the tier
    writes again at once."""
    config = MooncakeConfig(
        mooncake_master.master, mooncake_master.metadata, segment_bytes=128 << 20
    )
    tier = MooncakeTier(
        config, RedisEndpoint(url=redis_server.url), 1 << 30, index=IndexConfig(namespace=index_ns)
    )
    try:
        arrs = [np.full(8 << 20, i, np.float16) for i in range(20)]  # 16 MiB each
        keys = [k(60 + i) for i in range(20)]
        metas = [
            ReplicaMeta(key, "float16", a.shape, "exact", b"i")
            for key, a in zip(keys, arrs, strict=True)
        ]
        res = tier.prepare_store(metas)
        assert isinstance(res, Reservation)
        with pytest.raises(RemoteTierError, match="batch_put_from"):
            tier.commit_store(res, arrs)
        assert tier.used_bytes == 0 and tier.details()["publish_failed"] == 20
        assert not any(tier.contains(key) for key in keys)
        assert all(tier.mc.is_exist(tier._location(key, res.state)) != 1 for key in keys)
        (small,) = _chunks(1, 1 << 12)
        meta = ReplicaMeta(k(80), "float16", small.shape, "exact", b"i")
        assert tier.store([meta], [small])
        assert np.array_equal(tier.read(meta.key), small)
    finally:
        tier.close()


@pytest.mark.skipif(not in_private_netns(), reason="runs inside the private namespace")
def test_mooncake_write_with_checksums_known_never_waits_for_a_copy_refused(
    mooncake_master: MooncakeMaster, redis_server: RedisServer, index_ns: str
) -> None:
    """A write whose checksums are all known lets the worker reach the copy before it
    builds the records; a copy refused before it starts (Mooncake's backoff after a
    failure) still ends the write at once, typed, with nothing published or charged,
    and once the backoff is over the same write publishes."""
    tier = _tier(mooncake_master, redis_server, index_ns)
    try:
        arrs = _chunks(8, 1 << 14)
        keys = [k(90 + i) for i in range(8)]
        metas = [
            ReplicaMeta(key, "float16", a.shape, "exact", b"i", checksum=payload_checksum(a))
            for key, a in zip(keys, arrs, strict=True)
        ]
        tier.mc_health.base_s = 0.5
        tier.mc_health.failed("a failed call: backoff")
        outcome: list[BaseException | bool] = []

        def write() -> None:
            try:
                outcome.append(tier.store(metas, arrs))
            except BaseException as exc:  # examined below
                outcome.append(exc)

        t = threading.Thread(target=write)
        t.start()
        t.join(10)
        assert not t.is_alive(), "the write waited for a copy that never started"
        assert isinstance(outcome[0], RemoteTierError) and "unhealthy" in str(outcome[0])
        assert tier.used_bytes == 0 and not any(tier.contains(key) for key in keys)
        time.sleep(tier.mc_health.retry_in() + 0.01)
        assert tier.store(metas, arrs)
        for g, a in zip(tier.read_batch(keys), arrs, strict=True):
            assert isinstance(g, np.ndarray) and np.array_equal(g, a)
    finally:
        tier.close()


def _corrupt(tier: MooncakeTier, key: ChunkKey, original: np.ndarray, at: int) -> None:
    """Replace the Mooncake object behind ``key``'s record with a copy of ``original``
    whose byte ``at`` is flipped: a real damaged object in the real store, under the
    name the record gives (the record and its checksum are left as they were)."""
    rec = tier._records([key])[0]
    assert isinstance(rec, RemoteRecord) and rec.location
    bad = original.reshape(-1).view(np.uint8).copy()
    bad[at] ^= 0x5A
    assert tier.mc.batch_remove([rec.location], True) == [0]
    assert tier.mc.batch_put_from([rec.location], [bad.ctypes.data], [bad.nbytes]) == [0]
    back = np.empty_like(bad)
    assert tier.mc.batch_get_into([rec.location], [back.ctypes.data], [bad.nbytes]) == [bad.nbytes]
    assert np.array_equal(back, bad)


@pytest.mark.skipif(not in_private_netns(), reason="runs inside the private namespace")
def test_mooncake_corrupt_byte_in_any_fetch_group_is_caught(
    mooncake_master: MooncakeMaster, redis_server: RedisServer, index_ns: str
) -> None:
    """A 24 MiB read is fetched in groups (each its own ``batch_get_into``) and verified
    group by group while the next is copied. One flipped byte in a real object of any
    group (its first or last payload, at the payload's first, middle or last byte) is
    a counted corrupt replica, never served; every other payload of the batch is read
    exact. Both ways a read goes: fetched beside the record reads (this host holds the
    records: ``_fetch_ahead``) and after them (another host that holds none)."""
    writer = _tier(mooncake_master, redis_server, index_ns)
    other = _tier(mooncake_master, redis_server, index_ns)
    try:
        arrs = _chunks(12, 1 << 20)  # 2 MiB each: three fetch groups of 8 MiB
        keys = [k(200 + i) for i in range(12)]
        metas = [
            ReplicaMeta(key, "float16", a.shape, "exact", b"i")
            for key, a in zip(keys, arrs, strict=True)
        ]
        groups = _schedule([a.nbytes for a in arrs])
        assert len(groups) >= 3, groups
        victims = sorted({i for g in groups for i in (g[0], g[-1])})
        assert writer.store(metas, arrs)
        size = arrs[0].nbytes
        for n, victim in enumerate(victims):
            at = (0, size // 2 + 7, size - 1)[n % 3]
            _corrupt(writer, keys[victim], arrs[victim], at)
            for reader, into in ((writer, True), (other, False), (writer, False), (other, True)):
                before = reader.details()["corrupt"]
                outs: list[np.ndarray | None] | None = (
                    [np.empty_like(a) for a in arrs] if into else None
                )
                got = reader.read_batch(keys, outs)
                for i, g in enumerate(got):
                    if i == victim:
                        assert isinstance(g, ChecksumMismatch), (victim, at, type(g))
                    else:
                        assert isinstance(g, np.ndarray) and np.array_equal(g, arrs[i]), (i, victim)
                assert reader.details()["corrupt"] == before + 1
            assert writer.store([metas[victim]], [arrs[victim]])  # whole again (a new object)
            assert np.array_equal(writer.read(keys[victim]), arrs[victim])
    finally:
        other.close()
        writer.close()


@pytest.mark.skipif(not in_private_netns(), reason="runs inside the private namespace")
def test_mooncake_read_fetched_ahead_follows_a_record_moved_to_another_object(
    mooncake_master: MooncakeMaster, redis_server: RedisServer, index_ns: str
) -> None:
    """A host fetches the objects its held records name while it reads the records
    again. Another host republishes the same bytes under new objects (and removes the
    old ones): the read serves each payload from the object the record names now,
    exact; republished with other bytes, the read is a miss (ReplicaNotFound) and
    leaves nothing in flight."""
    a = _tier(mooncake_master, redis_server, index_ns)
    b = _tier(mooncake_master, redis_server, index_ns)
    try:
        arrs = _chunks(6, 1 << 21)  # 4 MiB each: a batch fetched in groups
        keys = [k(300 + i) for i in range(6)]
        metas = [
            ReplicaMeta(key, "float16", x.shape, "exact", b"i")
            for key, x in zip(keys, arrs, strict=True)
        ]
        assert a.store(metas, arrs)
        old: list[str] = []
        for key in keys:
            rec = a._records([key])[0]
            assert isinstance(rec, RemoteRecord)
            old.append(rec.location)
        assert b.store(metas[::2], arrs[::2])  # keys 0, 2, 4 now name b's objects
        assert b.settle_removals(timeout_s=10.0) == 0
        for i, key in enumerate(keys):
            now = a._records([key])[0]
            assert isinstance(now, RemoteRecord)
            assert (now.location != old[i]) == (i % 2 == 0)
            if i % 2 == 0:  # the object a's held record names is gone
                assert a.mc.is_exist(old[i]) != 1
        for outs in (None, [np.empty_like(x) for x in arrs]):
            got = a.read_batch(keys, outs)
            for g, x in zip(got, arrs, strict=True):
                assert isinstance(g, np.ndarray) and np.array_equal(g, x)
        d = a.details()
        assert d["corrupt"] == 0 and d["read_misses"] == 0 and d["reread_ok"] == 0
        other = [x + np.float16(1) for x in arrs]
        assert b.store(metas[1:2], other[1:2])  # other bytes: not a's replica any more
        with pytest.raises(ReplicaNotFound):
            a.read_batch(keys, [np.empty_like(x) for x in arrs])
        got = a.read_batch(keys[2:])
        for g, x in zip(got, arrs[2:], strict=True):
            assert isinstance(g, np.ndarray) and np.array_equal(g, x)
    finally:
        b.close()
        a.close()


@pytest.mark.skipif(not in_private_netns(), reason="runs inside the private namespace")
def test_mooncake_reads_fetched_ahead_under_overwrites_serve_one_version_whole(
    mooncake_master: MooncakeMaster, redis_server: RedisServer, index_ns: str
) -> None:
    """Batches large enough to be fetched ahead, read by two threads while this host
    overwrites their keys with another version and back (new objects each time, the old
    ones removed once their read lease lapses): every payload served is one version of
    its key, whole; the rest are typed misses; nothing counted corrupt."""
    tier = _tier(mooncake_master, redis_server, index_ns, read_lease_s=0.5)
    try:
        n = 6
        versions = [_chunks(n, 1 << 21), [x + np.float16(1) for x in _chunks(n, 1 << 21)]]
        keys = [k(400 + i) for i in range(n)]
        metas = [
            ReplicaMeta(key, "float16", x.shape, "exact", b"i")
            for key, x in zip(keys, versions[0], strict=True)
        ]
        assert tier.store(metas, versions[0])
        stop = time.monotonic() + 3.0
        bad: list[str] = []
        served = [0]

        def reader(into: bool) -> None:
            outs: list[np.ndarray | None] | None = (
                [np.empty_like(x) for x in versions[0]] if into else None
            )
            while time.monotonic() < stop:
                try:
                    got = tier.read_batch(keys, outs)
                except ReplicaNotFound:
                    continue  # held record replaced meanwhile: a miss
                for i, g in enumerate(got):
                    if isinstance(g, np.ndarray):
                        served[0] += 1
                        if not any(np.array_equal(g, v[i]) for v in versions):
                            bad.append(f"key {i}: bytes of no version")
                    elif not isinstance(g, ReplicaReadError):
                        bad.append(f"key {i}: {type(g).__name__}: {g}")

        threads = [threading.Thread(target=reader, args=(into,)) for into in (True, False)]
        for t in threads:
            t.start()
        turn = 0
        try:
            while time.monotonic() < stop:
                turn += 1
                pick = [i for i in range(n) if (i + turn) % 2]
                # paced: an object read in the last 2 s (the master's read lease) keeps
                # its memory, and the segment is 128 MiB
                time.sleep(0.3)
                tier.store([metas[i] for i in pick], [versions[turn % 2][i] for i in pick])
        finally:
            for t in threads:
                t.join()
        assert not bad, bad[:5]
        assert served[0] > 0 and turn > 2
        assert tier.details()["corrupt"] == 0
    finally:
        tier.close()


@pytest.mark.skipif(not in_private_netns(), reason="runs inside the private namespace")
def test_mooncake_bare_verified_calls_count_a_payload_that_is_not_what_was_put(
    mooncake_master: MooncakeMaster, redis_server: RedisServer, index_ns: str
) -> None:
    """The bench's bare verified calls (kvlife/bench/remote_verified.py) hash every payload
    it puts and gets against the digest of what it was asked to put: exact payloads
    count nothing wrong in both of its get modes, and a payload changed after its digest
    was taken is counted wrong on the put and on the get, so they cannot skip the work
    they stand for."""
    from kvlife.bench.remote_verified import BareVerified

    tier = _tier(mooncake_master, redis_server, index_ns)
    mc = tier.mc
    bare = BareVerified(mc, lambda names: mc.batch_remove(names, True))
    try:
        size = 1 << 20
        arrs = [np.random.default_rng(i).integers(0, 256, size, np.uint8) for i in range(20)]
        runs = bare.runs(size)
        assert set(runs) == {"bare_serial", "bare_pipelined"}
        for rep, run in enumerate(runs.values()):
            put_s, get_s, wrong, _, _ = run(arrs, rep)
            assert wrong == 0 and put_s > 0 and get_s > 0
        arrs[13][777] ^= 0xFF  # after the digests of this batch were taken
        for rep, run in enumerate(runs.values(), start=2):
            assert run(arrs, rep)[2] == 2  # its put and its get
    finally:
        bare.close()
        tier.close()


@pytest.mark.skipif(not in_private_netns(), reason="runs inside the private namespace")
@pytest.mark.parametrize("ran", [True, False])
def test_mooncake_publish_of_unknown_outcome_never_leaves_a_record_without_its_payload(
    mooncake_master: MooncakeMaster, redis_server: RedisServer, index_ns: str, ran: bool
) -> None:
    """The connection fails after the publish scripts were sent: whether they ran
    (``ran``) or not, the write raises and keeps its payloads (a record may name them:
    one naming a removed payload was a miss for every host that adopted it, found by a
    red team); once the index answers again the records still the write's are taken
    back and the payloads no record names are removed; the write then publishes."""
    tier = _tier(mooncake_master, redis_server, index_ns)
    raw = redis.Redis.from_url(redis_server.url)
    try:
        arrs = _chunks(4, 1 << 16)
        metas = [ReplicaMeta(k(i), "float16", a.shape, "exact", b"i") for i, a in enumerate(arrs)]
        res = tier.prepare_store(metas)
        assert isinstance(res, Reservation)
        real = tier.client.pipeline
        tier.client.pipeline = losing(real, 1, ran)  # the commit's first: its publish
        try:
            with pytest.raises(RemoteTierError):
                tier.commit_store(res, arrs)
        finally:
            tier.client.pipeline = real
        names = [tier.index.record_key(m.key) for m in metas]
        locs = [tier._location(m.key, res.state) for m in metas]
        assert raw.exists(*names) == (4 if ran else 0)
        assert [tier.mc.is_exist(loc) for loc in locs] == [1] * 4  # kept until known
        assert tier.details()["unknown_pending"] == 1
        assert tier.settle_removals(timeout_s=10) == 0  # once the index's backoff is over
        assert raw.exists(*names) == 0
        assert all(tier.mc.is_exist(loc) != 1 for loc in locs)
        d = tier.details()
        assert d["publishes_unknown"] == 4 and d["unknown_taken_back"] == (4 if ran else 0)
        assert d["publish_failed"] == 4 and tier.used_bytes == 0
        assert tier.store(metas, arrs)
        for m, a in zip(metas, arrs, strict=True):
            assert np.array_equal(tier.read(m.key), a)
    finally:
        raw.close()
        tier.close()


@pytest.mark.skipif(not in_private_netns(), reason="runs inside the private namespace")
def test_mooncake_take_back_of_unknown_outcome_keeps_the_payloads_its_records_name(
    mooncake_master: MooncakeMaster,
    redis_server: RedisServer,
    index_ns: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cluster path (one publish script per bucket, forced here on one server): one
    bucket refuses the batch, another published it, and the take-back of the published
    bucket loses its replies. The payloads its records may name stay until settled
    (before, every payload of the batch was removed under those records: found by a red
    team); then no record and no payload of the batch remain."""
    monkeypatch.setattr(GlobalIndex, "standalone", property(lambda self: False))
    tier = _tier(mooncake_master, redis_server, index_ns)
    raw = redis.Redis.from_url(redis_server.url)
    try:
        keys = [ChunkKey(bytes([0, 1]) * 16), ChunkKey(bytes([0, 2]) * 16)]  # two buckets
        arrs = _chunks(2, 1 << 16)
        metas = [
            ReplicaMeta(key, "float16", a.shape, "exact", b"i")
            for key, a in zip(keys, arrs, strict=True)
        ]
        res = tier.prepare_store(metas)
        assert isinstance(res, Reservation)
        lease = res.state.lease
        raw.hset(tier.index.fence_key(keys[1]), f"t:{lease.host}", lease.token + 99)
        real = tier.client.pipeline
        tier.client.pipeline = losing(real, 2, True)  # 2: the take-back
        try:
            with pytest.raises(LeaseError, match="KVLLOST"):
                tier.commit_store(res, arrs)
        finally:
            tier.client.pipeline = real
        names = [tier.index.record_key(key) for key in keys]
        locs = [tier._location(key, res.state) for key in keys]
        assert raw.exists(*names) == 0  # the take-back ran, only its replies were lost
        assert tier.mc.is_exist(locs[0]) == 1  # kept: its outcome was unknown
        assert tier.details()["unknown_pending"] == 1
        assert tier.settle_removals(timeout_s=10) == 0
        assert all(tier.mc.is_exist(loc) != 1 for loc in locs)
        assert tier.details()["publishes_unknown"] == 1
    finally:
        raw.close()
        tier.close()

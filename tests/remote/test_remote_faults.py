"""Real network faults (the FaultProxy between a Redis tier and its server) and real
server faults (SIGKILL, SIGSTOP): each read is the exact bytes or a typed miss, the tier
is marked unhealthy and retried after a backoff, and a put cut short is never
half-visible."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import blake3
import numpy as np
import pytest

from kvlife.core.errors import ChecksumMismatch, KVLifeError, ReplicaNotFound, ReplicaReadError
from kvlife.core.identity import ChunkKey
from kvlife.faults.proxy import Fault, FaultProxy
from kvlife.globalindex import IndexConfig
from kvlife.tiers.base import ReplicaMeta
from kvlife.tiers.redis import RedisEndpoint, RedisTier
from kvlife.tiers.redis.server import RedisServer

N = 6


def k(i: int) -> ChunkKey:
    return ChunkKey(blake3.blake3(b"fault%d" % i).digest())


def arr(i: int) -> np.ndarray:
    return np.random.default_rng(i).standard_normal(64 << 10).astype(np.float16)  # 128 KiB


def meta(i: int) -> ReplicaMeta:
    return ReplicaMeta(k(i), "float16", (64 << 10,), "exact", b"info%d" % i)


def make(port: int, ns: str, timeout_s: float = 0.3) -> RedisTier:
    ep = RedisEndpoint(
        url=f"redis://127.0.0.1:{port}/0", socket_timeout_s=timeout_s, connect_timeout_s=timeout_s
    )
    return RedisTier(ep, 1 << 26, index=IndexConfig(namespace=ns), backoff_s=0.05)


@pytest.fixture
def proxied(
    redis_server: RedisServer, index_ns: str
) -> Iterator[tuple[RedisTier, RedisTier, FaultProxy]]:
    direct = make(redis_server.port, index_ns, timeout_s=2.0)
    assert direct.store([meta(i) for i in range(N)], [arr(i) for i in range(N)])
    with FaultProxy(("127.0.0.1", redis_server.port)) as proxy:
        via = make(proxy.port, index_ns)
        yield direct, via, proxy
        via.close()
    direct.close()


def read_all(t: RedisTier) -> tuple[int, int, int]:
    """(exact hits, typed misses, wrong arrays) over every key, one batch and singles."""
    hits = misses = wrong = 0
    for batch in ([k(i) for i in range(N)], [k(0)], [k(N - 1)]):
        try:
            got = t.read_batch(batch)
        except ReplicaNotFound:
            misses += len(batch)
            continue
        for key, g in zip(batch, got, strict=True):
            i = next(j for j in range(N) if k(j) == key)
            if isinstance(g, np.ndarray):
                if np.array_equal(g, arr(i)):
                    hits += 1
                else:
                    wrong += 1
            else:
                assert isinstance(g, (ReplicaReadError, ChecksumMismatch)), g
                misses += 1
    return hits, misses, wrong


FAULTS = {
    "delay-under-timeout": Fault.delay(0.02),
    "delay-over-timeout": Fault.delay(0.5),
    "bandwidth": Fault.bandwidth(2 << 20),
    "drop": Fault.drop(),
    "reset": Fault.reset(),
    "partition": Fault.partition(),
    "truncate": Fault.truncate(1000),
    "flip": Fault.flip(50_000),
}


@pytest.mark.parametrize("name", list(FAULTS))
def test_reads_under_a_fault_are_exact_or_a_typed_miss(
    proxied: tuple[RedisTier, RedisTier, FaultProxy], name: str
) -> None:
    direct, via, proxy = proxied
    assert read_all(via) == (N + 2, 0, 0)
    proxy.set(FAULTS[name])
    hits, misses, wrong = read_all(via)
    assert wrong == 0, f"{name}: {wrong} wrong arrays served"
    if name == "delay-under-timeout":
        assert (hits, misses) == (N + 2, 0)
    elif name in ("delay-over-timeout", "drop", "reset", "partition", "truncate"):
        assert misses > 0 and not via.health.healthy
    proxy.set(Fault.none())
    time.sleep(0.3)  # past the backoff: the next call is the retry
    deadline = time.monotonic() + 10
    while read_all(via) != (N + 2, 0, 0):
        assert time.monotonic() < deadline, f"{name}: the tier never recovered"
        time.sleep(0.2)
    assert via.health.healthy
    assert direct.read_batch([k(0)])[0] is not None  # the stored objects were never harmed


def test_flipped_bytes_are_caught_by_the_checksum_and_reread(
    proxied: tuple[RedisTier, RedisTier, FaultProxy],
) -> None:
    _, via, proxy = proxied
    proxy.set(Fault.flip(200_000))  # about one flip per reply: in the payload, mostly
    for _ in range(5):
        wrong = read_all(via)[2]
        assert wrong == 0
    assert proxy.counters.flipped > 0
    c = via.counters
    assert c.reread_ok + c.corrupt + c.read_misses > 0


@pytest.mark.parametrize("name", ["reset", "partition", "truncate"])
def test_a_put_cut_by_a_fault_is_never_half_visible(
    proxied: tuple[RedisTier, RedisTier, FaultProxy], name: str
) -> None:
    direct, via, proxy = proxied
    fresh = [100 + i for i in range(4)]
    res = via.prepare_store([meta(i) for i in fresh])
    fault = {
        "reset": Fault.reset(),
        "partition": Fault.partition(),
        "truncate": Fault.truncate(10),
    }[name]
    proxy.set(fault)
    with pytest.raises(KVLifeError):
        assert not isinstance(res, int)
        via.commit_store(res, [arr(i) for i in fresh])  # type: ignore[arg-type]
    proxy.set(Fault.none())
    for i in fresh:  # each object is absent or exactly right, never partial
        if direct.contains(k(i)):
            assert np.array_equal(direct.read(k(i)), arr(i))
    assert via.used_bytes == 0


def _own_server(tmp_path: Path) -> RedisServer:
    return RedisServer(tmp_path).start()


def test_sigstop_and_sigkill_of_the_server(tmp_path: Path, index_ns: str) -> None:
    server = _own_server(tmp_path)
    try:
        t = make(server.port, index_ns)
        assert t.store([meta(i) for i in range(2)], [arr(i) for i in range(2)])
        server.signal(signal.SIGSTOP)
        try:
            got = t.read_batch([k(0), k(1)])
            assert all(isinstance(g, ReplicaReadError) for g in got)
            assert not t.health.healthy
            fast = time.monotonic()
            got = t.read_batch([k(0)])  # inside the backoff: refused at once
            assert isinstance(got[0], ReplicaReadError) and time.monotonic() - fast < 0.1
        finally:
            server.signal(signal.SIGCONT)
        time.sleep(0.2)
        deadline = time.monotonic() + 10
        while not isinstance(t.read_batch([k(0)])[0], np.ndarray):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert np.array_equal(t.read(k(1)), arr(1))
        server.signal(signal.SIGKILL)
        server.proc.wait(timeout=10)  # type: ignore[union-attr]
        got = t.read_batch([k(0)])
        assert isinstance(got[0], ReplicaReadError)
        server.start()  # same port, empty (no persistence): a miss, never stale bytes
        time.sleep(0.3)
        deadline = time.monotonic() + 10
        while True:
            try:
                t.read_batch([k(0)])
            except ReplicaNotFound:
                break
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert t.store([meta(0)], [arr(0)])  # scripts reloaded, lease re-acquired
        assert np.array_equal(t.read(k(0)), arr(0))
    finally:
        server.stop()

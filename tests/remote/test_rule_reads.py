"""Rules read by refresh, on a real Redis: whatever order hosts record rules and refresh
in (a host's own rule recorded before the ones below it are read, an index that loses
its state), a host that refreshed knows every rule of the index's current incarnation
and refuses exactly the records a rule newer than their creation covers. A refresh
reads only the rules it has not read (its cost does not grow with the index's life),
so this checks that nothing below what it read before is ever skipped."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvlife.core.identity import ChunkKey
from kvlife.core.objects import ObjectInfo
from kvlife.globalindex import GlobalIndex, Health, IndexConfig, RemoteRecord
from kvlife.tiers.disk.frame import FrameHeader
from kvlife.tiers.redis.server import RedisServer

NAMESPACES = [f"organisation:t{i}" for i in range(3)]
KEY = bytes(range(32))

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("invalidate"), st.sampled_from("ab"), st.integers(0, 2)),
        st.tuples(st.just("refresh"), st.sampled_from("ab"), st.just(0)),
        st.tuples(st.just("flush"), st.just(""), st.just(0)),
    ),
    min_size=1,
    max_size=30,
)


@pytest.fixture
def raw(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def _info(ns: str) -> ObjectInfo:
    return ObjectInfo(b"\0" * 32, "w1", "", ns, ChunkKey(bytes(32)), 0, 16)


def _record(incarnation: str, epoch: int) -> RemoteRecord:
    header = FrameHeader(
        key=KEY, payload_len=0, checksum=bytes(16), dtype="uint8", shape=(0,), transform=""
    )
    return RemoteRecord(header, b"", "h", 1, epoch, "", b"", incarnation)


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(ops=OPS)
@example(ops=[("invalidate", "b", 0), ("invalidate", "a", 1), ("refresh", "a", 0)])
@example(ops=[("refresh", "a", 0), ("invalidate", "b", 0), ("invalidate", "a", 0)])
def test_a_refreshed_host_refuses_exactly_what_a_newer_rule_covers(
    raw: redis.Redis, ops: list[tuple[str, str, int]]
) -> None:
    ns = "r" + uuid.uuid4().hex[:10]
    hosts = {
        h: GlobalIndex(raw, IndexConfig(namespace=ns, host=h), Health(f"index {h}")) for h in "ab"
    }
    rules: list[int] = []  # the namespace of each rule of the current incarnation, by epoch
    for op, h, j in ops:
        if op == "flush":
            gone = raw.keys(f"{{kvl:{ns}:*")
            if gone:
                raw.delete(*gone)  # this index loses its state
            rules = []
            continue
        host = hosts[h]
        if op == "invalidate":
            rule = host.invalidate(namespace=NAMESPACES[j])
            assert rule.epoch == len(rules) + 1
            rules.append(j)
            # its own rule covers what was born before it, the rules below unread or not
            older = _record(host.incarnation, rule.epoch - 1)
            assert not host.admissible(older, _info(NAMESPACES[j]), ())
            continue
        host.refresh()
        assert host.epoch == len(rules)
        for born in range(len(rules) + 1):
            for n, name in enumerate(NAMESPACES):
                covered = any(r == n for r in rules[born:])  # rules born + 1 .. epoch
                got = host.admissible(_record(host.incarnation, born), _info(name), ())
                assert got is not covered, (born, name, rules)

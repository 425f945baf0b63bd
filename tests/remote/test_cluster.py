"""Redis Cluster (three masters on loopback): a chunk's record, frame, staging key and
its bucket's fence floors share one slot, buckets spread over every master, and two
hosts share KV through the cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import blake3
import redis

from kvlife.globalindex import GlobalIndex, Health, IndexConfig
from kvlife.tiers.redis.server import RedisClusterServers
from tests.remote.hosts import Host
from tests.remote.test_multihost import chunk_digests


def test_a_chunks_keys_share_a_slot_and_buckets_cover_every_master(
    redis_cluster: RedisClusterServers, index_ns: str
) -> None:
    node: Any = redis.Redis(port=redis_cluster.nodes[0].port)
    idx = GlobalIndex(None, IndexConfig(namespace=index_ns, buckets=16), Health("x"))
    owners: set[int] = set()
    slots_of: dict[tuple[int, int], int] = {}
    for start, end, master, *_ in node.execute_command("CLUSTER", "SLOTS"):
        slots_of[(int(start), int(end))] = int(master[1])
    for i in range(64):
        key = blake3.blake3(b"slot%d" % i).digest()
        names = [
            idx.record_key(key),
            idx.frame_key(key),
            idx.staging_key(key, "n"),
            idx.fence_key(key),
        ]
        slots = {int(node.execute_command("CLUSTER", "KEYSLOT", n)) for n in names}
        assert len(slots) == 1, names
        slot = slots.pop()
        owners.update(p for (a, b), p in slots_of.items() if a <= slot <= b)
    assert len(owners) == 3, "16 buckets should land on all three masters"
    node.close()


def test_two_hosts_share_kv_through_the_cluster(
    tmp_path: Path, redis_cluster: RedisClusterServers, index_ns: str
) -> None:
    opts: dict[str, object] = {"cluster": redis_cluster.seeds, "index_namespace": index_ns}
    a, b = Host(tmp_path / "a", "redis", opts), Host(tmp_path / "b", "redis", opts)
    try:
        a.ask("put", seed=7)
        assert a.ask("flush")["flushed"] == 4
        got = b.ask("lookup", seed=7)
        assert got["tiers"] == ["shared"] * 4 and got["digests"] == chunk_digests(7)
        a.ask("invalidate", criteria={"namespace": "acme"})
        assert b.ask("lookup", seed=7)["hits"] == 0
    finally:
        a.stop()
        b.stop()

"""Several hosts (real processes, each with its own local store) sharing one Redis tier:
cross-host hits bit-exact, global invalidation reaching every host at once, identity
enforced, a partitioned host serving nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import blake3
import numpy as np
import pytest

from kvlife.faults.proxy import Fault, FaultProxy
from kvlife.tiers.redis.server import RedisServer
from tests.conftest import TINY, prompt_kv
from tests.remote.hosts import Host, start_hosts


def chunk_digests(seed: int, ntokens: int = 64) -> list[str]:
    _, kv = prompt_kv(seed, ntokens)
    n = TINY.tokens_per_chunk
    return [
        blake3.blake3(np.ascontiguousarray(kv[:, :, :, i * n : (i + 1) * n]).tobytes()).hexdigest()
        for i in range(ntokens // n)
    ]


@pytest.fixture
def hosts(tmp_path: Path, redis_server: RedisServer, index_ns: str) -> Iterator[dict[str, Host]]:
    opts: dict[str, object] = {"url": redis_server.url, "index_namespace": index_ns}
    made = start_hosts({name: tmp_path / name for name in ("a", "b", "c")}, "redis", opts)
    yield made
    for h in made.values():
        h.stop()


def test_host_b_hits_what_host_a_published_bit_exact(hosts: dict[str, Host]) -> None:
    a, b = hosts["a"], hosts["b"]
    assert a.ask("put", seed=1)["stored"] == 4
    assert b.ask("lookup", seed=1)["hits"] == 0  # not published yet: only in A's DRAM
    assert a.ask("flush")["flushed"] == 4
    got = b.ask("lookup", seed=1)
    assert got["hits"] == 4 and got["tiers"] == ["shared"] * 4
    assert got["loaded"] == 4 and got["digests"] == chunk_digests(1)
    again = b.ask("lookup", seed=1)  # promoted into B's own DRAM by now
    assert again["tiers"] == ["dram"] * 4 and again["digests"] == chunk_digests(1)
    other_tenant = b.ask("lookup", seed=1, ns="globex")
    assert other_tenant["hits"] == 0
    other_adapter = b.ask("lookup", seed=1, adapter="lora-x")
    assert other_adapter["hits"] == 0


@pytest.mark.parametrize(
    ("criteria", "survivor"),
    [
        ({"namespace": "acme"}, None),
        ({"adapter_id": "lora-1"}, None),
        ({"weights_digest": "w0"}, None),
        ({"namespace": "other-tenant"}, 4),
    ],
    ids=["namespace", "adapter", "weights", "non-matching"],
)
def test_an_invalidation_on_one_host_stops_every_host(
    hosts: dict[str, Host], criteria: dict[str, str], survivor: int | None
) -> None:
    a, b, c = hosts["a"], hosts["b"], hosts["c"]
    a.ask("put", seed=2, adapter="lora-1")
    a.ask("flush")
    assert b.ask("lookup", seed=2, adapter="lora-1")["hits"] == 4  # now in B's DRAM too
    assert "epoch" in c.ask("invalidate", criteria=criteria)
    expect = survivor or 0
    for h in (a, b, c):  # A and B hold it in DRAM, C only remotely
        assert h.ask("lookup", seed=2, adapter="lora-1")["hits"] == expect
    # KV computed after the invalidation is served again
    if not survivor:
        a.ask("put", seed=2, adapter="lora-1")
        a.ask("flush")
        assert c.ask("lookup", seed=2, adapter="lora-1")["digests"] == chunk_digests(2)


def test_prefix_invalidation_cuts_the_chain_on_every_host(hosts: dict[str, Host]) -> None:
    a, b = hosts["a"], hosts["b"]
    a.ask("put", seed=3)
    a.ask("flush")
    assert b.ask("lookup", seed=3)["hits"] == 4
    from kvlife.core.identity import Namespace, NamespaceKind, prompt_chunk_keys
    from tests.conftest import tiny_identity

    tokens, _ = prompt_kv(3, 64)
    keys = prompt_chunk_keys(tiny_identity(), Namespace(NamespaceKind.ORGANISATION, "acme"), tokens)
    hosts["c"].ask("invalidate", criteria={"prefix": keys[2].hex()})
    assert b.ask("lookup", seed=3)["hits"] == 2
    assert a.ask("lookup", seed=3)["hits"] == 2
    assert hosts["c"].ask("lookup", seed=3)["hits"] == 2


def test_a_partitioned_host_serves_nothing_then_recovers(
    tmp_path: Path, redis_server: RedisServer, index_ns: str
) -> None:
    with FaultProxy(("127.0.0.1", redis_server.port)) as proxy:
        url = f"redis://127.0.0.1:{proxy.port}/0"
        opts = {"url": url, "index_namespace": index_ns, "socket_timeout_s": 0.5}
        a = Host(tmp_path / "a", "redis", {"url": redis_server.url, "index_namespace": index_ns})
        b = Host(tmp_path / "b", "redis", opts)
        try:
            a.ask("put", seed=4)
            a.ask("flush")
            assert b.ask("lookup", seed=4)["hits"] == 4  # B has it in DRAM now
            proxy.set(Fault.partition())
            cut = b.ask("lookup", seed=4)
            assert cut["hits"] == 0, "a host cut off from the index served KV"
            a.ask("invalidate", criteria={"namespace": "acme"})  # B misses this message
            proxy.set(Fault.none())
            import time

            time.sleep(2.5)  # past B's backoff
            healed = b.ask("lookup", seed=4)
            assert healed["hits"] == 0, "B served KV invalidated while it was partitioned"
            details = b.ask("details")["details"]
            assert details["failures"] >= 1 and details["unreachable"] >= 1
        finally:
            a.stop()
            b.stop()

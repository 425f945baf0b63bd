"""Quotas through a real ``kvlife serve --tenants``: each tenant's byte share of the
DRAM tier, from the principals' file; one tenant's burst beyond its share evicts only
its own objects, and every eviction is counted against its tenant."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlife.core.errors import InvalidArgument
from kvlife.tenancy.principals import parse_config
from tests.conftest import prompt_kv, tiny_identity
from tests.server.conftest import MiB, ServerProc
from tests.server.tenants import ORG, USER, as_, write_config

IDENT = tiny_identity()
KiB = 1 << 10
DRAM = 1 * MiB
SHARES = """
[principal.alice.shares]
dram = 262144

[principal.bob.shares]
dram = 262144

[organisation.acme]
shares = { dram = 131072 }
"""


def _server(tmp_path: Path, shares: str) -> ServerProc:
    cfg = write_config(tmp_path / "tenants.toml")
    if shares:  # the principals' tables are reopened by dotted keys (TOML allows it)
        cfg.write_text(cfg.read_text() + shares)
    return ServerProc(
        tmp_path / "store",
        dram=DRAM,
        disk=0,
        staging=1 * MiB,
        extra=("--tenants", str(cfg)),
    ).start()


def _burst(tmp_path: Path, shares: str) -> tuple[int, int, dict[str, object]]:
    """bob stores 4 chunks, alice 4 in her organisation's scope, then alice bursts 1024
    chunks in her user scope (twice the tier); bob's and the organisation's hits after
    the burst, and the admin's figures."""
    srv = _server(tmp_path, shares)
    try:
        tokens, kv = prompt_kv(1, 64)
        with as_(srv, "alice") as alice, as_(srv, "bob") as bob, as_(srv, "root") as root:
            assert bob.put_prompt(IDENT, USER["bob"], tokens, kv).stored == 4
            assert alice.put_prompt(IDENT, ORG["alice"], tokens, kv).stored == 4
            for seed in range(100, 164):
                t, k = prompt_kv(seed, 256)
                alice.put_prompt(IDENT, USER["alice"], t, k)
            hits = len(bob.lookup(IDENT, USER["bob"], tokens).hits)
            org = len(alice.lookup(IDENT, ORG["alice"], tokens).hits)
            return hits, org, root.server_info()
    finally:
        srv.stop()


def test_a_tenants_burst_beyond_its_share_leaves_anothers_objects(tmp_path: Path) -> None:
    hits, org, info = _burst(tmp_path, SHARES)
    assert hits == 4  # bob's objects survived alice's burst
    assert org == 4  # and so did the organisation scope's, within its own budget
    figures = info["shares"]["dram"]  # type: ignore[index]
    alice, bob = figures["user:alice"], figures["user:bob"]
    assert bob["evicted"] == 0 and bob["keys"] == 4
    assert alice["evicted"] > 0  # counted, against the tenant that burst
    assert alice["share"] == 262144 and figures["organisation:acme"]["share"] == 131072
    assert figures["organisation:acme"]["evicted"] == 0
    # shares decide victims only: alice used the room nobody else held
    assert alice["used"] + bob["used"] + figures["organisation:acme"]["used"] <= DRAM
    # the store counts the same losses (one tier: every victim leaves the store)
    evicted = info["counters"]["evicted"]  # type: ignore[index]
    assert evicted == alice["evicted"]


def test_without_shares_the_same_burst_evicts_the_other_tenant(tmp_path: Path) -> None:
    """The control: one budget for the tier, and alice's burst takes bob's objects."""
    hits, org, info = _burst(tmp_path, "")
    assert hits < 4 and org < 4
    assert info["shares"] == {}


def test_shares_are_checked_when_the_file_is_read() -> None:
    with pytest.raises(InvalidArgument, match="share of tier dram"):
        parse_config({"principal": {"a": {"shares": {"dram": -1}}}})
    with pytest.raises(InvalidArgument, match="unknown sections"):
        parse_config({"principal": {"a": {}}, "quota": {}})
    with pytest.raises(InvalidArgument, match="only a shares table"):
        parse_config({"principal": {"a": {}}, "organisation": {"acme": {"limit": 1}}})
    cfg = parse_config(
        {"principal": {"a": {"shares": {"dram": 5}}}, "public": {"shares": {"disk": 7}}}
    )
    assert dict(cfg.shares) == {"user:a": (("dram", 5),), "public": (("disk", 7),)}


def test_shares_beyond_a_tiers_capacity_refuse_to_start(tmp_path: Path) -> None:
    too_much = SHARES.replace("262144", str(DRAM))
    srv = ServerProc(
        tmp_path / "store",
        dram=DRAM,
        disk=0,
        staging=1 * MiB,
        extra=("--tenants", str(write_config(tmp_path / "t.toml"))),
    )
    (tmp_path / "t.toml").write_text((tmp_path / "t.toml").read_text() + too_much)
    with pytest.raises(RuntimeError, match="add up to"):
        srv.start()

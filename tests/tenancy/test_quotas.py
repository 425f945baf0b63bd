"""Quotas in an embedded store: shares from StoreConfig, a tenant by namespace, refused
configurations (the served store's test is tests/server/test_quotas.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlife.core.errors import InvalidArgument
from kvlife.core.identity import PUBLIC, Namespace, NamespaceKind
from kvlife.store import KVStore, StoreConfig
from kvlife.tenancy.quotas import tenant_of_namespace
from tests.conftest import prompt_kv, tiny_identity

IDENT = tiny_identity()


def test_a_namespace_names_its_tenant() -> None:
    assert tenant_of_namespace("request:alice/r1") == "user:alice"
    assert tenant_of_namespace("user:alice") == "user:alice"
    assert tenant_of_namespace("organisation:acme") == "organisation:acme"
    assert tenant_of_namespace(str(PUBLIC)) == "public"
    assert tenant_of_namespace("nonsense") == ""


def test_shares_must_name_a_tier_and_fit_in_it() -> None:
    with pytest.raises(InvalidArgument, match="name tier 'ssd'"):
        StoreConfig(dram_bytes=1 << 20, disk_bytes=0, tenant_shares=(("user:a", (("ssd", 1),)),))
    with pytest.raises(InvalidArgument, match="add up to"):
        StoreConfig(
            dram_bytes=1 << 20,
            disk_bytes=0,
            tenant_shares=(("user:a", (("dram", 1 << 20),)), ("user:b", (("dram", 1),))),
        )


def test_an_embedded_stores_burst_evicts_only_the_bursting_tenants_objects(
    tmp_path: Path,
) -> None:
    shares = (("user:a", (("dram", 64 << 10),)), ("user:b", (("dram", 64 << 10),)))
    a, b = Namespace(NamespaceKind.USER, "a"), Namespace(NamespaceKind.USER, "b")
    tokens, kv = prompt_kv(1, 64)
    with KVStore.open(tmp_path, dram_bytes=256 << 10, disk_bytes=0, tenant_shares=shares) as s:
        s.put_prompt(IDENT, b, tokens, kv)
        for seed in range(10, 30):  # 20 x 4 chunks of 2 KiB and more: past the tier
            t, k = prompt_kv(seed, 256)
            s.put_prompt(IDENT, a, t, k)
        assert len(s.lookup(IDENT, b, tokens).hits) == 4
        figures = s.share_figures()["dram"]
        assert figures["user:b"]["evicted"] == 0 and figures["user:a"]["evicted"] > 0
        assert s.counters.evicted == figures["user:a"]["evicted"]

"""The vLLM connector's ``kv_connector_extra_config`` with ``kvlife.config``: the file's
store (its whole chain, embedded) or its server's socket, and its ``[vllm]`` table as
defaults of the other keys, mapped onto the classes the connector uses."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlife.core.errors import InvalidArgument
from kvlife.core.identity import PUBLIC
from kvlife.engines.vllm.stores import StoreAddress, open_store, resolve_extra_config
from kvlife.ops.config import ConfigError
from tests.conftest import prompt_kv, tiny_identity

EMBEDDED = """
[store]
path = "kv"

[[tiers]]
name = "host"
kind = "memory"
budget = "16KiB"

[[tiers]]
name = "nvme"
kind = "disk"
budget = "1MiB"
durability = "write-through"

[vllm]
chunk_tokens = 32
namespace = "organisation:acme"
"""


def test_embedded_store_from_the_file(tmp_path: Path) -> None:
    config = tmp_path / "kvlife.toml"
    config.write_text(EMBEDDED)
    extra, file = resolve_extra_config({"kvlife.config": str(config), "kvlife.chunk_tokens": 64})
    assert file is not None
    # [vllm] gives defaults; a key given in extra_config wins
    assert extra["kvlife.chunk_tokens"] == 64 and extra["kvlife.namespace"] == "organisation:acme"
    address = StoreAddress.from_extra_config(extra, file)
    assert address.path == str(tmp_path / "kv") and not address.socket
    lease = open_store(address)
    try:
        store = lease.store
        assert list(store.tier_names) == ["host", "nvme"]
        tokens, kv = prompt_kv(1, 64)
        store.put_prompt(tiny_identity(), PUBLIC, tokens, kv)
        # durability = "write-through": every put is on the disk tier before it returns
        assert store.counters.tier("nvme").stored == 4
    finally:
        lease.release()
    assert (tmp_path / "kv" / "nvme").is_dir()


def test_served_store_from_the_file(tmp_path: Path) -> None:
    config = tmp_path / "kvlife.toml"
    config.write_text(EMBEDDED + '\n[server]\nsocket = "kv.sock"\n')
    extra, file = resolve_extra_config({"kvlife.config": str(config)})
    address = StoreAddress.from_extra_config(extra, file)
    assert address.socket == str(tmp_path / "kv.sock") and not address.path
    # [vllm] store = "embedded" (or an explicit kvlife.path) picks the other
    extra["kvlife.store"] = "embedded"
    assert StoreAddress.from_extra_config(extra, file).path == str(tmp_path / "kv")


def test_sizes_beside_a_file_are_refused(tmp_path: Path) -> None:
    config = tmp_path / "kvlife.toml"
    config.write_text(EMBEDDED)
    extra, file = resolve_extra_config({"kvlife.config": str(config), "kvlife.dram_mib": 4})
    with pytest.raises(InvalidArgument, match=r"kvlife\.dram_mib"):
        StoreAddress.from_extra_config(extra, file)
    with pytest.raises(InvalidArgument, match=r"kvlife\.config"):
        StoreAddress.from_extra_config({"kvlife.path": "x", "kvlife.store": "served"})


def test_a_bad_file_lists_every_error(tmp_path: Path) -> None:
    config = tmp_path / "kvlife.toml"
    config.write_text(EMBEDDED.replace('"16KiB"', "-1").replace("32", "0"))
    with pytest.raises(ConfigError) as info:
        resolve_extra_config({"kvlife.config": str(config)})
    assert {i.path for i in info.value.issues} == {"tiers[0].budget", "vllm.chunk_tokens"}


def test_the_event_log_of_the_file_is_relative_to_it(tmp_path: Path) -> None:
    config = tmp_path / "kvlife.toml"
    config.write_text(EMBEDDED + 'events = "logs/kv-events.jsonl"\n')
    extra, file = resolve_extra_config({"kvlife.config": str(config)})
    address = StoreAddress.from_extra_config(extra, file)
    assert address.events == str(tmp_path / "logs" / "kv-events.jsonl")
    config.write_text(EMBEDDED + 'events = ""\n')
    with pytest.raises(ConfigError, match="events"):
        resolve_extra_config({"kvlife.config": str(config)})

"""A real vLLM engine whose connector is configured by a kvlife configuration file alone
(``kv_connector_extra_config={"kvlife.config": FILE}``): the store, its tier chain and
names, its durability and the chunk size all come from the file."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.vllm.conftest import run_engine, tiny_spec

CHUNK = 64
P1 = [int(t) for t in np.random.default_rng(11).integers(5, 1000, size=5 * CHUNK)]

CONFIG = """
[store]
path = "store"

[[tiers]]
name = "host"
kind = "memory"
budget = "64MiB"

[[tiers]]
name = "nvme"
kind = "disk"
budget = "256MiB"
durability = "write-through"

[vllm]
chunk_tokens = 64
namespace = "public"
"""


def test_the_connector_runs_from_a_config_file(tiny_model: Path, tmp_path: Path) -> None:
    config = tmp_path / "kvlife.toml"
    config.write_text(CONFIG)
    requests = [{"tokens": P1, "max_tokens": 8}, {"tokens": P1, "max_tokens": 8}]
    spec = tiny_spec(tiny_model, requests, {"kvlife.config": str(config)})
    run = run_engine(spec, tmp_path, "from-config")
    first, second = run["requests"]
    assert first["output_ids"] == second["output_ids"]
    # [vllm] chunk_tokens = 64: every full chunk of the prompt but the last token's
    assert second["cached_tokens"] == 4 * CHUNK
    # served from the tier the file names "host"; write-through put each chunk on "nvme"
    assert run["counters"]["worker"]["tiers"] == {"host": 4}
    assert run["counters"]["store"]["tier.nvme.stored"] >= 4
    assert (tmp_path / "store" / "nvme").is_dir()

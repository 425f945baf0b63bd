"""vLLM's ``reset_prefix_cache(reset_connector=True)`` under a real vLLM (CPU build)
resets kvlife's tiers too (issue 26; vLLM #57727: a CPU tier still served after a
reset): a prompt served from kvlife before the reset is recomputed after it (no cached
tokens, the same greedy output), then stored and served again. One engine process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tests.vllm.conftest import run_engine, tiny_spec

CHUNK = 64
P = [int(t) for t in np.random.default_rng(11).integers(5, 1000, size=4 * CHUNK + 9)]


def test_a_vllm_prefix_cache_reset_resets_every_kvlife_tier(
    tiny_model: Path, tmp_path: Path
) -> None:
    req: dict[str, Any] = {"tokens": P, "max_tokens": 8, "cache_salt": None}
    spec = tiny_spec(
        tiny_model,
        [req, req, req, req],
        {
            "kvlife.path": str(tmp_path / "store"),
            "kvlife.chunk_tokens": CHUNK,
            "kvlife.dram_mib": 64,
            "kvlife.disk_mib": 256,
            "kvlife.write_through": True,  # every chunk in DRAM and on disk
        },
        reset_before=[2],
    )
    run = run_engine(spec, tmp_path, "reset", timeout=300)
    rows = run["requests"]
    assert run["resets"] == [True]
    assert [r["cached_tokens"] for r in rows] == [0, 4 * CHUNK, 0, 4 * CHUNK]
    assert all(r["output_ids"] == rows[0]["output_ids"] for r in rows)
    assert run["counters"]["scheduler"]["resets"] == 1
    store = run["counters"]["store"]
    for tier in ("dram", "disk"):  # the reset took the prompt's chunks off both tiers
        assert store[f"tier.{tier}.invalidated_bytes"] > 0, tier

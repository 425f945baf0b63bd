"""``kvlife.events`` under a real vLLM (CPU build): the connector's embedded store
writes its lifecycle event log (schema v1) while vLLM puts, loads and, through a prefix
cache reset, invalidates chunks; the log's lives are the chunks the requests stored,
and what it leaves live is what the store holds when reopened. One engine process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from kvlife.core.events import LifecycleEvent
from kvlife.reporting.cli import live_lifecycle
from kvlife.store import KVStore
from kvlife.trace.schema import validate_event
from tests.vllm.conftest import run_engine, tiny_spec

CHUNK = 64
P = [int(t) for t in np.random.default_rng(12).integers(5, 1000, size=4 * CHUNK + 9)]


def test_the_connector_logs_the_lifecycle_of_what_vllm_puts_loads_and_invalidates(
    tiny_model: Path, tmp_path: Path
) -> None:
    req: dict[str, Any] = {"tokens": P, "max_tokens": 8, "cache_salt": None}
    log = tmp_path / "vllm-events.jsonl"
    spec = tiny_spec(
        tiny_model,
        [req, req, req, req],
        {
            "kvlife.path": str(tmp_path / "store"),
            "kvlife.chunk_tokens": CHUNK,
            "kvlife.dram_mib": 64,
            "kvlife.disk_mib": 256,
            "kvlife.write_through": True,
            "kvlife.events": str(log),
        },
        reset_before=[2],
    )
    run = run_engine(spec, tmp_path, "events", timeout=300)
    assert [r["cached_tokens"] for r in run["requests"]] == [0, 4 * CHUNK, 0, 4 * CHUNK]
    keys = set(run["keys"][0])
    assert len(keys) == 4

    records = [json.loads(line) for line in log.read_text().splitlines()]
    for r in records:
        validate_event(r)  # schema v1, field by field
    events = [LifecycleEvent(**{k: v for k, v in r.items() if k != "v"}) for r in records]
    assert [e.seq for e in events] == sorted({e.seq for e in events})
    by_key: dict[str, list[str]] = {}
    for e in events:
        by_key.setdefault(e.key, []).append(e.kind)
    assert set(by_key) == keys  # every chunk vLLM stored, nothing else
    for key, kinds in by_key.items():
        objects = [k for k in kinds if k in ("put", "commit", "index", "invalidate", "delete")]
        # stored, served, invalidated by the reset, stored again, served again
        once = ["put", "commit", "index"]
        assert objects == [*once, "invalidate", "delete", *once], (key, kinds)
        assert kinds.count("load") == 2, (key, kinds)
        # write-through: each life wrote the chunk to DRAM and copied it to disk
        moves = [(e.kind, e.tier, e.dst_tier) for e in events if e.key == key]
        assert moves.count(("write", "dram", "")) == 2, (key, moves)
        assert moves.count(("offload", "dram", "disk")) == 2, (key, moves)

    # what the log leaves live is what the store holds
    live = {k for k, kinds in by_key.items() if kinds[-1] != "delete" and "index" in kinds}
    store = KVStore.open(tmp_path / "store", dram_bytes=64 << 20, disk_bytes=256 << 20)
    try:
        assert {k.hex() for k in store.indexed_keys()} == live == keys
    finally:
        store.close()

    # and kvlife report reads it: 4 closed lives (the reset) and 4 open, one load each
    ((res, _),) = live_lifecycle([str(log)]).values()
    cls = res["classes"]["public"]
    assert (cls["lives_closed"], cls["lives_open"]) == (4, 4)
    assert cls["reuse_count"]["p50"] == 1.0 and cls["open_reuse_count"]["p50"] == 1.0

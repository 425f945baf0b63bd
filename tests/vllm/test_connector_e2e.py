"""kvlife under a real vLLM (CPU build), end to end: exactness, restart from disk,
corrupt chunks recomputed, isolation. No mocks of vLLM.

One module-scoped sequence of engine processes is shared by every test (each engine
start costs tens of seconds): A without kvlife, then with kvlife on one store B (fresh),
C (a new process: prefix from the disk tier), D (after a byte of a stored frame was
flipped), E (another block size) and F (another dtype).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvlife.faults.damage import flip, scan_frames
from kvlife.store import KVStore
from tests.vllm.conftest import lora_dir, run_engine

CHUNK = 64
rng = np.random.default_rng(7)
P1 = [int(t) for t in rng.integers(5, 1000, size=5 * CHUNK)]
P2 = P1[: 3 * CHUNK] + [int(t) for t in rng.integers(5, 1000, size=2 * CHUNK + 17)]
NEW = 16
DTYPE = os.environ.get("KVLIFE_E2E_DTYPE", "float32")  # scripts/gpu_e2e.sh: float16
OTHER_DTYPE = "bfloat16" if DTYPE != "bfloat16" else "float16"


def _spec(model: Path, store: Path | None, requests: list[dict[str, Any]], **kw: Any) -> Any:
    spec: dict[str, Any] = {
        "model": str(model),
        "skip_tokenizer_init": True,
        "block_size": 32,
        "dtype": DTYPE,
        "kv_cache_mib": 64,
        "max_model_len": 1024,
        "requests": requests,
        "kvlife": None,
    }
    if store is not None:
        spec["kvlife"] = {
            "kvlife.path": str(store),
            "kvlife.chunk_tokens": CHUNK,
            "kvlife.dram_mib": 64,
            "kvlife.disk_mib": 256,
        }
    return spec | kw


def _req(tokens: list[int], salt: str | None = None) -> dict[str, Any]:
    return {"tokens": tokens, "max_tokens": NEW, "cache_salt": salt}


@pytest.fixture(scope="module")
def runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("vllm-e2e")
    store = work / "store"
    out: dict[str, Any] = {}
    out["A"] = run_engine(_spec(tiny_model, None, [_req(P1), _req(P2)]), work, "A")
    out["B"] = run_engine(_spec(tiny_model, store, [_req(P1), _req(P1)]), work, "B")
    out["C"] = run_engine(
        _spec(tiny_model, store, [_req(P1), _req(P2), _req(P1, "tenant-b")]), work, "C"
    )
    # flip one payload byte of the frame of P1's chunk 2 (public namespace)
    victim = bytes.fromhex(out["C"]["keys"][0][2])
    frames = [f for f in scan_frames(store) if bytes(f.key) == victim]
    assert len(frames) == 1, "the chunk should have exactly one frame on disk"
    flip(frames[0].segment, frames[0].payload_offset + 1000, 1)
    out["D"] = run_engine(_spec(tiny_model, store, [_req(P1), _req(P1)]), work, "D")
    out["E"] = run_engine(_spec(tiny_model, store, [_req(P1)], block_size=64), work, "E")
    out["F"] = run_engine(_spec(tiny_model, store, [_req(P1)], dtype=OTHER_DTYPE), work, "F")
    lora_a = {"name": "a", "id": 1, "path": str(lora_dir(work / "lora-a", seed=1))}
    lora_b = {"name": "b", "id": 2, "path": str(lora_dir(work / "lora-b", seed=2))}
    out["G"] = run_engine(
        _spec(
            tiny_model,
            work / "store-lora",
            [_req(P1), *[_req(P1) | {"lora": x} for x in (lora_a, lora_a, lora_b)]],
            enable_lora=True,
        ),
        work,
        "G",
    )
    with KVStore.open(store, dram_bytes=0, disk_bytes=1 << 40) as s:
        out["lifetime"] = s.info().lifetime_counters
    return out


def _ids(run: dict[str, Any], i: int) -> list[int]:
    return list(run["requests"][i]["output_ids"])


def test_greedy_outputs_with_kvlife_equal_those_without(runs: dict[str, Any]) -> None:
    ref1, ref2 = _ids(runs["A"], 0), _ids(runs["A"], 1)
    assert len(ref1) == NEW
    b = runs["B"]
    assert _ids(b, 0) == ref1  # stored while computing
    assert _ids(b, 1) == ref1  # served from kvlife's DRAM tier
    assert b["requests"][0]["cached_tokens"] == 0
    # every full chunk of the prompt but the last token's: 4 chunks of 64
    assert b["requests"][1]["cached_tokens"] == 4 * CHUNK
    assert b["counters"]["worker"]["tiers"] == {"dram": 4}
    assert b["counters"]["worker"]["blocks_failed"] == 0
    # a prompt sharing 3 chunks of P1 reuses exactly those, output as without kvlife
    c = runs["C"]
    assert c["requests"][1]["cached_tokens"] == 3 * CHUNK
    assert _ids(c, 1) == ref2


def test_a_new_engine_process_gets_its_prefix_from_the_disk_tier(runs: dict[str, Any]) -> None:
    c = runs["C"]
    assert c["requests"][0]["cached_tokens"] == 4 * CHUNK
    assert _ids(c, 0) == _ids(runs["A"], 0)
    assert c["counters"]["store"]["tier.disk.loaded"] >= 4
    assert c["counters"]["worker"]["tiers"].get("disk", 0) >= 4


def test_a_flipped_byte_is_recomputed_by_vllm_output_identical(runs: dict[str, Any]) -> None:
    d = runs["D"]
    assert _ids(d, 0) == _ids(runs["A"], 0)
    assert d["counters"]["store"]["corrupt"] == 1
    # chunks 2 and 3 (4 blocks of 32) were reported to vLLM as failed loads
    assert d["counters"]["worker"]["blocks_failed"] == 4
    # 2 chunks loaded for the first request, then the whole prefix for the repeat
    assert d["counters"]["worker"]["tokens_loaded"] == 2 * CHUNK + 4 * CHUNK
    assert runs["lifetime"]["corrupt"] == 1
    # the recomputed chunks were stored again: the repeat gets the whole prefix, same output
    assert d["counters"]["worker"]["chunks_stored"] >= 1
    assert d["requests"][1]["cached_tokens"] == 4 * CHUNK
    assert _ids(d, 1) == _ids(runs["A"], 0)


def test_another_salt_block_size_or_dtype_gets_no_hits(runs: dict[str, Any]) -> None:
    c = runs["C"]
    assert c["requests"][2]["cached_tokens"] == 0  # cache_salt "tenant-b"
    assert _ids(c, 2) == _ids(runs["A"], 0)
    for name in ("E", "F"):  # block size 64; bfloat16
        run = runs[name]
        assert run["requests"][0]["cached_tokens"] == 0, name
        assert run["counters"]["scheduler"]["hit_tokens"] == 0, name
        assert run["counters"]["store"]["lookup_chunks_hit"] == 0, name


def test_lora_adapters_never_share_kv(runs: dict[str, Any]) -> None:
    """Base model, adapter a, a again, adapter b on one store: only the repeat of a hits,
    and its output is the one a computed without kvlife's help."""
    g = runs["G"]["requests"]
    assert [r["cached_tokens"] for r in g] == [0, 0, 4 * CHUNK, 0]
    assert g[2]["output_ids"] == g[1]["output_ids"]
    outputs = {tuple(r["output_ids"]) for r in (g[0], g[1], g[3])}
    assert len(outputs) == 3, "each adapter changes the output (the test would be blind)"
    assert g[0]["output_ids"] == _ids(runs["A"], 0)

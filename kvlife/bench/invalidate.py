"""``kvlife bench invalidate``: how fast an invalidation takes stale KV back, per tier.

A store (a DRAM tier in front of a disk tier, every chunk in both) is filled with
``--chunks`` chunks: prompts of ``--chunks-per-prompt`` chunks, half computed by an old
weights version of the model and half by the current one, each prompt built of a system
prompt (its first chunk) and one of ten documents (``doc:0`` .. ``doc:9``, the rest).
Then, in order:

1. ``invalidate(source="doc:3")``: every chunk that depends on that document (about a
   tenth of the store, both weights versions);
2. ``invalidate(model=..., keep_weights_digest=current)``: every chunk of the old
   weights version still there.

For each: the objects removed, the time from the call to its return (every tier's room
freed and the deletes durable), per tier the time from the call to its last batch of
stale replicas deleted (embedded store only: the store's own clock) and the bytes it
gave back (``invalidated_bytes``), and lookups after it (stale prompts: 0 hits, asserted;
kept prompts: every chunk). Once embedded and once through ``kvlife serve`` (the call's
round trip; the server's counters). A benchmark, not a test: its JSON is checked for
shape only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvlife.bench.limits import format_machine, machine_figures
from kvlife.core.identity import PUBLIC, KVLayout, ModelIdentity
from kvlife.core.sources import Source, SourceSpan
from kvlife.report import format_table
from kvlife.store import KVStore
from kvlife.store.api import StoreAPI

MiB = 1 << 20
LAYOUT = KVLayout(1, 1, 16, "float16", 16)
"""1 KiB chunks: the figure is about bookkeeping and deletes, not bandwidth."""
MODEL = "bench-model"
OLD, CURRENT = "weights-old", "weights-current"
DOCS = 10
VICTIM = "doc:3"
TIERS = ("dram", "disk")


@dataclass(frozen=True, slots=True)
class Config:
    chunks: int = 100_000
    chunks_per_prompt: int = 1000
    served: bool = True
    directory: Path | None = None
    quick: bool = False


def _build(p: int, per: int) -> tuple[ModelIdentity, np.ndarray, list[SourceSpan], int]:
    """Prompt ``p`` of ``per`` chunks: its identity (the old weights for an even ``p``),
    tokens, spans (the system prompt, then its document) and document number."""
    ident = ModelIdentity(MODEL, OLD if p % 2 == 0 else CURRENT, "tok", LAYOUT)
    doc = (p // 2) % DOCS
    tpc = LAYOUT.tokens_per_chunk
    n = per * tpc
    tokens = np.random.default_rng(p).integers(0, 50_000, n)
    spans = [SourceSpan(Source("system"), 0, tpc), SourceSpan(Source(f"doc:{doc}"), tpc, n)]
    return ident, tokens, spans, doc


def _fill(store: StoreAPI[Any], cfg: Config) -> int:
    per = cfg.chunks_per_prompt
    kv = np.zeros((1, 2, 1, per * LAYOUT.tokens_per_chunk, 16), np.float16)
    stored = 0
    for p in range(cfg.chunks // per):
        ident, tokens, spans, _ = _build(p, per)
        kv[0, 0, 0, 0, 0] = p  # the KV of one prompt differs from another's
        stored += store.put_prompt(ident, PUBLIC, tokens, kv, sources=spans).stored
    store.flush()  # every chunk in DRAM and on disk
    return stored


def _stale(step: str, ident: ModelIdentity, doc: int) -> bool:
    """Whether a prompt's KV (past its first chunk, which depends on the system prompt
    only) is stale after ``step``."""
    gone_by_source = doc == int(VICTIM.split(":")[1])
    if step == "source":
        return gone_by_source
    return gone_by_source or ident.weights_digest == OLD


def _hits(store: StoreAPI[Any], cfg: Config, step: str) -> dict[str, int]:
    """Lookups of every prompt after ``step``: chunks hit among the stale prompts beyond
    their first chunk (must be 0) and among the kept ones."""
    per = cfg.chunks_per_prompt
    out = {"stale_chunks_hit": 0, "kept_chunks_hit": 0, "kept_chunks_asked": 0}
    for p in range(cfg.chunks // per):
        ident, tokens, spans, doc = _build(p, per)
        hit = len(store.lookup(ident, PUBLIC, tokens, sources=spans).hits)
        if _stale(step, ident, doc):
            first = 0 if step == "weights" and ident.weights_digest == OLD else 1
            out["stale_chunks_hit"] += max(0, hit - first)
        else:
            out["kept_chunks_hit"] += hit
            out["kept_chunks_asked"] += per
    if out["stale_chunks_hit"]:
        raise AssertionError(f"after {step}: {out['stale_chunks_hit']} stale chunks hit")
    return out


def _step(
    store: StoreAPI[Any], cfg: Config, name: str, kwargs: dict[str, Any], core: Any
) -> dict[str, Any]:
    before = store.counters.as_dict()  # a copy: the embedded store's counters are live
    objects = store.info().objects_by_state.get("indexed", 0)
    t0 = time.monotonic()
    removed = store.invalidate(**kwargs)
    call_s = time.monotonic() - t0
    after = store.counters.as_dict()
    tiers: dict[str, dict[str, Any]] = {}
    for tier in TIERS:
        field = f"tier.{tier}.invalidated_bytes"
        freed = after.get(field, 0) - before.get(field, 0)
        entry: dict[str, Any] = {"freed_bytes": freed, "freed_s": None}
        if core is not None and tier in core.deleted_at and core.deleted_at[tier] >= t0:
            entry["freed_s"] = core.deleted_at[tier] - t0
        tiers[tier] = entry
    return {
        "invalidation": name,
        "criteria": {k: str(v) for k, v in kwargs.items()},
        "objects_before": objects,
        "removed": removed,
        "call_s": call_s,
        "tiers": tiers,
        **_hits(store, cfg, name),
    }


def _steps(store: StoreAPI[Any], cfg: Config, core: Any) -> list[dict[str, Any]]:
    return [
        _step(store, cfg, "source", {"source": VICTIM}, core),
        _step(store, cfg, "weights", {"model": MODEL, "keep_weights_digest": CURRENT}, core),
    ]


def _budgets(cfg: Config) -> tuple[int, int]:
    dram = cfg.chunks * LAYOUT.chunk_nbytes + 16 * MiB
    disk = cfg.chunks * 8 * 1024 + 64 * MiB  # a frame: a 4 KiB header and a payload page
    return dram, disk


def _embedded(cfg: Config, work: Path) -> dict[str, Any]:
    dram, disk = _budgets(cfg)
    with KVStore.open(work / "embedded", dram_bytes=dram, disk_bytes=disk) as store:
        t0 = time.monotonic()
        stored = _fill(store, cfg)
        fill_s = time.monotonic() - t0
        steps = _steps(store, cfg, store._core)
    return {"store": "embedded", "stored": stored, "fill_s": fill_s, "steps": steps}


def _served(cfg: Config, work: Path) -> dict[str, Any]:
    from kvlife.bench.server.servers import BenchServer
    from kvlife.tiers.shm import SHM_DIR

    dram, disk = _budgets(cfg)
    server = BenchServer(work / "served", dram, disk, SHM_DIR)
    try:
        with server.client() as store:
            t0 = time.monotonic()
            stored = _fill(store, cfg)
            fill_s = time.monotonic() - t0
            steps = _steps(store, cfg, None)
    finally:
        server.stop()
    return {"store": "served", "stored": stored, "fill_s": fill_s, "steps": steps}


def run(cfg: Config) -> dict[str, Any]:
    parent = cfg.directory if cfg.directory is not None else Path.cwd()
    work = Path(tempfile.mkdtemp(prefix=".kvlife-bench-inval-", dir=parent))
    try:
        machine = machine_figures(work, quick=cfg.quick)
        runs = [_embedded(cfg, work)]
        if cfg.served:
            runs.append(_served(cfg, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "benchmark": "invalidate",
        "chunks": cfg.chunks,
        "chunks_per_prompt": cfg.chunks_per_prompt,
        "chunk_bytes": LAYOUT.chunk_nbytes,
        "machine": machine,
        "runs": runs,
    }


def format_report(doc: dict[str, Any]) -> str:
    rows = []
    for r in doc["runs"]:
        for s in r["steps"]:
            cells = [r["store"], s["invalidation"], str(s["objects_before"]), str(s["removed"])]
            cells.append(f"{s['call_s'] * 1e3:.1f}")
            for tier in TIERS:
                t = s["tiers"][tier]
                at = "-" if t["freed_s"] is None else f"{t['freed_s'] * 1e3:.1f}"
                cells.append(f"{at} / {t['freed_bytes'] / MiB:.1f}")
            cells.append(str(s["stale_chunks_hit"]))
            rows.append(cells)
    head = ["store", "invalidate", "chunks", "removed", "call ms"]
    head += [f"{t} freed ms / MiB" for t in TIERS] + ["stale hits"]
    return format_table(head, rows) + "\n" + format_machine(doc["machine"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvlife bench invalidate", description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path, help="write the results as JSON to this file")
    p.add_argument("--dir", type=Path, help="scratch directory (default: the current one)")
    p.add_argument("--chunks", type=int, default=100_000, help="chunks in the store")
    p.add_argument("--chunks-per-prompt", type=int, default=1000)
    p.add_argument("--no-served", action="store_true", help="the embedded store only")
    p.add_argument("--quick", action="store_true", help="tiny sizes (for tests)")
    args = p.parse_args(argv)
    cfg = Config(
        chunks=400 if args.quick else args.chunks,
        chunks_per_prompt=20 if args.quick else args.chunks_per_prompt,
        served=not args.no_served,
        directory=args.dir,
        quick=args.quick,
    )
    if cfg.chunks < 2 * DOCS * cfg.chunks_per_prompt:
        p.error(f"--chunks must be at least {2 * DOCS} prompts of --chunks-per-prompt")
    doc = run(cfg)
    print(format_report(doc))
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

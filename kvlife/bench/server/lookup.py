"""Lookup of a 128-chunk prompt through the server against the in-process store."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kvlife.bench.server.config import MiB, ServerBenchConfig
from kvlife.bench.server.workload import NS, bench_identity, pct, prompt
from kvlife.client import RemoteStore
from kvlife.core.identity import KVLayout
from kvlife.store import KVStore


def bench_lookup(cfg: ServerBenchConfig, work: Path, remote: RemoteStore) -> dict[str, Any]:
    layout = KVLayout(1, 1, 8, "float16", 256)
    ident = bench_identity(layout, "-lookup")
    tokens, kv = prompt(layout, cfg.lookup_chunks, 1)
    emb = KVStore.open(work / "embedded", dram_bytes=256 * MiB, disk_bytes=0)
    try:
        emb.put_prompt(ident, NS, tokens, kv)
        remote.put_prompt(ident, NS, tokens, kv)
        times: dict[str, list[float]] = {"inproc": [], "server": []}
        for _ in range(cfg.lookup_reps):
            for name, store in (("inproc", emb), ("server", remote)):
                t0 = time.perf_counter()
                hits = len(store.lookup(ident, NS, tokens).hits)
                times[name].append(time.perf_counter() - t0)
                if hits != cfg.lookup_chunks:
                    raise RuntimeError(f"{name} lookup found {hits} of {cfg.lookup_chunks}")
    finally:
        emb.close(flush=False)
    out: dict[str, Any] = {"chunks": cfg.lookup_chunks, "tokens": len(tokens)}
    for name, xs in times.items():
        out[f"{name}_p50_us"] = pct(xs, 50) * 1e6
        out[f"{name}_p99_us"] = pct(xs, 99) * 1e6
    out["ratio_p50"] = out["server_p50_us"] / out["inproc_p50_us"]
    out["ratio_p99"] = out["server_p99_us"] / out["inproc_p99_us"]
    return out

"""Lookup of a 128-chunk prompt through the server against the in-process store, in
wall-clock time and in CPU time: this thread's per lookup (the client's side, or the
whole in-process lookup) and the server process's over all its lookups (on a shared
machine the wall clock counts the waits for a core as well)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from kvlife.bench.server.config import MiB, ServerBenchConfig
from kvlife.bench.server.workload import NS, bench_identity, pct, prompt
from kvlife.client import RemoteStore
from kvlife.core.identity import KVLayout
from kvlife.store import KVStore


def process_cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of process ``pid`` so far, every thread; NaN where
    ``/proc`` cannot tell (another system, the process gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_lookup(
    cfg: ServerBenchConfig, work: Path, remote: RemoteStore, server_pid: int | None = None
) -> dict[str, Any]:
    layout = KVLayout(1, 1, 8, "float16", 256)
    ident = bench_identity(layout, "-lookup")
    tokens, kv = prompt(layout, cfg.lookup_chunks, 1)
    emb = KVStore.open(work / "embedded", dram_bytes=256 * MiB, disk_bytes=0)
    try:
        emb.put_prompt(ident, NS, tokens, kv)
        remote.put_prompt(ident, NS, tokens, kv)
        times: dict[str, list[float]] = {"inproc": [], "server": []}
        cpu: dict[str, list[float]] = {"inproc": [], "server": []}
        served_cpu = process_cpu_seconds(server_pid) if server_pid is not None else float("nan")
        for _ in range(cfg.lookup_reps):
            for name, store in (("inproc", emb), ("server", remote)):
                c0 = time.thread_time()
                t0 = time.perf_counter()
                hits = len(store.lookup(ident, NS, tokens).hits)
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.thread_time() - c0)
                if hits != cfg.lookup_chunks:
                    raise RuntimeError(f"{name} lookup found {hits} of {cfg.lookup_chunks}")
        if server_pid is not None:
            served_cpu = process_cpu_seconds(server_pid) - served_cpu
    finally:
        emb.close(flush=False)
    out: dict[str, Any] = {"chunks": cfg.lookup_chunks, "tokens": len(tokens)}
    for name, xs in times.items():
        out[f"{name}_p50_us"] = pct(xs, 50) * 1e6
        out[f"{name}_p99_us"] = pct(xs, 99) * 1e6
    out["inproc_cpu_p50_us"] = pct(cpu["inproc"], 50) * 1e6
    # the client's side of a served lookup, and the server's (its process, every
    # thread, over all the lookups: the clock ticks every 10 ms)
    out["client_cpu_p50_us"] = pct(cpu["server"], 50) * 1e6
    out["server_cpu_us_per_lookup"] = served_cpu / cfg.lookup_reps * 1e6
    out["ratio_p50"] = out["server_p50_us"] / out["inproc_p50_us"]
    out["ratio_p99"] = out["server_p99_us"] / out["inproc_p99_us"]
    return out

"""One run of ``kvlife bench server``: its servers, every benchmark in turn, and the JSON
document with the targets."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvlife.bench.limits import machine_figures
from kvlife.bench.server.config import ROUND_TRIP_POINTS, TARGETS, MiB, ServerBenchConfig
from kvlife.bench.server.floor import QUICK_ROUND_TRIPS, ROUND_TRIPS, FloorServer
from kvlife.bench.server.loads import bench_load, bench_verified
from kvlife.bench.server.lookup import bench_lookup
from kvlife.bench.server.peer import peer_lmcache
from kvlife.bench.server.puts import bench_put
from kvlife.bench.server.scaling import bench_scaling
from kvlife.bench.server.servers import BenchServer, arena_dir, pinned
from kvlife.store import KVStore
from kvlife.tiers.shm import huge_pages


def run_server_bench(cfg: ServerBenchConfig) -> dict[str, Any]:
    base = cfg.directory if cfg.directory is not None else Path.cwd()
    # short names: a Unix socket path has at most 107 bytes
    work = Path(tempfile.mkdtemp(prefix="kvsrv-", dir=base))
    biggest = max(cfg.sizes) * cfg.chunks_per_call
    dram = max(256 * MiB, 3 * biggest)
    servers: list[BenchServer] = []
    with contextlib.ExitStack() as stack:
        shm = stack.enter_context(arena_dir(cfg, work))
        try:
            return _run(cfg, work, base, dram, shm, servers)
        finally:
            for s in servers:
                s.stop()
            stack.close()
            shutil.rmtree(work, ignore_errors=True)


def _run(
    cfg: ServerBenchConfig, work: Path, base: Path, dram: int, shm: Path, servers: list[BenchServer]
) -> dict[str, Any]:
    with (
        pinned(cfg) as (server_cpus, client_cpus),
        FloorServer(shm, max(cfg.sizes) * cfg.chunks_per_call, server_cpus) as floor,
    ):
        result = _points(cfg, work, base, dram, shm, servers, server_cpus, floor)
        result["peer_lmcache"] = peer_lmcache(cfg, server_cpus, work)
    result["config"]["server_cpus"] = server_cpus
    result["config"]["client_cpus"] = client_cpus
    result["targets"] = targets(result)
    return result


def _points(
    cfg: ServerBenchConfig,
    work: Path,
    base: Path,
    dram: int,
    shm: Path,
    servers: list[BenchServer],
    cpus: str,
    floor: FloorServer,
) -> dict[str, Any]:
    """Every point through ``kvlife serve``; the DRAM puts and the disk loads also
    through ``floor``, the bare server (on the servers' CPUs), beside."""
    pin = ("--cpus", cpus) if cpus else ()
    main = BenchServer(work / "m", dram, 4 * dram, shm, *pin)
    servers.append(main)
    remote = main.client()
    result: dict[str, Any] = {"config": asdict(cfg), "note": ""}
    result["config"]["directory"] = str(base)
    result["config"]["shm_dir"] = str(shm)
    result["machine"] = machine_figures(work, quick=cfg.quick)
    result["round_trip"] = floor.round_trips(QUICK_ROUND_TRIPS if cfg.quick else ROUND_TRIPS)
    result["shm_huge_pages"] = huge_pages(shm)
    result["lookup"] = bench_lookup(cfg, work, remote, main.proc.pid)
    result["load_dram"] = [
        bench_load(cfg, remote, s, 10 + i, None) for i, s in enumerate(cfg.sizes)
    ]
    embedded = KVStore.open(work / "inproc", dram_bytes=dram, disk_bytes=0)
    try:
        result["put_dram"] = [
            bench_put(cfg, remote, s, 20 + i, None, embedded, floor, main.proc.pid)
            for i, s in enumerate(cfg.sizes)
        ]
    finally:
        embedded.close(flush=False)
    remote.close()
    result["scaling"] = bench_scaling(cfg, main)
    main.stop()
    servers.remove(main)
    result["load_dram_verified"] = bench_verified(cfg, work, dram, shm, servers, pin)
    disk = BenchServer(work / "d", dram, 4 * dram, shm, *pin, "--no-promote", "--write-through")
    servers.append(disk)
    remote = disk.client()
    direct = disk.client(direct_reads=True)
    try:
        result["load_disk"] = [
            bench_load(cfg, remote, s, 30 + i, work, disk.proc.pid, floor, direct)
            for i, s in enumerate(cfg.sizes)
        ]
    finally:
        direct.close()
    result["put_write_through"] = [
        bench_put(cfg, remote, s, 40 + i, work) for i, s in enumerate(cfg.sizes)
    ]
    remote.close()
    add_round_trip_bounds(result)
    return result


def add_round_trip_bounds(r: dict[str, Any]) -> None:
    """Each put and disk load point's ``round_trip_bound``: its ratio if the served call
    took its limit's time (memcpy or raw reads or writes of the call's bytes) plus one
    round trip to a bare server after idleness and nothing else, no byte verified; and
    ``round_trip_bound_hot``, the same with a round trip back to back. A call whose
    client and server sleep while they wait (every served call here) does not pass the
    first; one that kept both vCPUs busy polling would pay only the second."""
    rt = r.get("round_trip")
    if not rt:
        return
    for key, limit in ROUND_TRIP_POINTS:
        for p in r.get(key, []):
            gbps = p.get(limit)
            if not gbps:
                continue
            t = p["chunk_bytes"] * p["chunks_per_call"] / (gbps * 1e9)
            p["round_trip_bound"] = t / (t + rt["idle_us"] / 1e6)
            p["round_trip_bound_hot"] = t / (t + rt["hot_us"] / 1e6)
    for p in r.get("load_disk", []):
        _ceiling_bounds(p, rt["idle_us"] / 1e6)


CEILING_BOUNDS = (("verified", "shared_bound"), ("copied", "ordinary_bound"))
"""A disk load point's ceilings, each with the bound it gives (:func:`_ceiling_bounds`):
the reads verified natively for a load into shared buffers, the raw reads with the copy
out beside them for one into the caller's own buffers."""


def _ceiling_bounds(p: dict[str, Any], round_trip_s: float) -> None:
    """A disk load point's ``shared_bound`` and ``ordinary_bound``: its ratio if the
    served call took its ceiling's time (``verified_gbps``, ``copied_gbps``: what no
    served design of that kind passes with every byte verified) plus one round trip
    after idleness, and nothing else. A target above the bound is held by the bound."""
    raw = p.get("raw_gbps")
    if not raw:
        return
    nbytes = p["chunk_bytes"] * p["chunks_per_call"]
    for ceiling, name in CEILING_BOUNDS:
        gbps = p.get(f"{ceiling}_gbps")
        if gbps:
            t = nbytes / (gbps * 1e9)
            p[name] = nbytes / (raw * 1e9) / (t + round_trip_s)


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    out = [
        {"name": "lookup_median", "value": r["lookup"]["ratio_p50"], "target": "<= 2.0"},
        {"name": "lookup_p99", "value": r["lookup"]["ratio_p99"], "target": "<= 2.0"},
    ]
    for key in ("load_dram", "load_disk", "put_dram", "put_write_through"):
        for p in r[key]:
            for ratio, suffix in (
                ("ratio", ""),
                ("ratio_shared", "_shared"),
                ("ratio_direct", "_direct"),
                ("ratio_direct_new", "_direct_new"),
            ):
                if ratio in p:
                    out.append(
                        {
                            "name": f"{key}_{p['chunk_bytes'] >> 10}KiB{suffix}",
                            "value": p[ratio],
                            "target": f">= {TARGETS[key]}",
                        }
                    )
    for t in out:
        bound = float(str(t["target"]).split()[1])
        t["met"] = t["value"] <= bound if str(t["target"]).startswith("<=") else t["value"] >= bound
    return out

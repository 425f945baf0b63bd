"""1, 2 and 4 client processes loading from the server's DRAM at once: aggregate
throughput and each client's P99. Each client is ``python -m kvlife.bench.server
--worker ...`` (:func:`worker`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from kvlife.bench.server.config import ServerBenchConfig
from kvlife.bench.server.servers import BenchServer, child_env
from kvlife.bench.server.workload import NS, bench_identity, chunk_layout, out_buffers, pct, prompt
from kvlife.client import RemoteStore

ALL_CPUS = sorted(os.sched_getaffinity(0))


def bench_scaling(cfg: ServerBenchConfig, srv: BenchServer) -> list[dict[str, Any]]:
    layout = chunk_layout(cfg.sizes[0])
    remote = srv.client()
    n = cfg.chunks_per_call
    tokens, kv = prompt(layout, n, 77)
    remote.put_prompt(bench_identity(layout), NS, tokens, kv)
    remote.close()
    points = []
    for clients in cfg.clients:
        start_at = time.time() + 1.5 + 0.2 * clients
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kvlife.bench.server",
                    "--worker",
                    str(srv.socket),
                    str(cfg.sizes[0]),
                    str(n),
                    str(cfg.client_seconds),
                    str(start_at),
                ],
                stdout=subprocess.PIPE,
                env={**child_env(), "KVLIFE_BENCH_CPUS": ",".join(map(str, ALL_CPUS))},
            )
            for _ in range(clients)
        ]
        results = []
        for p in procs:
            out, _ = p.communicate(timeout=120 + cfg.client_seconds)
            if p.returncode != 0:
                raise RuntimeError("a scaling client failed")
            results.append(json.loads(out))
        points.append(
            {
                "clients": clients,
                "aggregate_gbps": sum(r["bytes"] for r in results) / cfg.client_seconds / 1e9,
                "per_client_gbps": [r["bytes"] / cfg.client_seconds / 1e9 for r in results],
                "per_client_p99_ms": [r["p99_ms"] for r in results],
                "loads": sum(r["loads"] for r in results),
            }
        )
    return points


def worker(sock: str, size: int, n: int, seconds: float, start_at: float) -> int:
    """One scaling client: loads the shared prompt into its buffers for ``seconds``."""
    anywhere = os.environ.get("KVLIFE_BENCH_CPUS", "")
    if anywhere:  # not the parent's pinning: scaling clients run on every CPU
        os.sched_setaffinity(0, {int(c) for c in anywhere.split(",")})
    layout = chunk_layout(size)
    remote = RemoteStore(sock, timeout=300)
    tokens, _ = prompt(layout, n, 77)
    lk = remote.lookup(bench_identity(layout), NS, tokens)
    outs = out_buffers(layout, n)
    remote.load(lk, outs)
    time.sleep(max(0.0, start_at - time.time()))
    lat: list[float] = []
    nbytes = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        res = remote.load(lk, outs)
        lat.append(time.perf_counter() - t0)
        nbytes += sum(a.nbytes for a in res.arrays)
    remote.close()
    print(json.dumps({"bytes": nbytes, "loads": len(lat), "p99_ms": pct(lat, 99) * 1e3}))
    return 0

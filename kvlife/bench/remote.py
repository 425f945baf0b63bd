"""``kvlife bench remote``: the remote tiers against their raw clients, side by side.

- kvlife's Redis tier (frames verified on every read, leases, fencing) against raw
  redis-py/hiredis pipelined ``SET``/``GET`` of the same bytes on the same server;
- kvlife's Mooncake tier against the raw Mooncake client's ``put``/``get_batch`` (run
  inside a private network namespace, since Mooncake binds every interface);
- lookup of a 128-chunk prompt in the global index (median and P99);
- reads through the fault proxy under each fault: hit ratio, P99, wrong bytes served.

Every server is started here on 127.0.0.1 and stopped by PID.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import blake3
import numpy as np

from kvlife.core.identity import ChunkKey
from kvlife.faults.proxy import Fault, FaultProxy
from kvlife.globalindex import IndexConfig
from kvlife.tiers.base import ReplicaMeta
from kvlife.tiers.redis import RedisEndpoint, RedisTier
from kvlife.tiers.redis.published import PublishedTier
from kvlife.tiers.redis.server import RedisServer

KiB, MiB = 1 << 10, 1 << 20


def _key(tag: str, i: int) -> ChunkKey:
    return ChunkKey(blake3.blake3(f"{tag}{i}".encode()).digest())


def _arrays(size: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(size)
    return [rng.integers(0, 255, size, dtype=np.uint8) for _ in range(n)]


def _median(xs: list[float]) -> float:
    return float(np.median(xs)) if xs else 0.0


def _p99(xs: list[float]) -> float:
    return float(np.percentile(xs, 99)) if xs else 0.0


def _tier_vs_raw(
    tier: PublishedTier, raw_put: Any, raw_get: Any, sizes: list[int], total: int, reps: int
) -> list[dict[str, Any]]:
    """Per size: median GB/s of the tier's store/read_batch and of the raw calls."""
    rows = []
    for size in sizes:
        n = max(1, total // size)
        arrs = _arrays(size, n)
        keys = [_key(f"b{size}-", i) for i in range(n)]
        metas = [ReplicaMeta(k, "uint8", (size,), "exact", b"bench") for k in keys]
        t_put, t_get, r_put, r_get = [], [], [], []
        wrong = 0
        for rep in range(2 * reps):  # kvlife and raw alternate who goes first (drift)
            if (rep % 2 == 0) == (rep % 4 < 2):
                t0 = time.perf_counter()
                assert tier.store(metas, arrs), "bench tier too small"
                t1 = time.perf_counter()
                got = tier.read_batch(keys)
                t2 = time.perf_counter()
                wrong += sum(
                    1
                    for g, a in zip(got, arrs, strict=True)
                    if not isinstance(g, np.ndarray) or not np.array_equal(g, a)
                )
                del got
                tier.delete_batch(keys)
                t_put.append(t1 - t0)
                t_get.append(t2 - t1)
            else:
                names = [f"raw:{size}:{rep}:{i}" for i in range(n)]
                t3 = time.perf_counter()
                raw_put(names, arrs)
                t4 = time.perf_counter()
                raw = raw_get(names)
                t5 = time.perf_counter()
                wrong += sum(1 for g, a in zip(raw, arrs, strict=True) if len(g) != a.nbytes)
                del raw
                r_put.append(t4 - t3)
                r_get.append(t5 - t4)
        nbytes = n * size
        row = {
            "size": size,
            "objects": n,
            "kvlife_put_gbps": nbytes / _median(t_put) / 1e9,
            "kvlife_get_gbps": nbytes / _median(t_get) / 1e9,
            "raw_put_gbps": nbytes / _median(r_put) / 1e9,
            "raw_get_gbps": nbytes / _median(r_get) / 1e9,
            "wrong": wrong,
        }
        row["put_ratio"] = row["kvlife_put_gbps"] / row["raw_put_gbps"]
        row["get_ratio"] = row["kvlife_get_gbps"] / row["raw_get_gbps"]
        rows.append(row)
    return rows


def _redis_section(
    server: RedisServer, sizes: list[int], total: int, reps: int
) -> list[dict[str, Any]]:
    tier = RedisTier(
        RedisEndpoint(url=server.url),
        4 * total + (64 << 20),
        index=IndexConfig(namespace="b" + uuid.uuid4().hex[:8]),
    )
    raw = RedisEndpoint(url=server.url).connect()

    def raw_put(names: list[str], arrs: list[np.ndarray]) -> None:
        pipe = raw.pipeline(transaction=False)
        for name, a in zip(names, arrs, strict=True):
            pipe.set(name, a.data)
        pipe.execute()

    def raw_get(names: list[str]) -> list[bytes]:
        pipe = raw.pipeline(transaction=False)
        for name in names:
            pipe.get(name)
        out = list(pipe.execute())
        raw.delete(*names)
        return out

    try:
        return _tier_vs_raw(tier, raw_put, raw_get, sizes, total, reps)
    finally:
        tier.close()
        raw.close()


def _lookup_section(server: RedisServer, reps: int) -> dict[str, float]:
    """Probe of a 128-chunk prompt: one epoch read plus one pipelined GET of 128 records."""
    from kvlife.core.identity import (
        KVLayout,
        ModelIdentity,
        Namespace,
        NamespaceKind,
        prompt_chunk_keys,
    )
    from kvlife.core.objects import ObjectInfo

    layout = KVLayout(
        num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", tokens_per_chunk=16
    )
    ident = ModelIdentity(model_id="bench", weights_digest="w", tokenizer_digest="t", layout=layout)
    ns = Namespace(NamespaceKind.ORGANISATION, "bench")
    tokens = list(range(128 * 16))
    keys = prompt_chunk_keys(ident, ns, tokens)
    infos = []
    parent = ChunkKey(bytes(32))
    for i, k in enumerate(keys):
        infos.append(ObjectInfo.for_chunk(ident, ns, parent, i * 16).encode())
        parent = k
    tier = RedisTier(
        RedisEndpoint(url=server.url),
        1 << 30,
        index=IndexConfig(namespace="l" + uuid.uuid4().hex[:8]),
    )
    try:
        a = np.zeros(layout.chunk_shape, np.float16)
        metas = [
            ReplicaMeta(k, "float16", layout.chunk_shape, "exact", inf)
            for k, inf in zip(keys, infos, strict=True)
        ]
        tier.store(metas, [a] * len(keys))
        lat = []
        for _ in range(reps):
            t0 = time.perf_counter()
            found = tier.probe(keys, infos)
            lat.append(time.perf_counter() - t0)
            assert len(found) == 128
        return {"chunks": 128, "median_ms": _median(lat) * 1e3, "p99_ms": _p99(lat) * 1e3}
    finally:
        tier.close()


FAULTS = {
    "none": Fault.none(),
    "delay-5ms": Fault.delay(0.005),
    "bandwidth-50MB/s": Fault.bandwidth(50e6),
    "drop": Fault.drop(),
    "reset": Fault.reset(),
    "partition": Fault.partition(),
    "truncate": Fault.truncate(4096),
    "flip": Fault.flip(100_000),
}


def _fault_section(server: RedisServer, seconds: float) -> list[dict[str, Any]]:
    ns = "f" + uuid.uuid4().hex[:8]
    direct = RedisTier(RedisEndpoint(url=server.url), 1 << 28, index=IndexConfig(namespace=ns))
    arrs = _arrays(256 * KiB, 8)
    keys = [_key("fault", i) for i in range(8)]
    direct.store([ReplicaMeta(k, "uint8", (256 * KiB,), "exact", b"f") for k in keys], arrs)
    rows = []
    with FaultProxy(("127.0.0.1", server.port)) as proxy:
        for name, fault in FAULTS.items():
            via = RedisTier(
                RedisEndpoint(
                    url=f"redis://127.0.0.1:{proxy.port}/0",
                    socket_timeout_s=0.2,
                    connect_timeout_s=0.2,
                ),
                1 << 28,
                index=IndexConfig(namespace=ns),
            )
            proxy.set(fault)
            hits = attempts = wrong_bytes = 0
            lat: list[float] = []
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                t0 = time.perf_counter()
                got = via.read_batch(keys)
                lat.append(time.perf_counter() - t0)
                for g, a in zip(got, arrs, strict=True):
                    attempts += 1
                    if isinstance(g, np.ndarray):
                        if np.array_equal(g, a):
                            hits += 1
                        else:
                            wrong_bytes += int(np.count_nonzero(g != a))
            rows.append(
                {
                    "fault": name,
                    "reads": attempts,
                    "hit_ratio": hits / max(1, attempts),
                    "p99_ms": _p99(lat) * 1e3,
                    "wrong_bytes": wrong_bytes,
                    "unhealthy_after": not via.health.healthy,
                }
            )
            proxy.set(Fault.none())
            via.close()
    direct.close()
    return rows


def _mooncake_section(sizes: list[int], total: int, reps: int) -> dict[str, Any]:
    """Runs inside the private network namespace (see :func:`run_remote_bench`)."""
    from kvlife.tiers.mooncake import MooncakeConfig, MooncakeTier
    from kvlife.tiers.mooncake.server import MooncakeMaster

    work = Path(tempfile.mkdtemp(prefix="kvlife-bench-mc-"))
    master = MooncakeMaster(work / "mc").start()
    server = RedisServer(work).start()
    try:
        seg = max(512 * MiB, 6 * total)
        cfg = MooncakeConfig(
            master.master, master.metadata, segment_bytes=seg, buffer_bytes=64 * MiB
        )
        tier = MooncakeTier(
            cfg,
            RedisEndpoint(url=server.url),
            4 * total + (64 << 20),
            index=IndexConfig(namespace="m" + uuid.uuid4().hex[:8]),
        )
        mc = tier.mc

        def raw_put(names: list[str], arrs: list[np.ndarray]) -> None:
            for name, a in zip(names, arrs, strict=True):
                rc = mc.put(name, a.data)
                assert rc == 0, rc

        def raw_get(names: list[str]) -> list[bytes]:
            out = list(mc.get_batch(names))
            for name in names:
                mc.remove(name, True)
            return out

        rows = _tier_vs_raw(tier, raw_put, raw_get, sizes, total, reps)
        tier.close()
        return {"rows": rows}
    finally:
        server.stop()
        master.stop()


def run_remote_bench(quick: bool = False, reps: int = 3) -> dict[str, Any]:
    sizes = [256 * KiB, 1 * MiB] if quick else [256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB]
    total = 4 * MiB if quick else 64 * MiB
    reps = 1 if quick else reps
    work = Path(tempfile.mkdtemp(prefix="kvlife-bench-remote-"))
    server = RedisServer(work).start()
    try:
        result: dict[str, Any] = {
            "bench": "remote",
            "quick": quick,
            "redis": _redis_section(server, sizes, total, reps),
            "lookup": _lookup_section(server, 20 if quick else 200),
            "faults": _fault_section(server, 0.3 if quick else 2.0),
        }
    finally:
        server.stop()
    result["mooncake"] = _run_mooncake_isolated(quick, reps)
    return result


def _run_mooncake_isolated(quick: bool, reps: int) -> dict[str, Any]:
    from kvlife.tiers.mooncake.server import in_private_netns, netns_command

    args = ["--mooncake-only", "--reps", str(reps)] + (["--quick"] if quick else [])
    if in_private_netns():
        sizes = [256 * KiB, 1 * MiB] if quick else [256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB]
        return _mooncake_section(sizes, 4 * MiB if quick else 64 * MiB, reps)
    out = Path(tempfile.mkdtemp(prefix="kvlife-bench-mcout-")) / "mc.json"
    try:
        cmd = netns_command(
            [sys.executable, "-m", "kvlife.bench.remote", *args, "--json", str(out)]
        )
    except Exception as exc:
        return {"skipped": str(exc)}
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    if run.returncode != 0 or not out.exists():
        return {"skipped": f"mooncake run failed ({run.returncode}): {run.stderr[-400:]}"}
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def _table(result: dict[str, Any]) -> str:
    lines = ["tier      size      kvlife put/get GB/s   raw put/get GB/s   ratio put/get  wrong"]
    for tier in ("redis", "mooncake"):
        rows = result[tier] if tier == "redis" else result[tier].get("rows", [])
        for r in rows:
            lines.append(
                f"{tier:9s} {r['size'] // KiB:6d}K   "
                f"{r['kvlife_put_gbps']:6.2f} / {r['kvlife_get_gbps']:6.2f}"
                f"     {r['raw_put_gbps']:6.2f} / {r['raw_get_gbps']:6.2f}    "
                f"{r['put_ratio']:5.2f} / {r['get_ratio']:5.2f}   {r['wrong']}"
            )
    if "skipped" in result.get("mooncake", {}):
        lines.append(f"mooncake: skipped: {result['mooncake']['skipped']}")
    lk = result["lookup"]
    lines.append(
        f"lookup of a {lk['chunks']}-chunk prompt: median {lk['median_ms']:.2f} ms, "
        f"P99 {lk['p99_ms']:.2f} ms"
    )
    lines.append("fault              hit ratio   P99 ms   wrong bytes")
    for f in result["faults"]:
        lines.append(
            f"{f['fault']:18s} {f['hit_ratio']:8.2f} {f['p99_ms']:9.1f}   {f['wrong_bytes']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvlife bench remote", description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path, help="write the results as JSON here")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (median reported)")
    p.add_argument("--quick", action="store_true", help="small sizes, one repetition (tests)")
    p.add_argument("--mooncake-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.mooncake_only:
        result = _run_mooncake_isolated(args.quick, 1 if args.quick else args.reps)
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
        return 0
    result = run_remote_bench(quick=args.quick, reps=args.reps)
    print(_table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

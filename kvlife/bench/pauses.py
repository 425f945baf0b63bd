"""``kvlife bench pauses``: the tails of served calls as one server's index grows, with
the server's collector policy and without it (issue 28; docs/server.md, Known limits,
"Collector pauses").

One ``kvlife serve`` at a time, its DRAM tier large enough for every chunk: a client
puts fresh prompts of ``--chunks-per-put`` tiny chunks (1 KiB: the figure is about the
server's Python heap, not bandwidth) until ``--chunks`` are indexed, and looks each one
up after its put; every put's and lookup's time is kept (the first put's left out: it
stages the connection's extents). Run twice, in turn: ``policy``
(the default, :mod:`kvlife.server.heap`) and ``python`` (``--gc-whole-every 0``,
Python's collector as it is). Per eighth of the run (the index growing): median, p99
and longest of each. Then one ``info`` call (a whole collection of the server's heap)
and one connect. The comparison is the same calls to the same server without the
policy, in the same run: ``longest_ratio`` is the ``python`` run's longest put over the
``policy`` run's. A benchmark, not a test: its JSON is checked for shape only.
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
from kvlife.bench.server.servers import BenchServer
from kvlife.client.remote import RemoteStore
from kvlife.core.identity import PUBLIC, KVLayout, ModelIdentity
from kvlife.report import format_table
from kvlife.tiers.buffers import round_up
from kvlife.tiers.shm import SHM_DIR

MiB = 1 << 20
LAYOUT = KVLayout(1, 1, 16, "float16", 16)
"""1 KiB chunks (an arena page each)."""
IDENT = ModelIdentity("bench-pauses", "w", "t", LAYOUT)
WINDOWS = 8
RUNS = (("policy", ()), ("python", ("--gc-whole-every", "0")))


@dataclass(frozen=True, slots=True)
class Config:
    chunks: int = 256_000
    chunks_per_put: int = 64
    directory: Path | None = None
    shm_dir: Path | None = None
    quick: bool = False


def _stats(xs: list[float]) -> dict[str, float]:
    a = np.sort(np.asarray(xs))
    return {
        "p50_ms": float(a[len(a) // 2] * 1e3),
        "p99_ms": float(a[min(len(a) - 1, int(len(a) * 0.99))] * 1e3),
        "max_ms": float(a[-1] * 1e3),
    }


def _one(cfg: Config, name: str, flags: tuple[str, ...], work: Path) -> dict[str, Any]:
    dram = round_up(LAYOUT.chunk_nbytes) * cfg.chunks * 5 // 4 + 64 * MiB
    shm = cfg.shm_dir if cfg.shm_dir is not None else SHM_DIR
    srv = BenchServer(work / name, dram, 0, shm, *flags)
    try:
        client = srv.client()
        n = cfg.chunks_per_put * LAYOUT.tokens_per_chunk
        rng = np.random.default_rng(7)
        shape = (1, 2, 1, n, 16)
        kv = rng.integers(0, 1 << 15, shape, dtype=np.uint16).view(np.float16)
        puts = cfg.chunks // cfg.chunks_per_put
        put_s: list[float] = []
        look_s: list[float] = []
        for i in range(puts):
            tokens = list(range(i * n, (i + 1) * n))  # fresh: every chunk new
            t0 = time.perf_counter()
            res = client.put_prompt(IDENT, PUBLIC, tokens, kv)
            t1 = time.perf_counter()
            hits = client.lookup(IDENT, PUBLIC, tokens)
            t2 = time.perf_counter()
            if res.stored != cfg.chunks_per_put or len(hits.hits) != cfg.chunks_per_put:
                raise RuntimeError(f"put {i} stored {res.stored}, found {len(hits.hits)}")
            put_s.append(t1 - t0)
            look_s.append(t2 - t1)
        step = max(1, puts // WINDOWS)
        windows = [  # the first put (it stages the connection's extents) left out
            {
                "chunks": min(puts, at + step) * cfg.chunks_per_put,
                "put": _stats(put_s[max(1, at) : at + step]),
                "lookup": _stats(look_s[max(1, at) : at + step]),
            }
            for at in range(0, puts, step)
        ]
        put_s, look_s = put_s[1:], look_s[1:]
        gc = client.server_stats()["gc"]
        t0 = time.perf_counter()
        client.server_info()
        info_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        RemoteStore(srv.socket, timeout=300).close()
        connect_s = time.perf_counter() - t0
        client.close()
    finally:
        srv.stop()
    return {
        "server": name,
        "flags": list(flags),
        "windows": windows,
        "put": _stats(put_s),
        "lookup": _stats(look_s),
        "gc": gc,
        "info_ms": info_s * 1e3,
        "connect_ms": connect_s * 1e3,
    }


def run(cfg: Config) -> dict[str, Any]:
    parent = cfg.directory if cfg.directory is not None else Path.cwd()
    work = Path(tempfile.mkdtemp(prefix="kvp-", dir=parent))
    try:
        machine = machine_figures(work, quick=cfg.quick)
        runs = [_one(cfg, name, flags, work) for name, flags in RUNS]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    on, off = runs
    return {
        "benchmark": "pauses",
        "chunks": cfg.chunks,
        "chunks_per_put": cfg.chunks_per_put,
        "chunk_bytes": LAYOUT.chunk_nbytes,
        "machine": machine,
        "runs": runs,
        "longest_ratio": off["put"]["max_ms"] / on["put"]["max_ms"],
        "p99_ratio": off["put"]["p99_ms"] / on["put"]["p99_ms"],
    }


def format_report(doc: dict[str, Any]) -> str:
    rows = []
    for r in doc["runs"]:
        for w in r["windows"]:
            p, lk = w["put"], w["lookup"]
            rows.append(
                [r["server"], str(w["chunks"])]
                + [f"{p[k]:.2f}" for k in ("p50_ms", "p99_ms", "max_ms")]
                + [f"{lk[k]:.2f}" for k in ("p50_ms", "p99_ms", "max_ms")]
            )
    head = ["server", "chunks", "put p50 ms", "p99", "longest", "lookup p50 ms", "p99", "longest"]
    lines = [format_table(head, rows)]
    for r in doc["runs"]:
        lines.append(
            f"{r['server']}: an info call {r['info_ms']:.1f} ms, a connect "
            f"{r['connect_ms']:.1f} ms, gc {r['gc'] or 'Python as it is'}"
        )
    lines.append(
        f"longest put without the policy / with it: {doc['longest_ratio']:.1f}x; "
        f"p99 {doc['p99_ratio']:.2f}x"
    )
    return "\n".join(lines) + "\n" + format_machine(doc["machine"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvlife bench pauses", description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path, help="write the results as JSON to this file")
    p.add_argument("--dir", type=Path, help="scratch directory (default: the current one)")
    p.add_argument("--shm-dir", type=Path, help="the servers' --shm-dir (default /dev/shm)")
    p.add_argument("--chunks", type=int, default=256_000, help="chunks indexed at the end")
    p.add_argument("--chunks-per-put", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="tiny sizes (for tests)")
    args = p.parse_args(argv)
    per = 8 if args.quick else args.chunks_per_put
    cfg = Config(
        chunks=64 * per if args.quick else args.chunks,
        chunks_per_put=per,
        directory=args.dir,
        shm_dir=args.shm_dir,
        quick=args.quick,
    )
    if cfg.chunks_per_put < 1 or cfg.chunks < 2 * WINDOWS * cfg.chunks_per_put:
        p.error(f"--chunks must be at least {2 * WINDOWS} puts of --chunks-per-put (>= 1)")
    doc = run(cfg)
    print(format_report(doc))
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

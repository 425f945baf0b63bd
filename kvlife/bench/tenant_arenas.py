"""``kvlife bench tenant-arenas``: what per-principal arenas cost (issue 24, "memory that
only its tenant can map"), against today's single arena.

Three servers, the same client work: put a prompt of ``--chunks`` chunks of 2 MiB into
the client's user scope, look it up, load it into prefaulted buffers (DRAM hits); fresh
prompts each round, medians over ``--rounds``. The modes:

- ``single``: no ``--tenants``; the one arena every client maps (populated at start).
- ``own_arena``: ``--tenants``, a principal of this Unix user: it maps its own arena
  (made at its first ``hello``, not populated: the first touch of each page faults).
- ``socket``: ``--tenants``, a principal by token only: no mapping, its puts and loads
  carry the bytes through the socket (copies both ways).

Figures are GB/s of chunk bytes per put and per load, with the machine's figures
(:func:`kvlife.bench.limits.machine_figures`) under ``"machine"``. Indicative on a
shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvlife.bench.limits import machine_figures
from kvlife.bench.server.servers import BenchServer
from kvlife.bench.server.workload import NS, bench_identity, chunk_layout, prompt
from kvlife.client import RemoteStore
from kvlife.tenancy import token_digest
from kvlife.tiers.shm import SHM_DIR

MiB = 1 << 20
TOKEN = "bench-token-0123456789"
MODES = ("single", "own_arena", "socket")


def _config(path: Path, mode: str) -> Path:
    uids = f"uids = [{os.geteuid()}]" if mode == "own_arena" else ""
    path.write_text(
        f'[principal.bench]\n{uids}\ntoken_sha256 = "{token_digest(TOKEN)}"\n', encoding="utf-8"
    )
    return path


def _run_mode(work: Path, mode: str, chunks: int, rounds: int) -> dict[str, Any]:
    layout = chunk_layout(2 * MiB)
    ident = bench_identity(layout)
    dram = (rounds + 2) * chunks * 2 * MiB
    flags: list[str] = []
    if mode != "single":
        flags = ["--tenants", str(_config(work / f"{mode}.toml", mode))]
    server = BenchServer(work / mode, dram, 64 * MiB, SHM_DIR, *flags)
    token = None if mode == "single" else TOKEN
    puts: list[float] = []
    loads: list[float] = []
    nbytes = chunks * layout.chunk_nbytes
    outs = [np.empty(layout.chunk_shape, np.float16) for _ in range(chunks)]
    for out in outs:
        out.fill(0)  # prefaulted
    try:
        with RemoteStore(server.socket, timeout=300, token=token) as store:
            mapped = store.server_info()
            for r in range(rounds):
                tokens, kv = prompt(layout, chunks, seed=1000 + r)
                t0 = time.perf_counter()
                put = store.put_prompt(ident, NS, tokens, kv)
                t1 = time.perf_counter()
                hit = store.lookup(ident, NS, tokens)
                got = store.load(hit, outs)
                t2 = time.perf_counter()
                if put.stored != chunks or got.loaded != chunks:
                    raise RuntimeError(f"{mode}: stored {put.stored}, loaded {got.loaded}")
                puts.append(nbytes / (t1 - t0) / 1e9)
                loads.append(nbytes / (t2 - t1) / 1e9)
    finally:
        server.stop()
    return {
        "put_gbps": statistics.median(puts),
        "load_gbps": statistics.median(loads),
        "first_put_gbps": puts[0],
        "first_load_gbps": loads[0],
        "rounds": rounds,
        "principal": mapped.get("principal", {}).get("name", "") if mode != "single" else "",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvlife bench tenant-arenas", description=__doc__)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--chunks", type=int, default=16, help="2 MiB chunks per prompt")
    p.add_argument("--rounds", type=int, default=8, help="prompts per mode")
    p.add_argument("--quick", action="store_true", help="a small run (shape only)")
    args = p.parse_args(argv)
    chunks, rounds = (2, 2) if args.quick else (args.chunks, args.rounds)
    with tempfile.TemporaryDirectory(prefix="kvlife-bench-arenas-") as d:
        work = Path(d)
        out: dict[str, Any] = {
            "chunk_bytes": 2 * MiB,
            "chunks": chunks,
            "machine": machine_figures(work, quick=True),
            "modes": {m: _run_mode(work, m, chunks, rounds) for m in MODES},
        }
    base = out["modes"]["single"]
    for m in MODES[1:]:
        fig = out["modes"][m]
        fig["put_vs_single"] = fig["put_gbps"] / base["put_gbps"]
        fig["load_vs_single"] = fig["load_gbps"] / base["load_gbps"]
    text = json.dumps(out, indent=2)
    if args.json is not None:
        args.json.write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``kvlife bench stages``: one served call laid out stage by stage (issue 28: measure
where a served disk load's and DRAM put's time goes).

Two ``kvlife serve`` processes run under probes (:mod:`kvlife.bench.stage_probes`),
one after the other, pinned as ``kvlife bench server`` pins them (the server on the
last CPU, this process on the others, arenas in a huge-page tmpfs when it can mount
one): a write-through server with promotion off, whose chunks are on disk, for the
loads, and a DRAM server for the puts. This process (the client, probed too) makes
``--calls`` calls of each kind, ``--gap`` ms apart, stamping each call's start and
end:

- ``load_shared``: a 4-chunk prompt loaded from disk into the session's shared buffers;
- ``load_ordinary``: the same into the caller's own buffers (grants, a copy here);
- ``put``: a 4-chunk prompt put into DRAM through staged extents (invalidated after
  each, outside the call). Each put's prompt is generated just before it, outside the
  call, as ``kvlife bench server`` makes its puts' (its bytes just written, the caches
  as that bench leaves them); ``--reuse-prompts`` puts four prompts in turn instead,
  made once: a warmer layout (every Python step of a put measured 4-7x faster on warm
  caches than right after its prompt's 8 MiB were generated, issue 28, 2026-12-07).

Every stamp is ``time.perf_counter`` (CLOCK_MONOTONIC on Linux: one clock for both
processes). A probe's record belongs to the call during which it returned; the n-th
record of one stage within a call is stage ``label #n``. Per kind the report gives each
stage that at least half the calls have: the median of its entry and of its return,
in µs from the call's start (an entry before 0: the function was waiting before the
call began, as the server's frame read does), and the call's median time. The probes
cost about a microsecond a call each (more on a cold cache); the calls are that much
slower than unprobed ones. A benchmark, not a test: it prints a table and writes
JSON; nothing here asserts speed.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import shutil
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvlife.bench.limits import format_machine, machine_figures
from kvlife.bench.server.config import MiB, ServerBenchConfig
from kvlife.bench.server.servers import BenchServer, arena_dir, pinned
from kvlife.bench.server.workload import (
    NS,
    bench_identity,
    chunk_layout,
    out_buffers,
    prompt,
    same_bits,
    split_chunks,
)
from kvlife.bench.stage_probes import CLIENT_PROBES, Record, Recorder, read_records
from kvlife.client import RemoteStore

KINDS = ("load_shared", "load_ordinary", "put")
CHUNKS = 4


@dataclass(frozen=True, slots=True)
class StagesConfig:
    chunk_bytes: int = 2 * MiB
    calls: int = 200
    """Calls of each kind (the first tenth are a warm-up, not reported)."""
    gap_ms: float = 2.0
    """Pause between two calls."""
    quick: bool = False
    directory: Path | None = None
    shm_dir: Path | None = None
    huge: bool = True
    pin: bool = True
    reuse_prompts: bool = False
    """Puts of four prompts made once, in turn (else a new prompt before each put)."""


Window = tuple[str, float, float]
"""(kind, start, end) of one timed call."""


def run_stages(cfg: StagesConfig) -> dict[str, Any]:
    base = cfg.directory if cfg.directory is not None else Path.cwd()
    work = Path(tempfile.mkdtemp(prefix="kvst-", dir=base))
    server_cfg = ServerBenchConfig(
        quick=cfg.quick, directory=base, shm_dir=cfg.shm_dir, huge=cfg.huge, pin=cfg.pin
    )
    windows: list[Window] = []
    records: list[Record] = []
    client = Recorder()
    dram = max(256 * MiB, 4 * CHUNKS * cfg.chunk_bytes)
    try:
        with contextlib.ExitStack() as stack:
            shm = stack.enter_context(arena_dir(server_cfg, work))
            server_cpus, client_cpus = stack.enter_context(pinned(server_cfg))
            pin = ("--cpus", server_cpus) if server_cpus else ()
            client.install(CLIENT_PROBES)
            stack.callback(client.uninstall)
            for name, flags, calls in (
                ("d", ("--no-promote", "--write-through"), _loads),
                ("m", (), _puts),
            ):
                out = work / f"{name}.stages"
                launcher = ("-m", "kvlife.bench.stage_probes", str(out))
                srv = BenchServer(work / name, dram, 4 * dram, shm, *pin, *flags, launcher=launcher)
                try:
                    remote = srv.client()
                    try:
                        calls(cfg, remote, windows)
                    finally:
                        remote.close()
                finally:
                    srv.stop()
                records += read_records(out)
            records += client.records
        result: dict[str, Any] = {
            "config": asdict(cfg) | {"directory": str(base), "shm_dir": str(shm)},
            "machine": machine_figures(work, quick=cfg.quick),
            "pinning": {"server_cpus": server_cpus, "client_cpus": client_cpus},
            "kinds": {k: analyse(k, windows, records, cfg.calls // 10) for k in KINDS},
        }
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _loads(cfg: StagesConfig, remote: RemoteStore, windows: list[Window]) -> None:
    layout = chunk_layout(cfg.chunk_bytes)
    ident = bench_identity(layout)
    tokens, kv = prompt(layout, CHUNKS, 7)
    remote.put_prompt(ident, NS, tokens, kv)
    remote.flush()
    remote.evict("dram", 1 << 62)
    lk = remote.lookup(ident, NS, tokens)
    if lk.tiers() != {"disk": CHUNKS}:
        raise RuntimeError(f"expected {CHUNKS} disk hits, got {lk.tiers()}")
    chunks = split_chunks(kv, layout, CHUNKS)
    raw = remote.alloc_buffer(CHUNKS * layout.chunk_nbytes)
    shared = [
        raw[i * layout.chunk_nbytes : (i + 1) * layout.chunk_nbytes]
        .view(np.float16)
        .reshape(layout.chunk_shape)
        for i in range(CHUNKS)
    ]
    outs = {"load_shared": shared, "load_ordinary": out_buffers(layout, CHUNKS)}
    for kind in ("load_shared", "load_ordinary"):  # an ordinary load's grant is
        # released ahead of the next request: every ordinary load but the first carries
        # the one before it's release
        bufs = outs[kind]
        for i in range(cfg.calls):
            time.sleep(cfg.gap_ms / 1000)
            t0 = time.perf_counter()
            res = remote.load(lk, bufs)
            windows.append((kind, t0, time.perf_counter()))
            if res.loaded != CHUNKS or (
                i == 0 and not all(same_bits(a, b) for a, b in zip(bufs, chunks, strict=True))
            ):
                raise RuntimeError(f"{kind}: loaded {res.loaded} of {CHUNKS}, or wrong bytes")
    del shared, raw
    remote.invalidate(namespace=NS)


def _puts(cfg: StagesConfig, remote: RemoteStore, windows: list[Window]) -> None:
    layout = chunk_layout(cfg.chunk_bytes)
    ident = bench_identity(layout)

    def made(seed: int) -> tuple[list[int], list[np.ndarray]]:
        tokens, kv = prompt(layout, CHUNKS, seed)
        return tokens, split_chunks(kv, layout, CHUNKS)

    pool = [made(100 + s) for s in range(4)] if cfg.reuse_prompts else []
    for i in range(cfg.calls + 2):
        time.sleep(cfg.gap_ms / 1000)
        tokens, chunks = pool[i % len(pool)] if pool else made(100 + i)
        t0 = time.perf_counter()
        res = remote.put_prompt(ident, NS, tokens, chunks)
        if i >= 2:  # the first puts stage extents for the next: not timed
            windows.append(("put", t0, time.perf_counter()))
        if res.stored != CHUNKS:
            raise RuntimeError(f"put stored {res.stored} of {CHUNKS} chunks")
        remote.invalidate(namespace=NS)


def analyse(kind: str, windows: list[Window], records: list[Record], skip: int) -> dict[str, Any]:
    """The stages of ``kind``'s calls (after the first ``skip``): each record goes to the
    call during which it returned."""
    mine = [(t0, t1) for k, t0, t1 in windows if k == kind][skip:]
    if not mine:
        return {"calls": 0, "call_us": float("nan"), "stages": []}
    ordered = sorted(records, key=lambda r: r[2])
    ends = [r[2] for r in ordered]
    starts: dict[str, list[float]] = {}
    returns: dict[str, list[float]] = {}
    for t0, t1 in mine:
        seen: Counter[str] = Counter()
        lo, hi = bisect.bisect_left(ends, t0), bisect.bisect_right(ends, t1)
        for label, entered, returned, _ in sorted(ordered[lo:hi], key=lambda r: r[1]):
            key = f"{label} #{seen[label]}"
            seen[label] += 1
            starts.setdefault(key, []).append((entered - t0) * 1e6)
            returns.setdefault(key, []).append((returned - t0) * 1e6)
    stages = [
        {
            "stage": key,
            "calls": len(starts[key]),
            "start_us": statistics.median(starts[key]),
            "end_us": statistics.median(returns[key]),
        }
        for key in starts
        if len(starts[key]) * 2 >= len(mine)
    ]
    stages.sort(key=lambda s: (s["start_us"], s["end_us"]))
    return {
        "calls": len(mine),
        "call_us": statistics.median((t1 - t0) * 1e6 for t0, t1 in mine),
        "stages": stages,
    }


TITLES = {
    "load_shared": "served disk load into shared buffers",
    "load_ordinary": "served disk load into the caller's buffers",
    "put": "served DRAM put through staged extents",
}


def format_report(r: dict[str, Any]) -> str:
    mib = r["config"]["chunk_bytes"] / MiB
    lines = []
    for kind in KINDS:
        k = r["kinds"][kind]
        title = TITLES[kind]
        if kind == "put":
            reused = r["config"].get("reuse_prompts", False)
            title += " (four prompts in turn)" if reused else " (a new prompt each)"
        lines.append(
            f"{title}, {CHUNKS} x {mib:g} MiB: {k['call_us']:.0f} µs median ({k['calls']} calls)"
        )
        lines.append(f"  {'stage':40s} {'start µs':>9s} {'end µs':>9s} {'calls':>6s}")
        for s in k["stages"]:
            lines.append(
                f"  {s['stage']:40s} {s['start_us']:9.0f} {s['end_us']:9.0f} {s['calls']:6d}"
            )
        lines.append("")
    lines.append(format_machine(r["machine"]))
    lines.append(f"server on CPU {r['pinning']['server_cpus'] or 'any (not pinned)'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvlife bench stages", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--chunk-mib", type=float, default=2.0, help="chunk size (MiB, default 2)")
    p.add_argument("--calls", type=int, default=200, help="calls of each kind (default 200)")
    p.add_argument("--gap", type=float, default=2.0, help="ms between calls (default 2)")
    p.add_argument("--quick", action="store_true", help="a small run (shape only)")
    p.add_argument("--dir", type=Path, default=None, help="work directory (default: cwd)")
    p.add_argument("--shm-dir", type=Path, default=None, help="the servers' --shm-dir")
    p.add_argument("--no-huge", action="store_true", help="arenas in /dev/shm as it is")
    p.add_argument(
        "--no-pin", action="store_true", help="leave the servers and this process unpinned"
    )
    p.add_argument(
        "--reuse-prompts",
        action="store_true",
        help="put four prompts made once, in turn (default: a new one before each put, "
        "as kvlife bench server does)",
    )
    args = p.parse_args(argv)
    if args.calls < 2 or args.chunk_mib <= 0 or args.gap < 0:
        p.error("--calls must be >= 2, --chunk-mib > 0 and --gap >= 0")
    cfg = StagesConfig(
        chunk_bytes=int(args.chunk_mib * MiB),
        calls=min(args.calls, 20) if args.quick else args.calls,
        gap_ms=args.gap,
        quick=args.quick,
        directory=args.dir,
        shm_dir=args.shm_dir,
        huge=not args.no_huge,
        pin=not args.no_pin,
        reuse_prompts=args.reuse_prompts,
    )
    result = run_stages(cfg)
    print(format_report(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

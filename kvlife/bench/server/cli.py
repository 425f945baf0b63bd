"""``kvlife bench server``'s command line (and its scaling clients' ``--worker``)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from kvlife.bench.counts import count_arg
from kvlife.bench.server.config import ServerBenchConfig
from kvlife.bench.server.report import format_report
from kvlife.bench.server.run import run_server_bench
from kvlife.bench.server.scaling import worker

DESCRIPTION = (
    "``kvlife bench server``: the store served by ``kvlife serve`` against the in-process\n"
    "store and the machine's limits, measured in the same run."
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvlife bench server", description=DESCRIPTION)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--quick", action="store_true", help="a small run (shape only)")
    p.add_argument("--dir", type=Path, default=None, help="work directory (default: cwd)")
    p.add_argument(
        "--shm-dir", type=Path, default=None, help="the servers' --shm-dir (default: see --no-huge)"
    )
    p.add_argument(
        "--no-huge",
        action="store_true",
        help="arenas in /dev/shm as it is, not in a huge=always tmpfs mounted for the run",
    )
    p.add_argument(
        "--no-pin", action="store_true", help="leave the servers and this process unpinned"
    )
    p.add_argument(
        "--peer-python",
        type=Path,
        default=None,
        help="python of an LMCache peer venv (kvlife/bench/peer_lmcache_mp.py)",
    )
    p.add_argument("--no-peer", action="store_true", help="do not run LMCache's MP mode beside")
    p.add_argument(
        "--rounds",
        type=count_arg("--rounds", MAX_ROUNDS),
        default=None,
        help="timed rounds of each load and put point, the median reported (default 40; "
        "--quick 2): more rounds, steadier medians, a longer run",
    )
    p.add_argument("--worker", nargs=5, default=None, help=argparse.SUPPRESS)
    return p


MAX_ROUNDS = 1000
"""The most timed rounds a point takes (each round of a 16 MiB disk point reads about a
gigabyte: a thousand is hours)."""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker is not None:
        sock, size, n, seconds, start_at = args.worker
        return worker(sock, int(size), int(n), float(seconds), float(start_at))
    cfg = ServerBenchConfig.small(args.dir) if args.quick else ServerBenchConfig(directory=args.dir)
    cfg = replace(
        cfg,
        reps=cfg.reps if args.rounds is None else args.rounds,
        shm_dir=args.shm_dir,
        huge=not args.no_huge,
        pin=not args.no_pin,
        peer=not args.no_peer,
        peer_python=args.peer_python,
    )
    result = run_server_bench(cfg)
    print(format_report(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0

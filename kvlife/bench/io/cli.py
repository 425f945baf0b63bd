"""``kvlife bench io``'s command line: flags to an :class:`IOBenchConfig`, the table
on stdout, the JSON document to ``--json``."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from kvlife.bench.io.config import PEERS, IOBenchConfig, parse_size
from kvlife.bench.io.report import format_report
from kvlife.bench.io.run import run_io_bench


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvlife bench io",
        description=(
            "Measure kvlife's memory and disk tiers against memcpy and raw O_DIRECT I/O "
            "in the same run, plus the time of a 128-chunk lookup."
        ),
    )
    p.add_argument("--json", metavar="FILE", type=Path, help="write the results as JSON")
    p.add_argument(
        "--dir",
        metavar="DIR",
        type=Path,
        help="make the scratch directory here (default: the current directory, whose "
        "filesystem is usually a real device; tmpfs has no O_DIRECT)",
    )
    p.add_argument(
        "--sizes",
        metavar="LIST",
        help="comma-separated object sizes (default 256KiB,2MiB,16MiB; --quick 16KiB,64KiB)",
    )
    p.add_argument("--batch", type=int, help="objects per batch (default 64; --quick 4)")
    p.add_argument("--repeat", type=int, help="repetitions per size (default 15; --quick 2)")
    p.add_argument("--peer", choices=PEERS, help="also run the workload through a peer")
    p.add_argument("--lookup-iters", type=int, help="timed lookups (default 300)")
    p.add_argument("--quick", action="store_true", help="tiny sizes and batches (for tests)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def config_from_args(args: argparse.Namespace) -> IOBenchConfig:
    base = IOBenchConfig.quick_config() if args.quick else IOBenchConfig()
    changes: dict[str, object] = {"progress": not args.no_progress}
    if args.sizes:
        changes["sizes"] = tuple(parse_size(t) for t in args.sizes.split(",") if t.strip())
    for name in ("batch", "repeat", "lookup_iters", "peer"):
        value = getattr(args, name)
        if value is not None:
            changes[name] = value
    if args.dir is not None:
        changes["directory"] = args.dir
    return replace(base, **changes)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    """``kvlife bench io``: print the table, optionally write the JSON; 0 on success."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        result = run_io_bench(config)
    except (OSError, RuntimeError) as exc:
        print(f"kvlife bench io: error: {exc}", file=sys.stderr)
        return 1
    peers = result.get("peers")
    if isinstance(peers, dict):
        for name, entry in peers.items():
            if isinstance(entry, dict) and not entry.get("available"):
                print(f"kvlife bench io: peer {name} skipped: {entry['reason']}", file=sys.stderr)
    print(format_report(result))
    if args.json is not None:
        text = json.dumps(result, indent=2, allow_nan=False)
        args.json.write_text(text + "\n", encoding="utf-8")
    return 0

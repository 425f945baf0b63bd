"""``kvlife experiment faults``: the seeded cross-layer fault campaign.

Drives the campaign's workload through an embedded store, through ``kvlife serve`` with
client processes, and (side by side) through LMCache's local-disk backend, injecting the
faults of :mod:`kvlife.experiments.campaign` in a seeded random order, and checks every
served chunk against the oracle. Writes the tallies as JSON (``--json``) and an HTML
report with a table per deployment and a plot (``--report``). The default is a short
run; ``--full`` runs at least 10,000 injections over at least 10 kinds and at least
1,000 SIGKILLs (docs/faults.md has the figures and how long it takes).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvlife.experiments.campaign import html, runner
from kvlife.experiments.campaign.tally import Campaign


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="kvlife experiment faults",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--json", type=Path, required=True, help="write the tallies here")
    ap.add_argument("--report", type=Path, default=None, help="write the HTML report here")
    ap.add_argument("--full", action="store_true", help="the full campaign (tens of minutes)")
    ap.add_argument("--seed", type=int, default=0, help="campaign seed")
    ap.add_argument(
        "--parts",
        default=",".join(runner.DEFAULT_PARTS),
        help=f"comma-separated parts to run (of {', '.join(runner.PARTS)}; default: all but vllm)",
    )
    ap.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="scratch directory (default: a new temporary one)",
    )
    args = ap.parse_args(argv)
    parts = tuple(p for p in args.parts.split(",") if p)
    unknown = [p for p in parts if p not in runner.PARTS]
    if unknown:
        ap.error(f"unknown parts {unknown}; choose from {list(runner.PARTS)}")
    started = time.perf_counter()
    meta = runner.stamp()
    command = "kvlife experiment faults " + " ".join(sys.argv[1:] if argv is None else argv)

    def save(campaign: Campaign, finished: str) -> dict[str, Any]:
        """Write the JSON as it stands (after each part, so a long run that is stopped
        still leaves what it measured); ``finished`` names the last part done."""
        doc = campaign.to_json(
            command=command,
            elapsed_s=time.perf_counter() - started,
            parts=list(parts),
            last_part_done=finished,
            **meta,
        )
        args.json.write_text(json.dumps(doc, indent=1))
        return doc

    with tempfile.TemporaryDirectory(prefix="kvlife-faults-", dir=args.workdir) as tmp:
        campaign = runner.run(Path(tmp), args.seed, args.full, parts, done=save)
    doc = save(campaign, "all")
    if args.report is not None:
        args.report.write_text(html.render(doc))
    for system, row in doc["totals"].items():
        print(f"{system}: " + ", ".join(f"{k} {v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

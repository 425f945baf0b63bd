"""``kvlife report``: one run of a trace, all the metrics, as JSON and one HTML page.

- ``kvlife report --trace F --json F --html F.html``: one host (DRAM, SSD through the
  FTL model, optional remote tier, faults, tenant quotas; :mod:`kvlife.reporting.host`)
  and the lifecycle distribution of its replay.
- ``kvlife report --trace F --cluster 64 ...``: the cluster simulation
  (:mod:`kvlife.reporting.cluster`) instead of the one-host run.
- ``--events [LABEL=]F`` (repeatable): lifecycle event logs of a live engine's store
  (JSON lines or Parquet, :func:`kvlife.trace.events_io.read_events`: ``kvlife demo
  --events``, the vLLM connector's ``kvlife.events``) analysed beside the replay, each
  as the source ``live:LABEL`` (default: the file's name), side by side.

Sizes take units (``256GiB``, ``2TiB``, ``0``).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvlife.core.errors import InvalidArgument
from kvlife.replay.engine import COMPUTE_PRESETS
from kvlife.reporting.config import HostConfig
from kvlife.reporting.faults import FaultConfig
from kvlife.trace.importers import FORMATS, read_trace

_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}


def parse_bytes(text: str) -> int:
    """``256GiB``, ``2TB``, ``0`` -> bytes (InvalidArgument naming the text otherwise)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b|b)?\s*", text.lower())
    if m is None:
        raise InvalidArgument(f"size {text!r}: use bytes with a unit, like 256GiB or 2TB")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvlife report",
        description="one replay of a real trace, every metric side by side (JSON and HTML)",
    )
    p.add_argument("--trace", required=True, help="trace file (e.g. the Mooncake trace)")
    p.add_argument("--format", default="mooncake", choices=FORMATS, help="trace format")
    p.add_argument("--max-requests", type=int, default=None, help="replay only the first N")
    p.add_argument("--json", default=None, help="write the report as JSON here")
    p.add_argument("--html", default=None, help="write the report as HTML (plots embedded)")
    p.add_argument(
        "--events",
        action="append",
        default=[],
        metavar="[LABEL=]FILE",
        help="lifecycle event log of a live engine's store (JSONL or Parquet: kvlife demo "
        "--events, the vLLM connector's kvlife.events), reported as source live:LABEL "
        "(default: the file name); repeatable",
    )
    h = p.add_argument_group("one host (default mode)")
    h.add_argument("--policy", default="lru", help="eviction policy of the local tiers")
    h.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=None,
        help="KV bytes per token (host: 131072, Llama-3-8B; cluster: 327680, 70B)",
    )
    h.add_argument("--dram", default="256GiB", help="DRAM for KV")
    h.add_argument("--ssd", default="2TiB", help="SSD capacity for KV (0: none)")
    h.add_argument("--ssd-drives", type=int, default=4, help="NVMe drives the SSD tier spans")
    h.add_argument("--ssd-op", type=float, default=0.07, help="SSD over-provisioning")
    h.add_argument(
        "--fdp",
        action="store_true",
        help="FDP placement hints: one reclaim unit per lifecycle class",
    )
    h.add_argument("--remote", default="0", help="remote tier capacity (0: none)")
    h.add_argument("--remote-link", default="rdma", choices=("rdma", "tcp"))
    h.add_argument("--compute", default="gpu-8b", choices=sorted(COMPUTE_PRESETS))
    h.add_argument(
        "--fault-rate",
        type=float,
        default=0.0,
        help="probability that a block read from SSD or remote fails",
    )
    h.add_argument("--seed", type=int, default=0, help="fault seed")
    h.add_argument(
        "--tenants",
        default="",
        choices=("", "user", "organisation"),
        help="derive tenants from the trace's prefixes",
    )
    h.add_argument("--tenant-groups", type=int, default=4, help="fold derived tenants into N")
    h.add_argument(
        "--tenant-shares",
        default="",
        help="quotas per tier: equal or name=fraction,... (needs --tenants)",
    )
    c = p.add_argument_group("cluster (--cluster N)")
    c.add_argument("--cluster", type=int, default=0, help="simulate N engine hosts instead")
    c.add_argument("--cluster-dram", default="256GiB", help="per-host DRAM for KV")
    c.add_argument("--cluster-ssd", default="0", help="per-host SSD in the shared designs")
    c.add_argument("--shared", default="16TiB", help="shared tier capacity")
    c.add_argument("--loads", default="1,4,16,64", help="request-rate multipliers")
    c.add_argument("--designs", default="rdma-pool,cpu-dram-pool,cxl-shared,local-ssd")
    c.add_argument("--routing", default="affinity", choices=("affinity", "round-robin"))
    return p


def host_config(args: argparse.Namespace) -> HostConfig:
    return HostConfig(
        kv_bytes_per_token=args.kv_bytes_per_token or 131072,
        policy=args.policy,
        dram_bytes=parse_bytes(args.dram),
        ssd_bytes=parse_bytes(args.ssd),
        ssd_drives=args.ssd_drives,
        ssd_op=args.ssd_op,
        fdp=args.fdp,
        remote_bytes=parse_bytes(args.remote),
        remote_link=args.remote_link,
        compute=COMPUTE_PRESETS[args.compute],
        faults=FaultConfig(rate=args.fault_rate, seed=args.seed),
        tenants=args.tenants,
        tenant_groups=args.tenant_groups,
        tenant_shares=args.tenant_shares,
    )


def event_sources(specs: Sequence[str]) -> dict[str, Path]:
    """``[LABEL=]FILE`` arguments -> ``{"live:LABEL": FILE}`` (LABEL defaults to the
    file's name; a label given twice is refused)."""
    out: dict[str, Path] = {}
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep or not label or "/" in label:
            label, path = Path(spec).name, spec
        name = f"live:{label}"
        if not Path(path).is_file():
            raise InvalidArgument(f"--events {spec}: {path} is not a file")
        if name in out:
            raise InvalidArgument(f"--events: source {label!r} given twice; label them LABEL=FILE")
        out[name] = Path(path)
    return out


def live_lifecycle(specs: Sequence[str]) -> dict[str, Any]:
    """The lifecycle analysis of each live event log (classes: the namespace), by source
    name (:func:`event_sources`)."""
    from kvlife.core.events import LifecycleEvent
    from kvlife.reporting.lifecycle import LifecycleAnalysis
    from kvlife.trace.events_io import read_events

    def classify(_key: str, e: LifecycleEvent) -> str:
        return e.namespace or "default"

    out: dict[str, Any] = {}
    for name, path in event_sources(specs).items():
        a = LifecycleAnalysis(classify).add_all(read_events(path))
        out[name] = (a.result(), a.samples())
    return out


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    event_sources(args.events)  # a bad --events fails now, not after the replay
    trace = read_trace(args.trace, args.format, args.max_requests)
    report: dict[str, Any] = {
        "kind": "kvlife.report",
        "version": 1,
        "command": ["kvlife", "report", *argv],
    }
    lifecycles: dict[str, Any] = {}
    samples: dict[str, Any] = {}
    if args.cluster:
        from kvlife.reporting.cluster import ClusterConfig, run_cluster

        cfg = ClusterConfig(
            hosts=args.cluster,
            kv_bytes_per_token=args.kv_bytes_per_token or 327680,
            dram_bytes=parse_bytes(args.cluster_dram),
            ssd_bytes=parse_bytes(args.cluster_ssd),
            shared_bytes=parse_bytes(args.shared),
            policy=args.policy,
            loads=tuple(float(x) for x in args.loads.split(",") if x),
            designs=tuple(x for x in args.designs.split(",") if x),
            routing=args.routing,
        )
        report["cluster"] = run_cluster(trace, cfg)
    else:
        from kvlife.reporting.host import run_host

        host = run_host(trace, host_config(args))
        lc = host.pop("lifecycle")
        lifecycles["replay"] = lc["replay"]
        report["lifecycle_trace"] = lc["trace"]
        samples["replay"] = host.pop("_lifespans")
        report["host"] = host
    for name, (res, smp) in live_lifecycle(args.events).items():
        lifecycles[name] = res
        samples[name] = smp
    report["lifecycle"] = lifecycles
    report["_lifespans"] = samples
    return report


def main(argv: Sequence[str] | None = None) -> int:
    from kvlife.reporting.html import text, to_json, write_html

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    report = run(args, argv)
    print(text(report))
    if args.json:
        Path(args.json).write_text(to_json(report), encoding="utf-8")
    if args.html:
        write_html(args.html, report)
    return 0

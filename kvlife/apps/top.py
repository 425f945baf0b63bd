"""``kvlife top --socket S``: a live terminal view of a running ``kvlife serve`` (needs
the ``ops`` extra: rich).

Each frame asks the server one ``stats`` request (:meth:`RemoteStore.server_stats`:
tiers, counters, sessions, leases, latency histograms, the lifecycle events since the
last frame; no audit, no pass over the index, so asking every second costs the server
little) and draws: the tiers (used of budget, chunks served, misses, load bandwidth,
evictions), the hit ratio of lookups, the requests (count, rate, latency percentiles over
the last frame's interval, interpolated in the histogram's buckets as Prometheus'
``histogram_quantile`` does) and the recent lifecycle events. Rates and percentiles need
two frames: the first shows ``-``. ``--once`` prints one frame and exits.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kvlife.client.remote import RemoteStore
from kvlife.core.errors import StoreUnavailable
from kvlife.ops.live import quantile

REQUESTS = (
    ("lookup", "lookup"),
    ("load", "load"),
    ("store_prepare", "put: prepare"),
    ("store_commit", "put: commit"),
)
"""The histograms of :data:`kvlife.ops.live.TIMED_VERBS`, in the order drawn."""


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f} ms"


@dataclass
class TopView:
    """Frames of one live view: keeps the previous ``stats`` (for rates and interval
    percentiles) and the recent events."""

    socket: str
    keep_events: int = 12
    prev: dict[str, Any] | None = None
    events: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=12))

    @property
    def since(self) -> int:
        """The last event sequence number drawn (the next request asks for later ones)."""
        return int(self.events[-1]["seq"]) if self.events else 0

    def frame(self, stats: dict[str, Any]) -> Group:
        """The frame of ``stats``; remembered as the previous one."""
        for e in stats["events"]:
            self.events.append(e)
        prev, self.prev = self.prev, stats
        dt = stats["time"] - prev["time"] if prev is not None else 0.0
        c = stats["counters"]
        old = prev["counters"] if prev is not None else None
        return Group(
            self._header(stats, c),
            self._tiers(stats, c, old, dt),
            self._requests(stats, prev, dt),
            self._events(stats["time"]),
        )

    def _header(self, stats: dict[str, Any], c: dict[str, int]) -> Text:
        hit, miss = c["lookup_chunks_hit"], c["lookup_chunks_miss"]
        ratio = f"{hit / (hit + miss):.1%}" if hit + miss else "-"
        leases = stats["leases"]
        line = (
            f"kvlife top  {self.socket}  sessions {stats['sessions']}  "
            f"leases: load {leases['load']} put {leases['put']}\n"
            f"hit ratio {ratio}  (chunks hit {hit}, missed {miss})\n"
            f"puts {c['puts']}  chunks stored {c['chunks_stored']}  loads {c['loads']}  "
            f"corrupt {c['corrupt']}  read errors {c['read_errors']}  "
            f"demotion failures {c['demote_failed']}"
        )
        return Text(line, style="bold")

    def _tiers(
        self, stats: dict[str, Any], c: dict[str, int], old: dict[str, int] | None, dt: float
    ) -> Table:
        table = Table(title="tiers", title_justify="left", expand=False)
        for col in ("tier", "used", "budget", "use", "served", "misses", "load bw", "evictions"):
            table.add_column(col, justify="left" if col == "tier" else "right")
        names = [t["name"] for t in stats["tiers"]]
        below = c["lookup_chunks_miss"]
        misses: dict[str, int] = {}
        for name in reversed(names):  # a tier misses what a slower tier served, or none
            misses[name] = below
            below += c.get(f"tier.{name}.loaded", 0)
        for t in stats["tiers"]:
            name = t["name"]
            bw = "-"
            key = f"tier.{name}.bytes_loaded"
            if old is not None and dt > 0:
                bw = _bytes((c.get(key, 0) - old.get(key, 0)) / dt) + "/s"
            cap = t["capacity_bytes"]
            table.add_row(
                name,
                _bytes(t["used_bytes"]),
                _bytes(cap),
                f"{t['used_bytes'] / cap:.0%}" if cap else "-",
                str(c.get(f"tier.{name}.loaded", 0)),
                str(misses[name]),
                bw,
                str(c.get(f"tier.{name}.evictions", 0)),
            )
        return table

    def _requests(self, stats: dict[str, Any], prev: dict[str, Any] | None, dt: float) -> Table:
        span = f"the last {dt:.1f} s" if prev is not None else "since the server started"
        table = Table(title=f"requests (latency over {span})", title_justify="left")
        for col in ("request", "count", "rate", "p50", "p90", "p99"):
            table.add_column(col, justify="left" if col == "request" else "right")
        for name, title in REQUESTS:
            now = stats["latency"][name]
            counts = now["counts"]
            rate = "-"
            if prev is not None:
                before = prev["latency"][name]["counts"]
                counts = [a - b for a, b in zip(counts, before, strict=True)]
                if dt > 0:
                    rate = f"{sum(counts) / dt:.1f}/s"
            table.add_row(
                title,
                str(now["count"]),
                rate,
                *(_ms(quantile(q, counts)) for q in (0.5, 0.9, 0.99)),
            )
        return table

    def _events(self, now: float) -> Table:
        table = Table(title="recent lifecycle events", title_justify="left")
        for col in ("seq", "age", "move", "state", "tier", "key", "reason"):
            table.add_column(col)
        for e in reversed(self.events):
            tier = e["tier"] + (f" -> {e['dst_tier']}" if e["dst_tier"] else "")
            table.add_row(
                str(e["seq"]),
                f"{max(0.0, now - e['time']):.1f}s",
                e["kind"],
                e["state"],
                tier,
                e["key"][:16],
                e["reason"][:40],
            )
        return table


def run_top(socket: str, *, interval: float = 1.0, once: bool = False) -> int:
    """Draw the server on ``socket`` every ``interval`` seconds until interrupted (or one
    frame with ``once``); 1 if the server cannot be reached or goes away (said on
    stderr)."""
    console = Console()
    try:
        store = RemoteStore(socket, timeout=10)
        stats = store.server_stats()
    except StoreUnavailable as exc:
        print(f"kvlife top: no server on {socket}: {exc}", file=sys.stderr)
        return 1
    view = TopView(socket)
    try:
        if once:
            console.print(view.frame(stats))
            return 0
        with Live(view.frame(stats), console=console, auto_refresh=False, screen=True) as live:
            while True:
                time.sleep(interval)
                try:
                    stats = store.server_stats(view.since)
                except StoreUnavailable as exc:
                    live.stop()
                    print(f"kvlife top: the server on {socket} went away: {exc}", file=sys.stderr)
                    return 1
                live.update(view.frame(stats), refresh=True)
    except KeyboardInterrupt:
        return 0
    finally:
        store.close()

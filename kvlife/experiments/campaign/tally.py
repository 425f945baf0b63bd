"""Per fault kind, what the campaign counted; and the campaign's JSON document.

One :class:`KindTally` per (system, deployment, fault kind). The figures the issue asks
for: injections, detections (the system noticed: a checksum mismatch, a typed error, a
torn frame dropped by recovery), wrong bytes served (must be 0), acknowledged data lost
silently (must be 0 on the durable tier: an acknowledged chunk gone with no counted,
explained event), recovery time, chunks recomputed (misses the workload filled by
recomputing). ``lost_explained`` counts chunks the fault destroyed and the system
reported (a flipped payload invalidated as corrupt, a lost write found at read).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from kvlife.experiments.campaign.oracle import Verdict

SCHEMA = "kvlife.experiments.campaign/1"


@dataclass(slots=True)
class KindTally:
    """The counts of one fault kind in one deployment of one system."""

    kind: str
    deployment: str
    """``embedded``, ``serve``, ``redis``, ``mooncake``, ``lmcache-disk``, ``lmcache-mp``."""
    system: str = "kvlife"
    injections: int = 0
    sigkills: int = 0
    """Injections that were a SIGKILL of a real process."""
    detections: int = 0
    served_chunks: int = 0
    wrong_chunks: int = 0
    wrong_bytes: int = 0
    stale_served: int = 0
    """Chunks served that an acknowledged invalidation or abort had removed (a retired
    model's KV, a rejected draft's KV): wrong for the request even if the bytes match
    their own key."""
    acked_lost: int = 0
    """Acknowledged chunks gone without a counted, explained event (must be 0)."""
    lost_explained: int = 0
    recomputed: int = 0
    typed_errors: int = 0
    """Calls that failed with a typed kvlife error (ENOSPC, EIO ...) as the fault
    demanded, nothing of them visible."""
    recovery_s: list[float] = field(default_factory=list)
    """Time from the fault's end to a store serving again (reopen, restart, heal)."""
    notes: list[str] = field(default_factory=list)

    def served(self, v: Verdict) -> None:
        self.served_chunks += v.served
        self.wrong_chunks += v.wrong_chunks
        self.wrong_bytes += v.wrong_bytes

    def note(self, text: str) -> None:
        if text not in self.notes and len(self.notes) < 20:
            self.notes.append(text)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        rec = d.pop("recovery_s")
        d["recovery_s"] = {
            "count": len(rec),
            "p50": statistics.median(rec) if rec else None,
            "max": max(rec) if rec else None,
            "mean": statistics.fmean(rec) if rec else None,
        }
        return d


@dataclass(slots=True)
class Campaign:
    """Every tally of one run, keyed by (system, deployment, kind)."""

    seed: int
    full: bool
    tallies: dict[tuple[str, str, str], KindTally] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    """Parts that did not run, each with why (a component missing on this machine)."""

    def tally(self, kind: str, deployment: str, system: str = "kvlife") -> KindTally:
        k = (system, deployment, kind)
        if k not in self.tallies:
            self.tallies[k] = KindTally(kind, deployment, system)
        return self.tallies[k]

    def add(self, t: KindTally) -> None:
        mine = self.tally(t.kind, t.deployment, t.system)
        for name in (
            "injections",
            "sigkills",
            "detections",
            "served_chunks",
            "wrong_chunks",
            "wrong_bytes",
            "stale_served",
            "acked_lost",
            "lost_explained",
            "recomputed",
            "typed_errors",
        ):
            setattr(mine, name, getattr(mine, name) + getattr(t, name))
        mine.recovery_s.extend(t.recovery_s)
        for n in t.notes:
            mine.note(n)

    def totals(self, system: str = "kvlife") -> dict[str, int]:
        rows = [t for t in self.tallies.values() if t.system == system]
        return {
            "kinds": len({t.kind for t in rows if t.injections}),
            "injections": sum(t.injections for t in rows),
            "sigkills": sum(t.sigkills for t in rows),
            "served_chunks": sum(t.served_chunks for t in rows),
            "wrong_bytes": sum(t.wrong_bytes for t in rows),
            "wrong_chunks": sum(t.wrong_chunks for t in rows),
            "stale_served": sum(t.stale_served for t in rows),
            "acked_lost": sum(t.acked_lost for t in rows),
        }

    def to_json(self, **meta: Any) -> dict[str, Any]:
        systems = sorted({t.system for t in self.tallies.values()})
        return {
            "schema": SCHEMA,
            "seed": self.seed,
            "full": self.full,
            **meta,
            "totals": {s: self.totals(s) for s in systems},
            "kinds": [t.to_json() for t in self.tallies.values()],
            "skipped": self.skipped,
        }

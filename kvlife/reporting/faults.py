"""Seeded, simulated faults of a report run and their counted outcomes.

The replay has no bytes, so a fault here is a decision: per block read from a tier,
with the configured probability, an I/O error (EIO), a bit flip (caught by the replica's
checksum, as the store verifies every load) or, for the remote tier, a time-out. The
store's rule is applied: *never serve wrong KV*; the usable prefix ends before the first
failed block, the rest is recomputed, and every fault is counted with its outcome.
Wrong bytes served is 0 by that rule; the live campaign (``kvlife experiment faults``)
is what tests that the store keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvlife.core.errors import InvalidArgument

KINDS = ("eio_read", "bitflip", "remote_timeout")


@dataclass(frozen=True, slots=True)
class FaultConfig:
    """Fault rates per block read (0: no faults)."""

    rate: float = 0.0
    """Probability that a block read from the SSD or the remote tier fails (split evenly
    between EIO and a bit flip; remote reads fail as time-outs)."""
    remote_timeout_s: float = 0.05
    """Time a remote fetch waits before it is given up."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise InvalidArgument(f"fault rate must be in [0, 1], got {self.rate}")
        if self.remote_timeout_s < 0:
            raise InvalidArgument("remote_timeout_s must be >= 0")


@dataclass(slots=True)
class FaultOutcomes:
    """Per fault kind: injected, detected, blocks recomputed, wrong blocks served."""

    injected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    detected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    recomputed_blocks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    wrong_blocks_served: int = 0
    requests_hit: int = 0

    def figures(self) -> dict[str, object]:
        return {
            "injected": self.injected,
            "detected": self.detected,
            "recomputed_blocks": self.recomputed_blocks,
            "wrong_blocks_served": self.wrong_blocks_served,
            "requests_affected": self.requests_hit,
        }


class FaultInjector:
    """Cuts a request's served prefix at the first faulty block."""

    def __init__(self, cfg: FaultConfig) -> None:
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)
        self.out = FaultOutcomes()

    def cut(self, local: int, ssd_from: int, remote: int) -> tuple[int, int, str]:
        """Of a prefix of ``local`` blocks (SSD reads from position ``ssd_from``) and
        ``remote`` remote blocks after it: how many local and remote blocks survive, and
        the fault kind that cut it ('' if none)."""
        rate = self.cfg.rate
        if rate <= 0.0:
            return local, remote, ""
        n_ssd = local - ssd_from
        n = n_ssd + remote
        if n <= 0:
            return local, remote, ""
        fails = self.rng.random(n) < rate
        if not fails.any():
            return local, remote, ""
        first = int(np.argmax(fails))
        if first < n_ssd:
            kind = "eio_read" if self.rng.random() < 0.5 else "bitflip"
            keep_local, keep_remote = ssd_from + first, 0
        else:
            kind = "remote_timeout"
            keep_local, keep_remote = local, first - n_ssd
        self.out.injected[kind] += 1
        self.out.detected[kind] += 1  # every kind is detected: EIO, checksum, time-out
        self.out.recomputed_blocks[kind] += (local - keep_local) + (remote - keep_remote)
        self.out.requests_hit += 1
        return keep_local, keep_remote, kind

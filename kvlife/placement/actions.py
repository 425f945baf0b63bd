"""The actions a placement plan is made of.

Actions are emitted in an order in which executing them is always safe (a copy comes
before the eviction of its source, an eviction before the placement that needs its room). The live
store executes actions with real I/O, the replay simulator by counting on its clock.
Keys are opaque to placement (chunk keys in the store, block ids in the simulator).
Actions are named tuples: immutable, and cheap enough for a simulator that makes
millions of them.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import NamedTuple

from kvlife.core.objects import TierName


class Place(NamedTuple):
    """Write a new object's first replica into ``tier``."""

    key: Hashable
    tier: TierName


class Copy(NamedTuple):
    """Copy a replica from ``src`` to ``dst`` (``reason``: demote, promote, write-through,
    flush). The source replica stays unless an :class:`Evict` follows."""

    key: Hashable
    src: TierName
    dst: TierName
    reason: str


class Evict(NamedTuple):
    """Drop the replica in ``tier`` to make room."""

    key: Hashable
    tier: TierName


class Drop(NamedTuple):
    """The object lost its last replica: invalidate and delete it (``reason`` says why)."""

    key: Hashable
    reason: str


class Reject(NamedTuple):
    """A new object fits in no tier: it is not stored (aborted, counted)."""

    key: Hashable
    reason: str


Action = Place | Copy | Evict | Drop | Reject


@dataclass(slots=True)
class Plan:
    """What a planning call decided: the actions themselves were handed to the
    residency one by one as they were taken (the store binds them to its records, the
    simulator executes them at once), so a plan keeps only their count."""

    size: int = 0
    """Actions emitted."""
    complete: bool = True
    """False when the room asked for could not be made (e.g. a flush the disk cannot hold)."""

    def __bool__(self) -> bool:
        return self.size > 0

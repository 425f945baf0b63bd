"""The actions a placement plan is made of.

A plan is an ordered list: executing it in order is always safe (a copy comes before the
eviction of its source, an eviction before the placement that needs its room). The live
store executes actions with real I/O, the replay simulator by counting on its clock.
Keys are opaque to placement (chunk keys in the store, block ids in the simulator).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from kvlife.core.objects import TierName


@dataclass(frozen=True, slots=True)
class Place:
    """Write a new object's first replica into ``tier``."""

    key: Hashable
    tier: TierName


@dataclass(frozen=True, slots=True)
class Copy:
    """Copy a replica from ``src`` to ``dst`` (``reason``: demote, promote, write-through,
    flush). The source replica stays unless an :class:`Evict` follows."""

    key: Hashable
    src: TierName
    dst: TierName
    reason: str


@dataclass(frozen=True, slots=True)
class Evict:
    """Drop the replica in ``tier`` to make room."""

    key: Hashable
    tier: TierName


@dataclass(frozen=True, slots=True)
class Drop:
    """The object lost its last replica: invalidate and delete it (``reason`` says why)."""

    key: Hashable
    reason: str


@dataclass(frozen=True, slots=True)
class Reject:
    """A new object fits in no tier: it is not stored (aborted, counted)."""

    key: Hashable
    reason: str


Action = Place | Copy | Evict | Drop | Reject


@dataclass(slots=True)
class Plan:
    """Actions in execution order, plus whether the request was met in full."""

    actions: list[Action] = field(default_factory=list)
    complete: bool = True
    """False when the room asked for could not be made (e.g. a flush the disk cannot hold)."""

    def __bool__(self) -> bool:
        return bool(self.actions)

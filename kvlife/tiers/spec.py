"""TierSpec: one tier of a store's chain, by kind, name, budget and the kind's options.

It lives with the tiers, below the store: the tier registry (:mod:`kvlife.tiers.registry`)
turns a spec into a tier, and the store's config (:mod:`kvlife.store.config`) holds a
chain of them. A spec is checked as it is made: its kind must be registered and its
options must be the kind's (:mod:`kvlife.tiers.kinds`), so a bad chain is refused before
a store opens anything.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvlife.core.errors import InvalidArgument
from kvlife.core.objects import TierName
from kvlife.tiers.options import TierOptions
from kvlife.tiers.registry import tier_kind

TIER_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}")
"""What a tier's name may be (it names a folder of the store and a metrics label)."""
TIER_NAME_RULE = "a tier name is 1 to 64 letters, digits, '_', '-' or '.' (not first)"


@dataclass(frozen=True, slots=True)
class TierSpec:
    """One tier of the chain."""

    kind: str
    """Registered tier kind (``memory``, ``shm``, ``disk``, ``redis``, ``mooncake``)."""
    name: str
    """Name of the tier in counters, events and lookups (unique in the chain)."""
    capacity_bytes: int
    """Budget of the tier (the disk tier's includes garbage awaiting reclaim)."""
    policy: str = "lru"
    """Eviction policy by registered name."""
    options: TierOptions | Sequence[tuple[str, object]] = field(default=(), compare=False)
    """The kind's options: its typed options class (``DiskOptions(segment_bytes=...)``,
    :mod:`kvlife.tiers.kinds`) or ``(name, value)`` pairs of its fields. An unknown name,
    a missing or mistyped value is a TierOptionError naming the tier and the option."""
    transform: str = ""
    """Registered transform exact replicas are encoded with when written here (a put
    placed here, a demotion, a flush): e.g. ``int4``; empty: store replicas as given."""
    transform_params: tuple[tuple[str, int | float | bool | str], ...] = ()
    """Parameters of ``transform`` (name/value pairs; defaults for those not given)."""
    config: TierOptions = field(init=False)
    """``options`` as the kind's typed options class, checked (what the registry builds
    the tier with; specs compare by it, whichever form the options were given in)."""

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise InvalidArgument(f"tier name must be a non-empty string, got {self.name!r}")
        if not TIER_NAME.fullmatch(self.name):
            # a disk tier's files live in a folder of the store named after it: a name
            # that is a path (``../x``, ``/x``) would put them outside the store
            raise InvalidArgument(f"tier name {self.name!r:.80}: {TIER_NAME_RULE}")
        if not isinstance(self.capacity_bytes, int) or self.capacity_bytes <= 0:
            raise InvalidArgument(
                f"tier {self.name!r} needs capacity_bytes > 0, got {self.capacity_bytes!r}"
            )
        if not isinstance(self.transform, str):
            raise InvalidArgument(
                f"tier {self.name!r}: transform must be a name, got {self.transform!r}"
            )
        if self.transform_params and not self.transform:
            raise InvalidArgument(f"tier {self.name!r}: transform_params without a transform")
        if not isinstance(self.kind, str):
            raise InvalidArgument(f"tier {self.name!r}: kind must be a name, got {self.kind!r}")
        object.__setattr__(self, "config", tier_kind(self.kind).options_of(self.name, self.options))

    @property
    def tier_name(self) -> TierName:
        return TierName(self.name)

"""TierSpec: one tier of a store's chain, by kind, name and budget.

It lives with the tiers, below the store: the tier registry (:mod:`kvlife.tiers.registry`)
turns a spec into a tier, and the store's config (:mod:`kvlife.store.config`) holds a
chain of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlife.core.errors import InvalidArgument
from kvlife.core.objects import TierName


@dataclass(frozen=True, slots=True)
class TierSpec:
    """One tier of the chain."""

    kind: str
    """Registered tier kind (``memory``, ``disk``)."""
    name: str
    """Name of the tier in counters, events and lookups (unique in the chain)."""
    capacity_bytes: int
    """Budget of the tier (the disk tier's includes garbage awaiting reclaim)."""
    policy: str = "lru"
    """Eviction policy by registered name."""
    options: tuple[tuple[str, object], ...] = ()
    """Kind-specific settings (e.g. ``segment_bytes`` of a disk tier), as name/value pairs."""
    transform: str = ""
    """Registered transform exact replicas are encoded with when written here (a put
    placed here, a demotion, a flush): e.g. ``int4``; empty: store replicas as given."""
    transform_params: tuple[tuple[str, int | float | bool | str], ...] = ()
    """Parameters of ``transform`` (name/value pairs; defaults for those not given)."""

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise InvalidArgument(f"tier name must be a non-empty string, got {self.name!r}")
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

    @property
    def tier_name(self) -> TierName:
        return TierName(self.name)

    def option(self, name: str, default: object) -> object:
        return dict(self.options).get(name, default)

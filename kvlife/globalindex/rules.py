"""Global invalidation rules: by namespace, adapter, weights digest and key prefix
(criteria intersect), each recorded in the index under a fresh epoch."""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from kvlife.core.errors import InvalidArgument
from kvlife.core.identity import ChunkKey, Namespace
from kvlife.core.objects import ObjectInfo

_RULE_VERSION = 1


@dataclass(frozen=True, slots=True)
class InvalidationRule:
    """One invalidation: objects published before ``epoch`` that match every given
    criterion are never served again by any host."""

    epoch: int
    """Index epoch the rule was recorded under (objects with a lower epoch are hit)."""
    namespace: str | None = None
    """``str(Namespace)`` of a tenant's erasure request."""
    adapter_id: str | None = None
    """A revoked adapter."""
    weights_digest: str | None = None
    """A retired model version."""
    prefix: bytes | None = None
    """A chunk key: that chunk and every chunk chained after it."""
    reason: str = ""

    def __post_init__(self) -> None:
        if self.epoch < 1:
            raise InvalidArgument(f"rule epoch must be >= 1, got {self.epoch}")
        if (
            self.namespace is None
            and self.adapter_id is None
            and self.weights_digest is None
            and self.prefix is None
        ):
            raise InvalidArgument("an invalidation rule needs at least one criterion")
        if self.prefix is not None and len(self.prefix) != 32:
            raise InvalidArgument(f"prefix must be a 32-byte chunk key, got {len(self.prefix)}")

    def matches(self, key: bytes, info: ObjectInfo, lineage: tuple[bytes, ...] = ()) -> bool:
        """Whether the rule covers an object (``lineage``: keys of the chunks before it
        in the run being looked up, for the prefix criterion)."""
        if self.namespace is not None and info.namespace != self.namespace:
            return False
        if self.adapter_id is not None and info.adapter_id != self.adapter_id:
            return False
        if self.weights_digest is not None and info.weights_digest != self.weights_digest:
            return False
        if self.prefix is not None:
            p = self.prefix
            if key != p and bytes(info.parent) != p and p not in lineage:
                return False
        return True

    def criteria(self) -> dict[str, object]:
        """The criteria as keyword arguments of the store's local ``invalidate``."""
        return {
            "namespace": Namespace.parse(self.namespace) if self.namespace is not None else None,
            "adapter_id": self.adapter_id,
            "weights_digest": self.weights_digest,
            "prefix": ChunkKey(self.prefix) if self.prefix is not None else None,
        }

    def encode(self) -> bytes:
        return bytes(
            msgpack.packb(
                [
                    _RULE_VERSION,
                    self.epoch,
                    self.namespace,
                    self.adapter_id,
                    self.weights_digest,
                    self.prefix,
                    self.reason,
                ]
            )
        )

    @classmethod
    def decode(cls, data: bytes) -> InvalidationRule:
        try:
            v = msgpack.unpackb(data)
            if not isinstance(v, list) or len(v) != 7 or v[0] != _RULE_VERSION:
                raise ValueError("unknown rule encoding")
            return cls(v[1], v[2], v[3], v[4], v[5], v[6])
        except (ValueError, TypeError, IndexError, msgpack.UnpackException) as exc:
            raise InvalidArgument(f"undecodable invalidation rule: {exc}") from exc

"""Logical KV objects: what the store knows about each chunk besides its bytes."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack

from kvlife.core.errors import InvalidArgument
from kvlife.core.identity import ChunkKey, ModelIdentity, Namespace
from kvlife.core.lifecycle import ObjectState

_INFO_VERSION = 1


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """Identity fields of one object, persisted with every durable replica so that a
    restarted store can invalidate by model version, adapter or namespace."""

    identity_digest: bytes
    """Digest of the model identity the KV was computed with."""
    weights_digest: str
    """Model version."""
    adapter_id: str
    """Adapter name, empty for none."""
    namespace: str
    """Namespace, as ``str(Namespace)``."""
    parent: ChunkKey
    """Key of the preceding chunk (zeros for the first)."""
    start: int
    """Absolute position of the chunk's first token."""
    ntokens: int
    """Tokens in the chunk."""
    model_id: str = ""
    """Model name, for reports."""

    def encode(self) -> bytes:
        return bytes(
            msgpack.packb(
                [
                    _INFO_VERSION,
                    self.identity_digest,
                    self.weights_digest,
                    self.adapter_id,
                    self.namespace,
                    bytes(self.parent),
                    self.start,
                    self.ntokens,
                    self.model_id,
                ]
            )
        )

    @classmethod
    def decode(cls, data: bytes) -> ObjectInfo:
        try:
            v = msgpack.unpackb(data)
            if not isinstance(v, list) or v[0] != _INFO_VERSION:
                raise ValueError(f"unknown object-info version {v[0] if v else None!r}")
            return cls(v[1], v[2], v[3], v[4], ChunkKey(v[5]), v[6], v[7], v[8])
        except (ValueError, TypeError, IndexError, msgpack.UnpackException) as exc:
            raise InvalidArgument(f"undecodable object info: {exc}") from exc

    @classmethod
    def for_chunk(
        cls,
        identity: ModelIdentity,
        namespace: Namespace,
        parent: ChunkKey,
        start: int,
    ) -> ObjectInfo:
        return cls(
            identity.digest,
            identity.weights_digest,
            identity.adapter_id,
            str(namespace),
            parent,
            start,
            identity.layout.tokens_per_chunk,
            identity.model_id,
        )


@dataclass(slots=True)
class ObjectRecord:
    """One logical object in the store's index (hot metadata: slots, no frozen copy)."""

    key: ChunkKey
    info: ObjectInfo
    dtype: str
    """numpy dtype of the exact replica."""
    shape: tuple[int, ...]
    nbytes: int
    state: ObjectState | None = None
    """None until the PUT (or RECOVER) move is applied."""
    tiers: set[str] = field(default_factory=set)
    """Tiers holding a sealed replica."""

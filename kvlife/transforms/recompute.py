"""Recompute-only records: a prefix existed, and what recomputing its KV would cost.

Not a :class:`~kvlife.transforms.base.Transform`: there is no payload to decode into a
buffer, so it does not belong in the round-trip registry. A record is small, versioned and
verified like a transform descriptor (msgpack body plus xxh3-64), so a later
load-vs-recompute planner can keep one where no KV replica is kept. Recomputed KV is
exact up to the engine's own nondeterminism.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import msgpack
import xxhash

from kvlife.core.errors import InvalidArgument
from kvlife.transforms.base import TransformError, UnknownTransform

RECOMPUTE_VERSION = 1
"""Version of the record format."""
_MAGIC = b"KVRC"
_HEAD = struct.Struct("<4sQ")  # magic, xxh3-64 of the msgpack body


def prefill_flops(n_params: int, tokens: int) -> float:
    """The usual 2·params·tokens estimate of a prefill (attention's quadratic term ignored)."""
    if n_params < 0 or tokens < 0:
        raise InvalidArgument(f"prefill_flops wants non-negative counts, got {n_params}, {tokens}")
    return 2.0 * n_params * tokens


@dataclass(frozen=True)
class RecomputeRecord:
    """What is known about a prefix whose KV is not stored."""

    start_token: int
    """Absolute position of the first token the record covers."""
    tokens: int
    """Number of tokens to recompute."""
    flops: float
    """Estimated floating-point operations of recomputing them (see :func:`prefill_flops`)."""
    est_seconds: float
    """Estimated wall time of recomputing them on the engine that wrote the record."""

    def __post_init__(self) -> None:
        if self.start_token < 0 or self.tokens < 0:
            raise InvalidArgument(f"RecomputeRecord token counts must be >= 0: {self}")
        if not (self.flops >= 0 and self.est_seconds >= 0):
            raise InvalidArgument(f"RecomputeRecord costs must be >= 0 and not NaN: {self}")

    def to_bytes(self) -> bytes:
        body: bytes = msgpack.packb(
            [
                "recompute",
                RECOMPUTE_VERSION,
                self.start_token,
                self.tokens,
                self.flops,
                self.est_seconds,
            ]
        )
        return _HEAD.pack(_MAGIC, xxhash.xxh3_64_intdigest(body)) + body

    @classmethod
    def from_bytes(cls, data: bytes) -> RecomputeRecord:
        """Parse and verify; damage is TransformError, an unknown version UnknownTransform."""
        if len(data) < _HEAD.size:
            raise TransformError(
                f"recompute record of {len(data)} bytes is shorter than its header"
            )
        magic, digest = _HEAD.unpack_from(data)
        body = data[_HEAD.size :]
        if magic != _MAGIC or xxhash.xxh3_64_intdigest(body) != digest:
            raise TransformError("recompute record does not match its magic or xxh3-64")
        try:
            obj = msgpack.unpackb(body)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError) as exc:  # pragma: no cover
            raise TransformError(f"recompute record is not valid msgpack: {exc}") from exc
        if not (isinstance(obj, list) and len(obj) == 6 and obj[0] == "recompute"):
            raise TransformError("recompute record is not a 6-field recompute list")
        if obj[1] != RECOMPUTE_VERSION:
            raise UnknownTransform(f"recompute record version {obj[1]!r} is not known")
        _, _, start, tokens, flops, seconds = obj
        if not (isinstance(start, int) and isinstance(tokens, int)):
            raise TransformError("recompute record token fields are not integers")
        if not (isinstance(flops, int | float) and isinstance(seconds, int | float)):
            raise TransformError("recompute record cost fields are not numbers")
        try:
            return cls(start, tokens, float(flops), float(seconds))
        except InvalidArgument as exc:
            raise TransformError(f"recompute record is inconsistent: {exc}") from exc

"""Representations in the store: encoding a replica for a tier that transforms, decoding
a framed replica into a caller's buffer, and what a hit will cost to decode.

A tier may be configured with a transform (``TierSpec(transform="int4", ...)``): exact
arrays written into it (a put placed there, a demotion, a flush) are encoded into the
transform's self-describing frame. A framed replica copied into a tier without a
transform (a promotion) is decoded there, and keeps its transform: a lossy replica
never becomes exact. A replica that already carries a transform is never re-encoded
(a frame goes as it is into another transforming tier).

Reading a framed replica verifies, before any codec sees it, that the frame's
descriptor is the one recorded with the replica, then decodes through the registry
(which checks name, version, shape, dtype, payload length and checksum). A transform
or version this reader does not know is :class:`UnknownTransform` (a miss, the replica
is kept); any other failure is a :class:`~kvlife.core.errors.CorruptFrame` (a
ChecksumMismatch: the replica is corrupt).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import numpy as np

from kvlife.core.errors import CorruptFrame, InvalidArgument, KVLifeError
from kvlife.core.objects import EXACT, ObjectRecord, Replica, Representation, TierName
from kvlife.tiers.base import ReplicaMeta, dtype_name
from kvlife.transforms.base import (
    EncodedPayload,
    Exactness,
    Transform,
    TransformDescriptor,
    TransformError,
    UnknownTransform,
)
from kvlife.transforms.contract import Contract, contract_of_replica
from kvlife.transforms.registry import decode as decode_payload
from kvlife.transforms.registry import make_transform

DECODE_SEED_BYTES_PER_S = 1.0e9
"""Decode speed assumed for a transform before this store has decoded any (the
bench's order of magnitude for the quantisers and zstd on this class of CPU)."""


def tier_transform(tier: str, name: str, params: tuple[tuple[str, object], ...]) -> Transform:
    """The transform a TierSpec names (InvalidArgument naming the tier if unusable)."""
    if name == "exact":
        raise InvalidArgument(
            f"tier {tier!r}: transform 'exact' is what a tier without a transform stores; "
            "leave transform empty"
        )
    try:
        return make_transform(name, dict(params))  # type: ignore[arg-type]
    except (UnknownTransform, KVLifeError) as exc:
        raise InvalidArgument(f"tier {tier!r}: transform {name!r}: {exc}") from exc


def representation_of(t: Transform, enc: EncodedPayload) -> Representation:
    d = enc.descriptor
    return Representation(t.name, t.version, d.params, True, d.to_bytes())


def contract_of(form: Representation) -> Contract:
    """The contract of a replica's representation (UnknownTransform if not known), its
    measured KL the figure for the replica's own chunk size."""
    return contract_of_replica(form.name, form.version, form.params, form.descriptor)


def meta_for(
    rec: ObjectRecord,
    array: np.ndarray,
    form: Representation,
    checksum: bytes = b"",
    links: tuple[tuple[bytes, bytes], ...] = (),
    verify: bool = False,
) -> ReplicaMeta:
    """What a tier records for a replica of ``rec`` held as ``array`` in ``form``;
    ``checksum``: the bytes' xxh3-128 where it is known (not hashed again; with
    ``verify`` checked as the tier hashes), ``links``: the prefix links an edge-keeping
    tier makes durable with it."""
    return ReplicaMeta(
        rec.key,
        dtype_name(array.dtype),
        array.shape,
        form.name,
        rec.info.encode(),
        checksum,
        form.encode(rec.dtype, rec.shape),
        verify,
        links,
        born=rec.born.encode(),
    )


def encoded_nbytes(
    t: Transform, shape: tuple[int, ...], dtype: str, start: int | None = None
) -> int:
    """Bytes a frame of ``t`` takes for an array (exact for fixed-rate transforms, the
    worst case for compressors), of a chunk starting at ``start`` (None: the worst case
    over positions: a quantiser's chunk at the sequence start also holds its sinks):
    what placement charges a transforming tier."""
    n = math.prod(shape)
    return math.ceil(t.bits_per_element(shape, np.dtype(dtype), start=start) * n / 8)


@dataclass(slots=True)
class Converted:
    array: np.ndarray
    form: Representation
    changed: str
    """``encode``/``decode`` when this copy changed the representation, else empty."""


def convert(
    rec: ObjectRecord,
    array: np.ndarray,
    src: Representation,
    dst: Transform | None,
    where: str,
) -> Converted:
    """The bytes and representation of a copy of ``array`` (in ``src``) for a tier that
    stores ``dst`` (None: as given). Raises CorruptFrame if a frame does not decode
    and UnknownTransform if its transform is not known here."""
    if dst is None:
        if not src.framed:
            return Converted(array, src, "")
        out = np.empty(rec.shape, np.dtype(rec.dtype))
        decode_frame_into(rec, array, src, out, where)
        return Converted(
            out, Representation(src.name, src.version, src.params, False, src.descriptor), "decode"
        )
    if not src.exact:
        return Converted(array, src, "")  # a transformed replica is never re-encoded
    try:
        # the chunk's absolute start: sinks belong to the sequence's first tokens
        enc = dst.encode(array, start=rec.info.start)
    except KVLifeError as exc:
        raise InvalidArgument(f"{dst.name} cannot encode {rec.key.hex()[:16]}…: {exc}") from exc
    frame = np.frombuffer(enc.to_frame(), dtype=np.uint8)
    return Converted(frame, representation_of(dst, enc), "encode")


def decode_frame_into(
    rec: ObjectRecord, frame: np.ndarray, form: Representation, out: np.ndarray, where: str
) -> None:
    """Verify a framed replica against its recorded descriptor and decode it into
    ``out`` (CorruptFrame for any damage, UnknownTransform for an unknown one)."""
    key = rec.key.hex()
    try:
        if frame.dtype != np.uint8 or frame.ndim != 1:
            raise TransformError(f"frame is {frame.dtype}{list(frame.shape)}, not 1-D uint8")
        enc = EncodedPayload.from_frame(frame.data)
        if enc.descriptor != TransformDescriptor.from_bytes(form.descriptor):
            raise TransformError("frame descriptor differs from the one recorded with the replica")
        d = enc.descriptor
        if d.name != form.name or d.version != form.version or d.params != form.params:
            raise TransformError("frame names another transform than its replica record")
        decode_payload(enc, out)
    except UnknownTransform:
        raise
    except (TransformError, KVLifeError, ValueError) as exc:
        raise CorruptFrame(key, where, f"transform frame: {exc}") from exc


def exactness_of(form: Representation) -> str:
    """Exactness class name of a representation ('unknown' if not known here)."""
    if form.exact:
        return Exactness.EXACT.value
    try:
        return contract_of(form).exactness.value
    except UnknownTransform:
        return "unknown"


class DecodeRates:
    """Decode speed per transform measured by this store's loads (an exponential
    average), seeded with :data:`DECODE_SEED_BYTES_PER_S`: what a hit's estimated
    decode time is computed from."""

    def __init__(self) -> None:
        self._rate: dict[str, float] = {}
        self._lock = threading.Lock()

    def estimate(self, name: str, nbytes: int) -> float:
        return nbytes / self._rate.get(name, DECODE_SEED_BYTES_PER_S)

    def record(self, name: str, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        with self._lock:
            old = self._rate.get(name)
            self._rate[name] = rate if old is None else 0.8 * old + 0.2 * rate


def decode_replica(
    rec: ObjectRecord,
    rep: Replica,
    frame: np.ndarray,
    out: np.ndarray | None,
    where: TierName,
    rates: DecodeRates,
) -> np.ndarray:
    """Decode a framed replica read from a tier into ``out`` (or a new array)."""
    dst = out if out is not None else np.empty(rec.shape, np.dtype(rec.dtype))
    if dst.shape != rec.shape or dst.dtype != np.dtype(rec.dtype):
        raise InvalidArgument(
            f"output buffer {dst.dtype}{list(dst.shape)} does not fit chunk "
            f"{rec.dtype}{list(rec.shape)}"
        )
    t0 = time.perf_counter()
    decode_frame_into(rec, frame, rep.transform, dst, where)
    rates.record(rep.transform.name, dst.nbytes, time.perf_counter() - t0)
    return dst


__all__ = [
    "EXACT",
    "Converted",
    "DecodeRates",
    "contract_of",
    "convert",
    "decode_frame_into",
    "decode_replica",
    "encoded_nbytes",
    "exactness_of",
    "meta_for",
    "tier_transform",
]

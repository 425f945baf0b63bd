"""The transform interface: one strategy object per stored representation of a KV chunk.

A transform turns a KV array into an :class:`EncodedPayload` (payload bytes plus a small,
versioned :class:`TransformDescriptor`) and decodes it back into a caller's buffer. Each
transform declares what it guarantees (:class:`Exactness`) and, when lossy, an
:class:`ErrorBound`, so the store can refuse a replica a lookup did not accept.

Every payload is verified on decode: the descriptor must name a transform and version the
reader knows (else :class:`UnknownTransform`, which the store treats as a miss), and the
payload's length and xxh3-64 must match the descriptor (else :class:`TransformError`), so a
damaged frame never reaches a codec or numpy as garbage.
"""

from __future__ import annotations

import enum
import struct
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Self

import msgpack
import numpy as np
import xxhash
from numpy.typing import NDArray

from kvlife.core.errors import InvalidArgument, KVLifeError, LayoutMismatch

Param = int | float | bool | str
"""A transform parameter value (msgpack-native, so descriptors stay language-neutral)."""

Params = tuple[tuple[str, Param], ...]
"""Parameters as sorted (name, value) pairs: hashable and with one canonical order."""

DESCRIPTOR_FORMAT = 1
"""Version of the descriptor encoding itself (not of any transform)."""

FRAME_MAGIC = b"KVTF"
_FRAME_HEADER = struct.Struct("<4sIQ")
"""Frame header: magic, descriptor length, xxh3-64 of the descriptor bytes."""


class TransformError(KVLifeError):
    """An encoded payload that cannot be decoded: damaged, truncated or inconsistent."""


class UnknownTransform(TransformError):
    """A descriptor names a transform or a version this reader does not know (a miss)."""


class Exactness(enum.Enum):
    """What a decoded replica guarantees about its values."""

    EXACT = "exact"
    """The payload is the array's bytes; decode is a copy."""
    LOSSLESS = "lossless"
    """Encoded differently (compressed) but decodes bit-exact."""
    LOSSY = "lossy"
    """Decodes within the transform's declared :class:`ErrorBound`."""
    SPARSE = "lossy-sparse"
    """Some tokens dropped (decoded as zeros, or left out of a compact buffer); the kept
    ones are bit-exact. Never satisfies an exact or lossless lookup."""


@dataclass(frozen=True)
class ErrorBound:
    """Declared worst case of a lossy transform, element by element.

    For an element ``x`` in quantisation group ``g`` (min ``lo``, max ``hi``), the decoded
    value ``y`` satisfies ``|x - y| <= range_factor * (hi - lo) + magnitude_factor *
    max(|lo|, |hi|) + absolute``. Elements kept in full precision (sinks, recent window)
    decode exactly. The range term is half a quantisation step; the magnitude and absolute
    terms cover rounding the group's scale and zero to the metadata dtype and rounding the
    result to the output dtype.
    """

    range_factor: float
    """Multiple of the group's range: 0.5 / (2**bits - 1), padded for scale rounding."""
    magnitude_factor: float
    """Multiple of the group's largest magnitude (metadata and output rounding)."""
    absolute: float
    """Absolute slack (subnormal scales near zero)."""

    def __post_init__(self) -> None:
        for field in ("range_factor", "magnitude_factor", "absolute"):
            value = getattr(self, field)
            if not (value >= 0 and np.isfinite(value)):
                raise InvalidArgument(f"ErrorBound.{field} must be finite and >= 0, got {value}")


def _check_param(key: object, value: object) -> Param:
    if not isinstance(key, str) or not key:
        raise TransformError(f"descriptor parameter name {key!r} is not a non-empty string")
    if not isinstance(value, int | float | bool | str):
        raise TransformError(f"descriptor parameter {key!r} has type {type(value).__name__}")
    return value


@dataclass(frozen=True)
class TransformDescriptor:
    """Everything a reader needs to decode a payload and to check it is the one written."""

    name: str
    """Registered transform name (``lossless``, ``int8``, ...)."""
    version: int
    """Version of that transform's payload format; a reader refuses versions it lacks."""
    dtype: str
    """numpy dtype name of the original array (``float16``, ``float32``, ``uint16``...)."""
    shape: tuple[int, ...]
    """Shape of the original array."""
    params: Params
    """The transform's parameters, sorted by name."""
    payload_nbytes: int
    """Exact length of the payload."""
    payload_xxh3: int
    """xxh3-64 of the payload, checked before any codec sees it."""

    def __post_init__(self) -> None:
        if not self.name:
            raise InvalidArgument("TransformDescriptor.name must not be empty")
        if self.version < 1:
            raise InvalidArgument(f"TransformDescriptor.version must be >= 1, got {self.version}")
        if any(d < 0 for d in self.shape):
            raise InvalidArgument(f"TransformDescriptor.shape has a negative extent: {self.shape}")
        keys = [k for k, _ in self.params]
        if keys != sorted(set(keys)):
            raise InvalidArgument(f"TransformDescriptor.params must be sorted and unique: {keys}")
        if self.payload_nbytes < 0 or not 0 <= self.payload_xxh3 < 1 << 64:
            raise InvalidArgument("TransformDescriptor payload length/checksum out of range")

    @property
    def param_map(self) -> dict[str, Param]:
        return dict(self.params)

    def to_bytes(self) -> bytes:
        """msgpack encoding: a list led by the descriptor format."""
        packed: bytes = msgpack.packb(
            [
                DESCRIPTOR_FORMAT,
                self.name,
                self.version,
                self.dtype,
                list(self.shape),
                [[k, v] for k, v in self.params],
                self.payload_nbytes,
                self.payload_xxh3,
            ],
            use_bin_type=True,
        )
        return packed

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> TransformDescriptor:
        """Parse and type-check; anything malformed is a :class:`TransformError`."""
        try:
            obj = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError) as exc:
            raise TransformError(f"transform descriptor is not valid msgpack: {exc}") from exc
        if not isinstance(obj, list) or len(obj) != 8:
            raise TransformError("transform descriptor is not an 8-field list")
        fmt, name, version, dtype, shape, params, nbytes, digest = obj
        if fmt != DESCRIPTOR_FORMAT:
            raise UnknownTransform(f"transform descriptor format {fmt!r} is not known")
        if not (isinstance(name, str) and isinstance(version, int) and isinstance(dtype, str)):
            raise TransformError("transform descriptor name/version/dtype have wrong types")
        if not (isinstance(shape, list) and all(isinstance(d, int) for d in shape)):
            raise TransformError("transform descriptor shape is not a list of integers")
        if not (
            isinstance(params, list) and all(isinstance(p, list) and len(p) == 2 for p in params)
        ):
            raise TransformError("transform descriptor params are not (name, value) pairs")
        if not (isinstance(nbytes, int) and isinstance(digest, int)):
            raise TransformError("transform descriptor payload length/checksum are not integers")
        pairs = tuple((str(k), _check_param(k, v)) for k, v in params)
        try:
            return cls(name, version, dtype, tuple(shape), pairs, nbytes, digest)
        except InvalidArgument as exc:
            raise TransformError(f"transform descriptor is inconsistent: {exc}") from exc


@dataclass(frozen=True)
class EncodedPayload:
    """An encoded chunk: the descriptor and the payload bytes it describes."""

    descriptor: TransformDescriptor
    """What wrote the payload and how to check it."""
    payload: bytes | NDArray[np.uint8]
    """The encoded bytes (a uint8 array when the encoder filled a buffer in place)."""

    def __post_init__(self) -> None:
        if isinstance(self.payload, np.ndarray) and (
            self.payload.dtype != np.uint8 or self.payload.ndim != 1
        ):
            raise InvalidArgument("EncodedPayload.payload must be bytes or a 1-D uint8 array")

    @property
    def nbytes(self) -> int:
        """Payload plus the serialised descriptor (what a tier stores)."""
        return len(self.payload) + len(self.descriptor.to_bytes()) + _FRAME_HEADER.size

    @property
    def bits_per_element(self) -> float:
        """Measured bits per original element, descriptor and frame header included."""
        n = int(np.prod(self.descriptor.shape))
        return 8.0 * self.nbytes / max(n, 1)

    def payload_view(self) -> NDArray[np.uint8]:
        """The payload as a uint8 array, without a copy."""
        if isinstance(self.payload, np.ndarray):
            return self.payload
        return np.frombuffer(self.payload, dtype=np.uint8)

    def verify(self) -> None:
        """Length and checksum of the payload against the descriptor (TransformError)."""
        d = self.descriptor
        if len(self.payload) != d.payload_nbytes:
            raise TransformError(
                f"{d.name} payload has {len(self.payload)} bytes, "
                f"descriptor says {d.payload_nbytes}"
            )
        if xxhash.xxh3_64_intdigest(self.payload_view().data) != d.payload_xxh3:
            raise TransformError(f"{d.name} payload does not match its descriptor's xxh3-64")

    def to_frame(self) -> bytes:
        """One self-describing byte string: magic, descriptor length, descriptor, payload."""
        desc = self.descriptor.to_bytes()
        head = _FRAME_HEADER.pack(FRAME_MAGIC, len(desc), xxhash.xxh3_64_intdigest(desc))
        return head + desc + self.payload_view().tobytes()

    @classmethod
    def from_frame(cls, frame: bytes | memoryview) -> EncodedPayload:
        """Split a frame (the payload is a view into ``frame``); a bad header is TransformError."""
        view = memoryview(frame)
        if len(view) < _FRAME_HEADER.size:
            raise TransformError(f"transform frame of {len(view)} bytes is shorter than its header")
        magic, dlen, digest = _FRAME_HEADER.unpack_from(view)
        if magic != FRAME_MAGIC:
            raise TransformError(f"transform frame magic {bytes(magic)!r} is not {FRAME_MAGIC!r}")
        end = _FRAME_HEADER.size + dlen
        if end > len(view):
            raise TransformError("transform frame is truncated inside its descriptor")
        raw = view[_FRAME_HEADER.size : end]
        # the descriptor has its own checksum: a flipped parameter could otherwise decode
        # "successfully" with other parameters
        if xxhash.xxh3_64_intdigest(raw) != digest:
            raise TransformError("transform frame descriptor does not match its xxh3-64")
        desc = TransformDescriptor.from_bytes(raw)
        payload = np.frombuffer(view, dtype=np.uint8, offset=end)
        return cls(desc, payload)


def _params_of(mapping: Mapping[str, Param]) -> Params:
    return tuple(sorted(mapping.items()))


class Transform(ABC):
    """One representation of a KV chunk: encode, verified decode, and its contract.

    Subclasses implement :meth:`_encode` and :meth:`_decode`; the base class builds and
    checks descriptors, payload checksums and the caller's output buffer, so every
    transform gets the same verification.
    """

    name: ClassVar[str]
    """Registered name, written into every descriptor."""
    version: ClassVar[int]
    """Payload format version this class writes; bump it when the payload layout or the
    meaning of a parameter changes (and keep reading the old one: :meth:`reads`)."""
    exactness: ClassVar[Exactness]
    """What decoding guarantees."""

    @classmethod
    def reads(cls, version: int) -> bool:
        """Whether this class decodes payloads of ``version`` (by default only the one it
        writes); any other is an :class:`UnknownTransform`, a miss."""
        return version == cls.version

    @property
    def error_bound(self) -> ErrorBound | None:
        """The declared bound of a lossy transform; None for exact and lossless ones."""
        return None

    def measured_kl_at(
        self, chunk_tokens: int | None = None, version: int | None = None
    ) -> float | None:
        """Mean KL of next-token distributions against exact KV, measured on the
        reference model with these parameters on chunks of ``chunk_tokens`` tokens
        (None: the worst over the chunk sizes measured), for payloads of ``version``
        (None: the one this class writes); docs/transforms.md. None where not measured:
        a lookup that bounds KL then refuses the replica."""
        return None

    @property
    def measured_kl(self) -> float | None:
        """:meth:`measured_kl_at` for an unknown chunk size (the worst measured)."""
        return self.measured_kl_at()

    @abstractmethod
    def params(self) -> Mapping[str, Param]:
        """This instance's parameters (recorded in the descriptor)."""

    @classmethod
    @abstractmethod
    def from_params(cls, params: Mapping[str, Param]) -> Self:
        """An instance from descriptor parameters; unknown or bad ones raise TransformError."""

    @abstractmethod
    def check_input(self, shape: tuple[int, ...], dtype: np.dtype[np.generic]) -> None:
        """Raise LayoutMismatch if this transform cannot encode arrays of this shape/dtype."""

    @abstractmethod
    def _encode(self, array: NDArray[np.generic]) -> bytes | NDArray[np.uint8]:
        """The payload of a C-contiguous, checked array."""

    @abstractmethod
    def _decode(
        self, payload: NDArray[np.uint8], desc: TransformDescriptor, out: NDArray[np.generic]
    ) -> None:
        """Fill ``out`` (checked shape/dtype) from a verified payload."""

    @abstractmethod
    def payload_nbytes(self, shape: tuple[int, ...], dtype: np.dtype[np.generic]) -> int:
        """Payload size for this shape (exact, or an upper bound for compressors); for a
        transform whose payload depends on the chunk's position, the largest over
        positions (see :meth:`payload_nbytes_at`)."""

    def payload_nbytes_at(
        self, shape: tuple[int, ...], dtype: np.dtype[np.generic], start: int
    ) -> int:
        """Payload size of a chunk whose first token is at absolute position ``start``
        (the same as :meth:`payload_nbytes` unless the payload depends on it)."""
        return self.payload_nbytes(shape, dtype)

    def bits_per_element(
        self,
        shape: tuple[int, ...],
        dtype: np.dtype[np.generic] | str,
        *,
        start: int | None = None,
    ) -> float:
        """Bits per element with all metadata (descriptor and frame header included), of
        a chunk starting at ``start`` (None: the worst case over positions).

        Exact for fixed-rate transforms; for compressors, the worst case (see the
        payload's measured :attr:`EncodedPayload.bits_per_element`).
        """
        dt = np.dtype(dtype)
        n = int(np.prod(shape))
        size = (
            self.payload_nbytes(tuple(shape), dt)
            if start is None
            else self.payload_nbytes_at(tuple(shape), dt, start)
        )
        desc = TransformDescriptor(
            self.name,
            self.version,
            dt.name,
            tuple(shape),
            _params_of(self.params()),
            size,
            (1 << 64) - 1,
        )
        total = size + len(desc.to_bytes()) + _FRAME_HEADER.size
        return 8.0 * total / max(n, 1)

    def element_bounds(self, array: NDArray[np.generic]) -> NDArray[np.float64] | None:
        """Per-element allowed absolute error of decoding ``array`` (None: bit-exact)."""
        return None

    def _encode_at(self, array: NDArray[np.generic], start: int) -> bytes | NDArray[np.uint8]:
        """The payload of a chunk whose first token is at absolute position ``start`` (a
        transform whose payload does not depend on the position ignores it)."""
        return self._encode(array)

    def encode(self, array: NDArray[np.generic], *, start: int = 0) -> EncodedPayload:
        """Encode ``array`` (copied to C order first if it is not already), a chunk whose
        first token is at absolute position ``start`` in its sequence (what a store
        knows of each chunk: the quantisers keep sink tokens only at the sequence start,
        and record in the frame what they kept)."""
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise InvalidArgument(f"{self.name}: start must be an int >= 0, got {start!r}")
        arr = np.ascontiguousarray(array)
        self.check_input(arr.shape, arr.dtype)
        payload = self._encode_at(arr, start)
        view = payload if isinstance(payload, np.ndarray) else np.frombuffer(payload, np.uint8)
        desc = TransformDescriptor(
            self.name,
            self.version,
            arr.dtype.name,
            arr.shape,
            _params_of(self.params()),
            len(payload),
            xxhash.xxh3_64_intdigest(view.data),
        )
        return EncodedPayload(desc, payload)

    def decode(self, encoded: EncodedPayload, out: NDArray[np.generic]) -> None:
        """Verify ``encoded`` and decode it into ``out`` (its shape and dtype must match)."""
        d = encoded.descriptor
        if d.name != self.name or not type(self).reads(d.version):
            raise UnknownTransform(
                f"payload of {d.name!r} v{d.version} given to {self.name!r} v{self.version}"
            )
        if d.params != _params_of(self.params()):
            raise TransformError(f"{self.name} payload params {d.params} differ from this instance")
        if tuple(out.shape) != d.shape or out.dtype.name != d.dtype:
            raise LayoutMismatch(
                f"{self.name} decodes {d.dtype}{list(d.shape)}, "
                f"the buffer is {out.dtype.name}{list(out.shape)}"
            )
        if not (out.flags.c_contiguous and out.flags.writeable):
            raise InvalidArgument(f"{self.name} decodes into a C-contiguous writable buffer only")
        encoded.verify()
        self._decode(encoded.payload_view(), d, out)

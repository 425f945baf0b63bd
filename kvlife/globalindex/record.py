"""The publication record of one remote object, stored beside (or, for Mooncake, in
place of a directory entry for) its payload.

It holds the disk tier's frame header (magic, version, key, payload length, xxh3-128 of
the payload, dtype, shape, transform, header checksum: :mod:`kvlife.tiers.disk.frame`),
the object info (identity digest, namespace, parent, start), who published it under
which fencing token, the index incarnation and epoch its KV was created under (the
object's :class:`~kvlife.core.objects.EpochStamp`, not the epoch at publication: KV
created before a rule and published after it is covered), and where the payload lies. The
whole record is msgpack with an xxh3-64 over it, so a flipped byte is caught before
any field is trusted.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import msgpack
import numpy as np
import xxhash

from kvlife.core.errors import InvalidArgument, StoreFormatError
from kvlife.core.objects import EpochStamp, ObjectInfo
from kvlife.tiers.base import ReplicaMeta
from kvlife.tiers.disk.frame import (
    FrameError,
    FrameHeader,
    header_used,
    parts_checksum,
    unpack_header,
)

_RECORD_VERSION = 3
"""3 added the index incarnation of the creation epoch; 2 the replica's representation
record (``form``; 1 is read as exact). Older records have an unknown incarnation: no
host adopts them."""
_CHECK = struct.Struct("<Q")


class RecordError(Exception):
    """A record or its payload does not verify (the message says which check failed)."""


@dataclass(frozen=True, slots=True)
class RemoteRecord:
    """What the index knows about one published remote object."""

    header: FrameHeader
    """The frame header: key, length, checksum, dtype, shape, transform."""
    info: bytes
    """Encoded :class:`~kvlife.core.objects.ObjectInfo` (full identity of the chunk)."""
    host: str
    """Publishing host."""
    token: int
    """Fencing token of the lease it was published under."""
    epoch: int
    """Index epoch the object's KV was created under: every later rule applies to it."""
    location: str = ""
    """Where the payload lies when not beside the record (a Mooncake object name)."""
    form: bytes = b""
    """The replica's representation record (:attr:`ReplicaMeta.form`; empty: exact)."""
    incarnation: str = ""
    """Index incarnation ``epoch`` counts in (empty: unknown)."""
    raw: bytes = field(default=b"", compare=False, repr=False)
    """The bytes it was decoded from (empty for a record built here)."""

    @property
    def born(self) -> EpochStamp:
        """The creation stamp (unknown for a record that names no incarnation)."""
        if not self.incarnation:
            return EpochStamp()
        return EpochStamp(self.incarnation, max(0, self.epoch))

    @classmethod
    def for_payload(
        cls,
        meta: ReplicaMeta,
        payload: np.ndarray,
        host: str,
        token: int,
        loc: str,
        checksum: bytes = b"",
    ) -> RemoteRecord:
        """The record of a new payload: its xxh3-128 is ``checksum`` where the writer
        knows it already (a copy of a verified replica), else hashed here."""
        header = FrameHeader(
            key=bytes(meta.key),
            payload_len=payload.nbytes,
            checksum=checksum or parts_checksum([payload]),
            dtype=meta.dtype,
            shape=tuple(meta.shape),
            transform=meta.transform,
        )
        born = EpochStamp.decode(meta.born)
        return cls(header, meta.info, host, token, born.epoch, loc, meta.form, born.incarnation)

    def object_info(self) -> ObjectInfo:
        return ObjectInfo.decode(self.info)

    def replica_meta(self) -> ReplicaMeta:
        h = self.header
        return ReplicaMeta(
            h.key,  # type: ignore[arg-type]
            h.dtype,
            h.shape,
            h.transform,
            self.info,
            h.checksum,
            self.form,
            born=self.born.encode(),
        )

    def blob(self) -> bytes:
        """The stored bytes: what it was read from, else its encoding (a delete compares
        them with the record stored now)."""
        return self.raw or self.encode()

    def encode(self) -> bytes:
        body = bytes(
            msgpack.packb(
                [
                    _RECORD_VERSION,
                    header_used(self.header),
                    self.info,
                    self.host,
                    self.token,
                    self.epoch,
                    self.location,
                    self.form,
                    self.incarnation,
                ]
            )
        )
        return body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))

    @classmethod
    def decode(cls, data: bytes) -> RemoteRecord:
        """Parse and check a record; RecordError on any damage."""
        if len(data) <= _CHECK.size:
            raise RecordError(f"record truncated to {len(data)} bytes")
        body, tail = data[: -_CHECK.size], data[-_CHECK.size :]
        if _CHECK.unpack(tail)[0] != xxhash.xxh3_64_intdigest(body):
            raise RecordError("record checksum mismatch")
        try:
            v = msgpack.unpackb(body)
            if not isinstance(v, list) or (v[0], len(v)) not in ((1, 7), (2, 8), (3, 9)):
                raise ValueError("unknown record version")
            header = unpack_header(v[1])
            form = bytes(v[7]) if len(v) >= 8 else b""
            inc = str(v[8]) if len(v) == 9 else ""
            return cls(
                header,
                bytes(v[2]),
                str(v[3]),
                int(v[4]),
                int(v[5]),
                str(v[6]),
                form,
                inc,
                bytes(data),
            )
        except (
            ValueError,
            TypeError,
            IndexError,
            FrameError,
            StoreFormatError,
            msgpack.UnpackException,
        ) as exc:
            raise RecordError(f"record undecodable: {exc}") from exc

    def verify(self, key: bytes, payload: memoryview | bytes) -> np.ndarray:
        """The payload as a read-only array if it is exactly this record's frame for
        ``key`` (length, xxh3-128, key), else RecordError. A short or empty payload (a
        holder that died) is an error here, never a short array."""
        h = self.header
        if h.key != key:
            raise RecordError("record names another key")
        if len(payload) != h.payload_len:
            raise RecordError(f"payload is {len(payload)} bytes, the frame says {h.payload_len}")
        try:
            arr = np.frombuffer(payload, dtype=np.dtype(h.dtype)).reshape(h.shape)
        except (TypeError, ValueError) as exc:
            raise RecordError(f"payload does not fit {h.dtype}{list(h.shape)}: {exc}") from exc
        if parts_checksum([arr]) != h.checksum:
            raise RecordError("payload checksum mismatch")
        return arr

    def check_meta(self, meta: ReplicaMeta) -> None:
        """InvalidArgument unless ``meta`` describes this record's object."""
        if not self.same_replica(meta):
            raise InvalidArgument("record does not match the replica meta")

    def same_replica(self, meta: ReplicaMeta) -> bool:
        """Whether this record describes the replica ``meta`` names: the same object
        info, representation, dtype and shape, and (where ``meta`` has one) the same
        payload checksum. A record published since by another host for the same key
        with other bytes (another form, an int8 frame) is not."""
        h = self.header
        return (h.dtype, tuple(h.shape), h.transform, self.info, self.form) == (
            meta.dtype,
            tuple(meta.shape),
            meta.transform,
            meta.info,
            meta.form,
        ) and (not meta.checksum or meta.checksum == h.checksum)

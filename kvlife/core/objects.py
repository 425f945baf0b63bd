"""Logical KV objects and their replicas: what the store knows about each chunk besides
its bytes, and the one address type of a prompt (:class:`PromptRef`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import NewType

import msgpack
import numpy as np

from kvlife.core.enums import IdentityHashedEnum
from kvlife.core.errors import InvalidArgument
from kvlife.core.identity import ROOT_PARENT, ChunkKey, ModelIdentity, Namespace, prompt_chunk_keys
from kvlife.core.lifecycle import ObjectState
from kvlife.core.sources import Source, SourceSpan, chunk_sources

TierName = NewType("TierName", str)
"""Name of one tier of a store's chain (``dram``, ``disk``, ...)."""

_INFO_VERSION = 1


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """Identity fields of one object, persisted with every durable replica so that a
    restarted store can invalidate by model version, adapter, namespace or upstream
    source."""

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
    """Model name (``ModelIdentity.model_id``): reports, and invalidation of a model's
    other weights versions."""
    sources: tuple[Source, ...] = ()
    """The upstream sources the chunk's KV depends on (sorted, no repeats): those of
    every span of its prompt that starts before the chunk's end. Hashed into its key."""

    def encode(self) -> bytes:
        fields: list[object] = [
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
        if self.sources:  # appended only when set: records without keep their bytes
            fields.append([[s.name, s.version] for s in self.sources])
        return bytes(msgpack.packb(fields))

    @classmethod
    def decode(cls, data: bytes) -> ObjectInfo:
        try:
            v = msgpack.unpackb(data)
            if not isinstance(v, list) or v[0] != _INFO_VERSION:
                raise ValueError(f"unknown object-info version {v[0] if v else None!r}")
            if len(v) not in (9, 10):
                raise ValueError(f"object info of {len(v)} fields")
            sources: tuple[Source, ...] = ()
            if len(v) == 10:
                if not isinstance(v[9], list) or not v[9]:
                    raise ValueError("object info sources must be a non-empty list")
                sources = tuple(Source(name, version) for name, version in v[9])
                if list(sources) != sorted(set(sources)):
                    raise ValueError("object info sources are not sorted and unique")
            return cls(v[1], v[2], v[3], v[4], ChunkKey(v[5]), v[6], v[7], v[8], sources)
        except (ValueError, TypeError, IndexError, msgpack.UnpackException) as exc:
            raise InvalidArgument(f"undecodable object info: {exc}") from exc

    @classmethod
    def for_chunk(
        cls,
        identity: ModelIdentity,
        namespace: Namespace,
        parent: ChunkKey,
        start: int,
        sources: tuple[Source, ...] = (),
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
            sources,
        )


_STAMP_VERSION = 1


@dataclass(frozen=True, slots=True)
class EpochStamp:
    """The global invalidation epoch an object's KV was created under: the index
    incarnation and epoch its host had read when the put was prepared. Every rule
    recorded before that read has an epoch at most ``epoch``; a rule of a higher epoch,
    or of another incarnation, may be newer than the KV and covers it. Persisted with
    every durable replica (catalog column, publication record), so that a restarted host
    applies a rule only to what it covers."""

    incarnation: str = ""
    """Id of the index incarnation (empty: unknown, i.e. created before this host read
    any index; every rule covers it)."""
    epoch: int = 0
    """Index epoch read when the KV was created."""

    def __post_init__(self) -> None:
        if not isinstance(self.incarnation, str) or type(self.epoch) is not int or self.epoch < 0:
            raise InvalidArgument(f"bad epoch stamp {self.incarnation!r}:{self.epoch!r}")
        if not self.incarnation and self.epoch:
            raise InvalidArgument("an epoch stamp without an incarnation has epoch 0")

    @property
    def known(self) -> bool:
        return bool(self.incarnation)

    def before(self, incarnation: str, epoch: int) -> bool:
        """Whether KV of this stamp may predate rule ``epoch`` of ``incarnation`` (so
        that rule covers it): unknown, another incarnation, or a lower epoch."""
        return self.incarnation != incarnation or self.epoch < epoch

    def encode(self) -> bytes:
        """The persisted form (empty for an unknown stamp)."""
        if not self.known:
            return b""
        return bytes(msgpack.packb([_STAMP_VERSION, self.incarnation, self.epoch]))

    @classmethod
    def decode(cls, data: bytes) -> EpochStamp:
        """Parse a persisted stamp (empty: unknown); InvalidArgument if damaged."""
        if not data:
            return UNSTAMPED
        try:
            v = msgpack.unpackb(data)
            if not isinstance(v, list) or len(v) != 3 or v[0] != _STAMP_VERSION:
                raise ValueError("unknown epoch stamp encoding")
            if not isinstance(v[1], str) or not v[1]:
                raise ValueError("epoch stamp without an incarnation")
            return cls(v[1], v[2])
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise InvalidArgument(f"undecodable epoch stamp: {exc}") from exc


UNSTAMPED = EpochStamp()
"""The stamp of KV created before its host read any index (every rule covers it)."""

_FORM_VERSION = 1

FormParam = int | float | bool | str
"""A transform parameter value (msgpack-native)."""


@dataclass(frozen=True, slots=True)
class Representation:
    """How one replica's bytes represent its object: which transform its values went
    through (name, version, parameters) and whether the bytes are still that transform's
    frame (decoded on load) or already decoded values. A lossy replica decoded into a
    faster tier keeps its transform: it is never taken for exact."""

    name: str = "exact"
    """Transform name (``exact`` for the engine's own bytes)."""
    version: int = 1
    """Version of that transform's format."""
    params: tuple[tuple[str, FormParam], ...] = ()
    """The transform's parameters, sorted by name."""
    framed: bool = False
    """The bytes are the transform's self-describing frame (dtype uint8, 1-D)."""
    descriptor: bytes = b""
    """The transform descriptor of the frame (kept after decoding, for provenance)."""

    @property
    def exact(self) -> bool:
        """The engine's own bytes, never transformed."""
        return self.name == "exact" and not self.framed

    def encode(self, dtype: str, shape: tuple[int, ...]) -> bytes:
        """The persisted record (empty for exact): it carries the object's dtype and
        shape, since a framed replica's own are those of its frame."""
        if self.exact:
            return b""
        return bytes(
            msgpack.packb(
                [
                    _FORM_VERSION,
                    self.name,
                    self.version,
                    [[k, v] for k, v in self.params],
                    self.framed,
                    dtype,
                    list(shape),
                    self.descriptor,
                ],
                use_bin_type=True,
            )
        )

    @classmethod
    def decode(cls, data: bytes) -> tuple[Representation, str | None, tuple[int, ...] | None]:
        """Parse a persisted record: the representation and the object's dtype and shape
        (None, None for the empty record of an exact replica). InvalidArgument if damaged
        or of an unknown record version."""
        if not data:
            return EXACT, None, None
        try:
            v = msgpack.unpackb(data, raw=False)
            if not isinstance(v, list) or not v or v[0] != _FORM_VERSION or len(v) != 8:
                raise ValueError(f"unknown representation record {v[0] if v else None!r}")
            _, name, version, params, framed, dtype, shape, desc = v
            if not (
                isinstance(name, str)
                and name
                and type(version) is int
                and isinstance(params, list)
                and all(
                    isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in params
                )
                and all(isinstance(p[1], int | float | bool | str) for p in params)
                and type(framed) is bool
                and isinstance(dtype, str)
                and isinstance(shape, list)
                and all(type(d) is int and d >= 0 for d in shape)
                and isinstance(desc, bytes)
            ):
                raise ValueError("representation record fields have wrong types")
            pairs = tuple((str(k), val) for k, val in params)
            if [k for k, _ in pairs] != sorted({k for k, _ in pairs}):
                raise ValueError("representation parameters are not sorted and unique")
            rep = cls(name, version, pairs, framed, desc)
            return rep, dtype, tuple(shape)
        except (ValueError, TypeError, IndexError, msgpack.UnpackException) as exc:
            raise InvalidArgument(f"undecodable representation record: {exc}") from exc


EXACT = Representation()
"""The engine's own bytes."""


class ReplicaState(IdentityHashedEnum):
    """Where one replica stands. Readers count separately (:attr:`Replica.pins`)."""

    WRITING = "writing"
    """Its bytes are on their way to the tier: counted against the tier, never read."""
    READY = "ready"
    """Sealed and readable."""
    EVICTING = "evicting"
    """Chosen for eviction by a plan that has not run yet: no longer counted, still read
    (its bytes stay until the plan's eviction step, which runs after the copy that
    demotes it is published: copy, then drop)."""
    LEAVING = "leaving"
    """Being deleted (its plan's eviction step runs, or its object was retired): no
    longer counted, never read."""


@dataclass(slots=True)
class Replica:
    """One copy of an object in one tier (hot metadata)."""

    tier: TierName
    nbytes: int
    """Payload bytes in the tier's representation."""
    transform: Representation = EXACT
    """Representation: which transform its values went through, framed or decoded."""
    checksum: bytes = b""
    """Content checksum where the tier keeps one (empty for DRAM)."""
    state: ReplicaState = ReplicaState.WRITING
    pins: int = 0
    """Loads reading this replica right now; a pinned replica is never an eviction victim."""
    noted: bool = False
    """Its transform is unknown to this reader and that was explained once (an event)."""
    served: object = field(default=None, compare=False, repr=False)
    """The lookup hit last answered from this replica (a frozen ChunkHit), reused by the
    next lookup of the same chunk at the same position while it still says the same
    (kvlife.store.reads: a lookup builds no hit record per chunk that it built before)."""

    @property
    def readable(self) -> bool:
        """Loads may read it: sealed, and not being deleted (an EVICTING replica is read
        until its eviction runs; a LEAVING replica's bytes may go at any moment)."""
        return self.state is ReplicaState.READY or self.state is ReplicaState.EVICTING

    @property
    def lasting(self) -> bool:
        """Readable and staying: READY (an EVICTING replica goes once its plan runs), so
        an object with no lasting replica has lost its last copy."""
        return self.state is ReplicaState.READY

    @property
    def counted(self) -> bool:
        """Placement charges its tier for it: WRITING or READY (chosen for eviction, it
        was uncounted when the eviction was planned)."""
        return self.state is ReplicaState.WRITING or self.state is ReplicaState.READY


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
    replicas: dict[TierName, Replica] = field(default_factory=dict)
    """Replicas by tier, in no particular order (the chain orders tiers)."""
    born: EpochStamp = UNSTAMPED
    """The global invalidation epoch the KV was created under (persisted with every
    durable replica): a global rule covers the object only if it may be newer."""

    @staticmethod
    def size(dtype: str, shape: tuple[int, ...]) -> int:
        """Bytes of an array of ``dtype`` and ``shape`` (InvalidArgument if not a dtype)."""
        try:
            n = np.dtype(dtype).itemsize
        except TypeError as exc:
            raise InvalidArgument(f"{dtype!r} is not a dtype: {exc}") from exc
        for d in shape:
            n *= d
        return n

    def readable_in(self, tier: TierName) -> bool:
        rep = self.replicas.get(tier)
        return rep is not None and rep.readable


@dataclass(frozen=True, slots=True)
class PromptRef:
    """The address of a prompt's chunks: model identity, namespace, tokens, where they
    start and what precedes them. Every call that names a prompt takes one of these."""

    identity: ModelIdentity
    namespace: Namespace
    tokens: Sequence[int] | np.ndarray
    start: int = 0
    """Absolute position of ``tokens[0]``."""
    parent: ChunkKey = ROOT_PARENT
    """Key of the chunk before ``tokens[0]`` (zeros at the start of a sequence)."""
    extra_keys: Sequence[bytes] = ()
    """Extra identity per chunk (e.g. a multimodal input digest)."""
    sources: Sequence[SourceSpan] = ()
    """Where the prompt's tokens came from (absolute positions, as ``start``): each
    chunk depends on, and its key hashes, the sources of the spans that start before
    its end (:mod:`kvlife.core.sources`)."""
    prefix_tokens: Sequence[int] | np.ndarray | None = None
    """Every token before ``start`` (from position 0), when the caller names the chunk
    before ``tokens[0]`` by them rather than by its key (``parent``): the store that
    keys the namespace derives the parent from them (:meth:`chained`). Under ``kvlife
    serve --tenants`` only the server can (it keys namespaces with a secret), so a
    client that did not get the parent's key from the server names it by its prefix."""

    def check_prefix(self) -> None:
        """InvalidArgument when :attr:`prefix_tokens` is not every token before a chunk-aligned
        ``start``, or comes with a ``parent`` too (the chunk before is named once)."""
        if self.prefix_tokens is None:
            return
        if not isinstance(self.prefix_tokens, (Sequence, np.ndarray)):
            raise InvalidArgument(
                f"prefix_tokens must be token ids, got {type(self.prefix_tokens).__name__}"
            )
        if len(self.prefix_tokens) != self.start:
            raise InvalidArgument(
                f"a prefix of {len(self.prefix_tokens)} tokens for a prompt starting at position "
                f"{self.start}: the prefix is every token before start"
            )
        if self.start % self.tokens_per_chunk:
            raise InvalidArgument(
                f"start {self.start} is not a chunk boundary ({self.tokens_per_chunk} "
                "tokens per chunk): a prefix names the chunk before a whole chunk"
            )
        if bytes(self.parent) != ROOT_PARENT:
            raise InvalidArgument(
                "a prompt names the chunk before its tokens by parent or by prefix, not both"
            )

    def chained(self) -> PromptRef:
        """This prompt with ``parent`` derived from :attr:`prefix_tokens` in its own namespace
        (the key of the prefix's last chunk; ROOT_PARENT for an empty prefix) and the
        prefix dropped; itself when it names no prefix."""
        if self.prefix_tokens is None:
            return self
        self.check_prefix()
        keys = prompt_chunk_keys(
            self.identity,
            self.namespace,
            self.prefix_tokens,
            extra_keys=self.extra_keys,
            sources=self.sources,
        )
        return replace(self, parent=keys[-1] if keys else ROOT_PARENT, prefix_tokens=None)

    def keys(self) -> list[ChunkKey]:
        """Keys of every full chunk, prefix-chained (validates the arguments)."""
        if self.prefix_tokens is not None:
            return self.chained().keys()
        return prompt_chunk_keys(
            self.identity,
            self.namespace,
            self.tokens,
            start=self.start,
            parent=self.parent,
            extra_keys=self.extra_keys,
            sources=self.sources,
        )

    def chunk_sources(self, chunks: int) -> list[tuple[Source, ...]]:
        """The sources each of the first ``chunks`` chunks depends on (what its record
        keeps; empty tuples for a prompt without sources)."""
        if not self.sources:
            return [()] * chunks
        return chunk_sources(self.sources, self.start, chunks, self.tokens_per_chunk)

    @property
    def tokens_per_chunk(self) -> int:
        return self.identity.layout.tokens_per_chunk

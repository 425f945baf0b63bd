"""Identity of a KV chunk: model identity, namespace and the chunk key.

A chunk of KV is only reusable by a request that would have computed exactly the same
bytes. That depends on far more than the token ids: the weights, the tokenizer, the
adapter, the position encoding, the chunk's absolute start position, the KV layout and
dtype, and on who may see it (the namespace). :func:`chunk_key` hashes all of them with
BLAKE3 over a canonical, fixed-width, length-prefixed encoding, so changing any field
changes the key and the key is the same in every process (no ``hash()``, no dict order).

Canonical encoding of a chunk key (all integers little-endian)::

    b"kvlife.chunk.v1\\0" | identity digest (32) | namespace salt (32)
    | parent key (32, zeros for the first chunk) | start position (u64)
    | token count (u32) | token ids (u32 each) | extra-key count (u32)
    | per extra key: length (u32) + bytes
    [ | b"kvlife.sources.v1\0" | sources digest (32) ]

The sources section is there only for a chunk that depends on upstream sources
(:mod:`kvlife.core.sources`: every span of the prompt that starts before the chunk's
end); its digest is :func:`~kvlife.core.sources.sources_digest` of that sorted set.
A chunk of a prompt declared without sources keeps the key of format v1, and the
section follows the length-prefixed extra keys, so no choice of extra keys can make
a key without sources equal one with them. A new version of any source a chunk
depends on gives it a new key: a lookup never meets KV of the old version.

The namespace salt is BLAKE3 of ``msgpack(["kvlife.namespace.v1", kind, name])``; on a
server with principals it is BLAKE3 in keyed mode over the same bytes, keyed with the
store's secret (:attr:`Namespace.salt_key`), so no client can compute it.
"""

from __future__ import annotations

import array
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NewType

import blake3
import msgpack
import numpy as np

from kvlife.core.enums import IdentityHashedEnum
from kvlife.core.errors import InvalidArgument
from kvlife.core.sources import (
    SOURCES_TAG,
    Source,
    SourceSpan,
    check_spans,
    chunk_sources,
    sources_digest,
)

ChunkKey = NewType("ChunkKey", bytes)
"""32-byte BLAKE3 digest naming one chunk of KV."""

Digest = NewType("Digest", bytes)
"""32-byte BLAKE3 digest of an identity or namespace."""

KEY_BYTES = 32
ROOT_PARENT = ChunkKey(b"\0" * KEY_BYTES)
"""Parent key of the first chunk of a prompt."""

_CHUNK_TAG = b"kvlife.chunk.v1\0"
_IDENTITY_TAG = "kvlife.identity.v1"
_NAMESPACE_TAG = "kvlife.namespace.v1"

DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
"""KV dtypes kvlife knows, with their size in bytes."""


def digest_bytes(data: bytes) -> Digest:
    """BLAKE3-256 of ``data``."""
    return Digest(blake3.blake3(data).digest())


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape and dtype of one chunk of KV.

    A chunk is stored as one array of shape
    ``(num_layers, 2, num_kv_heads, tokens_per_chunk, head_dim)`` (axis 1: keys, values).
    """

    num_layers: int
    """Transformer layers that hold KV."""
    num_kv_heads: int
    """Key/value heads per layer (after grouped-query sharing)."""
    head_dim: int
    """Size of one head's key or value vector."""
    dtype: str
    """Element type, one of :data:`DTYPE_ITEMSIZE`."""
    tokens_per_chunk: int
    """Tokens in one chunk; only full chunks are stored."""
    tp_rank: int = 0
    """Tensor-parallel rank whose shard of the KV this is (0 when not sharded)."""
    tp_size: int = 1
    """Tensor-parallel world size the KV was computed under (1: not sharded)."""
    kv_head_start: int = 0
    """First KV head of the model held by this shard; with ``num_kv_heads`` it names the
    heads the shard holds. A shard of another TP layout never shares a key."""
    pp_rank: int = 0
    """Pipeline-parallel stage whose layers this KV holds (0 when not pipelined)."""
    pp_size: int = 1
    """Pipeline-parallel stages the model's layers are split over (1: not pipelined)."""
    first_layer: int = 0
    """First model layer held by this stage; with ``num_layers`` it names the layers the
    stage holds. Two stages never share a key, even with the same layer count."""

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "num_kv_heads",
            "head_dim",
            "tokens_per_chunk",
            "tp_size",
            "pp_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgument(f"KVLayout.{name} must be a positive int, got {value!r}")
        for name in ("tp_rank", "kv_head_start", "pp_rank", "first_layer"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgument(f"KVLayout.{name} must be an int >= 0, got {value!r}")
        if self.tp_rank >= self.tp_size:
            raise InvalidArgument(
                f"KVLayout.tp_rank {self.tp_rank} must be below tp_size {self.tp_size}"
            )
        if self.pp_rank >= self.pp_size:
            raise InvalidArgument(
                f"KVLayout.pp_rank {self.pp_rank} must be below pp_size {self.pp_size}"
            )
        if self.dtype not in DTYPE_ITEMSIZE:
            raise InvalidArgument(
                f"KVLayout.dtype {self.dtype!r} is not one of {sorted(DTYPE_ITEMSIZE)}"
            )

    @property
    def sharded(self) -> bool:
        """Whether this layout names a tensor-parallel shard (encoded into the key)."""
        return (self.tp_rank, self.tp_size, self.kv_head_start) != (0, 1, 0)

    @property
    def staged(self) -> bool:
        """Whether this layout names a pipeline stage (encoded into the key)."""
        return (self.pp_rank, self.pp_size, self.first_layer) != (0, 1, 0)

    def encoded(self) -> list[object]:
        """Canonical form hashed into the identity: the unsharded, unpipelined layout
        keeps the five fields of format v1 (keys of existing stores stay valid); a
        tensor-parallel shard appends ``"tp"``, rank, world size and first KV head; a
        pipeline stage appends ``"pp"``, stage, stage count and first layer."""
        base: list[object] = [
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
            self.tokens_per_chunk,
        ]
        if self.sharded:
            base += ["tp", self.tp_rank, self.tp_size, self.kv_head_start]
        if self.staged:
            base += ["pp", self.pp_rank, self.pp_size, self.first_layer]
        return base

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def chunk_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_kv_heads, self.tokens_per_chunk, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def chunk_nbytes(self) -> int:
        return self.bytes_per_token * self.tokens_per_chunk


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """Everything about the model that changes the KV it computes.

    Digests are hex strings (any stable digest of the thing named); an empty adapter id
    means no adapter.
    """

    model_id: str
    """Human-readable model name (not trusted alone: the digests are)."""
    weights_digest: str
    """Digest of the weights, i.e. the model version."""
    tokenizer_digest: str
    """Digest of the tokenizer (vocabulary, merges, special tokens)."""
    layout: KVLayout
    """KV layout, including dtype and tokens per chunk."""
    position_encoding_digest: str = ""
    """Digest of the position-encoding configuration (RoPE base, scaling)."""
    adapter_id: str = ""
    """Adapter (LoRA) name, empty for none."""
    adapter_digest: str = ""
    """Digest of the adapter's weights, empty for none."""
    engine_digest: str = ""
    """Digest of the engine settings that change the KV bits it computes (engine and
    version, attention block size, compute dtype); empty for an engine that has none."""
    _digest: Digest = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("model_id", "weights_digest", "tokenizer_digest"):
            if not getattr(self, name):
                raise InvalidArgument(f"ModelIdentity.{name} must not be empty")
        if bool(self.adapter_id) != bool(self.adapter_digest):
            raise InvalidArgument(
                "ModelIdentity.adapter_id and adapter_digest must be given together "
                f"(got id={self.adapter_id!r}, digest={self.adapter_digest!r})"
            )
        fields: list[object] = [
            _IDENTITY_TAG,
            self.model_id,
            self.weights_digest,
            self.tokenizer_digest,
            self.position_encoding_digest,
            self.adapter_id,
            self.adapter_digest,
            self.layout.encoded(),
        ]
        if self.engine_digest:  # appended only when set: v1 identities keep their digest
            fields += ["engine", self.engine_digest]
        encoded = msgpack.packb(fields)
        object.__setattr__(self, "_digest", digest_bytes(encoded))

    @property
    def digest(self) -> Digest:
        """BLAKE3 of the canonical msgpack encoding of every field."""
        return self._digest


class NamespaceKind(IdentityHashedEnum):
    """Who may see a chunk."""

    PUBLIC = "public"
    ORGANISATION = "organisation"
    USER = "user"
    REQUEST = "request"


@dataclass(frozen=True, slots=True)
class Namespace:
    """Visibility scope of a chunk, carried into the key as a salt.

    ``name`` identifies the organisation, user or request; it must be empty for PUBLIC
    and non-empty otherwise. Identical text in two namespaces never shares a key.
    """

    kind: NamespaceKind
    """Level of sharing."""
    name: str = ""
    """Organisation, user or request id (empty for PUBLIC)."""
    salt_key: bytes = field(default=b"", repr=False, compare=False)
    """A store's secret (:mod:`kvlife.tenancy.secret`, 32 bytes): the salt is then
    BLAKE3 in keyed mode over the same encoding, which nobody without the secret can
    compute, so no client can derive, guess or choose another tenant's keys. Empty:
    the unkeyed salt of format v1 (a single-tenant store, keys computed by clients).
    Not compared: within one store every namespace is keyed alike."""
    _salt: Digest = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.kind, NamespaceKind):
            raise InvalidArgument(f"Namespace.kind must be a NamespaceKind, got {self.kind!r}")
        if (self.kind is NamespaceKind.PUBLIC) != (self.name == ""):
            raise InvalidArgument(
                f"Namespace {self.kind.value} needs "
                + ("an empty name" if self.kind is NamespaceKind.PUBLIC else "a name")
                + f", got {self.name!r}"
            )
        encoded = msgpack.packb([_NAMESPACE_TAG, self.kind.value, self.name])
        if self.salt_key:
            if not isinstance(self.salt_key, bytes) or len(self.salt_key) != KEY_BYTES:
                raise InvalidArgument(f"Namespace.salt_key must be {KEY_BYTES} bytes")
            salt = Digest(blake3.blake3(encoded, key=self.salt_key).digest())
        else:
            salt = digest_bytes(encoded)
        object.__setattr__(self, "_salt", salt)

    @property
    def salt(self) -> Digest:
        return self._salt

    @property
    def keyed(self) -> bool:
        """Whether the salt is keyed with a store's secret."""
        return bool(self.salt_key)

    def __str__(self) -> str:
        return self.kind.value if not self.name else f"{self.kind.value}:{self.name}"

    @classmethod
    def public(cls) -> Namespace:
        return cls(NamespaceKind.PUBLIC)

    @classmethod
    def parse(cls, text: str) -> Namespace:
        """Inverse of ``str()``: ``public``, ``user:alice``, ``organisation:acme`` …"""
        kind, _, name = text.partition(":")
        try:
            return cls(NamespaceKind(kind), name)
        except ValueError as exc:
            raise InvalidArgument(f"unknown namespace kind in {text!r}") from exc


PUBLIC = Namespace.public()

_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")


def token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian u32 bytes (the form hashed into keys)."""
    if isinstance(tokens, list) and sys.byteorder == "little":
        try:  # 3x faster than numpy for a Python list; rejects negatives and >= 2**32
            return array.array("I", tokens).tobytes()
        except (OverflowError, TypeError) as exc:
            raise InvalidArgument(f"token ids must be integers in [0, 2**32): {exc}") from exc
    arr = _checked_tokens(tokens)
    return arr.astype("<u4", copy=False).tobytes()


_U4 = np.dtype("<u4")
_I4 = np.dtype("<i4")


def _checked_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """``tokens`` as a one-dimensional integer array of ids in [0, 2**32) (InvalidArgument
    otherwise). A dtype that cannot hold an id out of range is not scanned for one: an
    unsigned one of up to 4 bytes needs no check, a signed one of up to 4 bytes only
    its minimum (each scan is a pass over the prompt)."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidArgument(f"token ids must be one-dimensional, got shape {arr.shape}")
    if not arr.size:
        return arr
    kind, size = arr.dtype.kind, arr.dtype.itemsize
    if kind not in "iu":
        raise InvalidArgument("token ids must be integers in [0, 2**32)")
    if (kind == "i" and int(arr.min()) < 0) or (size > 4 and int(arr.max()) >= 2**32):
        raise InvalidArgument("token ids must be integers in [0, 2**32)")
    return arr


def token_buffer(tokens: Sequence[int] | np.ndarray) -> bytes | memoryview:
    """The bytes of :func:`token_bytes`, without copying them where ``tokens`` is a
    contiguous array of 4-byte little-endian ids already (the engine's int32 or uint32
    token arrays; the server's view of a request's bytes): a view of its memory, read
    while the keys are hashed (as with a copy, tokens changed meanwhile by another
    thread give keys of no prompt the caller meant)."""
    if isinstance(tokens, np.ndarray) and tokens.dtype in (_U4, _I4):
        arr = _checked_tokens(tokens)
        if arr.flags.c_contiguous:
            return arr.view(_U4).data.cast("B")
    return token_bytes(tokens)


def _extras(extra_keys: Sequence[bytes]) -> bytes:
    parts = [_U32.pack(len(extra_keys))]
    for extra in extra_keys:
        parts.append(_U32.pack(len(extra)))
        parts.append(bytes(extra))
    return b"".join(parts)


def chunk_key(
    identity_digest: bytes,
    namespace_salt: bytes,
    parent: bytes,
    start: int,
    tokens: Sequence[int] | np.ndarray,
    extra_keys: Sequence[bytes] = (),
    sources: Sequence[Source] = (),
) -> ChunkKey:
    """Key of one chunk (see the module docstring for the encoding); ``sources``: the
    sources the chunk depends on (:func:`~kvlife.core.sources.dependent`)."""
    if len(identity_digest) != KEY_BYTES or len(namespace_salt) != KEY_BYTES:
        raise InvalidArgument("identity digest and namespace salt must be 32 bytes")
    if len(parent) != KEY_BYTES:
        raise InvalidArgument(f"parent key must be {KEY_BYTES} bytes, got {len(parent)}")
    if start < 0:
        raise InvalidArgument(f"chunk start position must be >= 0, got {start}")
    tb = token_bytes(tokens)
    extras = _extras(extra_keys) + _sources_section(tuple(sorted(set(sources))))
    return _key_from_parts(identity_digest + namespace_salt, parent, start, tb, extras)


def _sources_section(sources: tuple[Source, ...]) -> bytes:
    """The key's sources section: empty for a chunk that depends on none."""
    return SOURCES_TAG + sources_digest(sources) if sources else b""


def _key_from_parts(prefix: bytes, parent: bytes, start: int, tb: bytes, extras: bytes) -> ChunkKey:
    data = b"".join(
        (_CHUNK_TAG, prefix, parent, _U64.pack(start), _U32.pack(len(tb) // 4), tb, extras)
    )
    return ChunkKey(blake3.blake3(data).digest())


def prompt_chunk_keys(
    identity: ModelIdentity,
    namespace: Namespace,
    tokens: Sequence[int] | np.ndarray,
    *,
    start: int | np.integer[Any] = 0,
    parent: bytes = ROOT_PARENT,
    extra_keys: Sequence[bytes] = (),
    sources: Sequence[SourceSpan] = (),
) -> list[ChunkKey]:
    """Keys of every full chunk of ``tokens``, prefix-chained from ``parent``.

    ``sources``: the spans of the prompt's upstream sources, in absolute positions (the
    coordinates of ``start``; spans before ``start`` count too): each chunk's key hashes
    the sources of every span that starts before the chunk's end.

    ``start`` is the absolute position of ``tokens[0]``. A trailing partial chunk gets
    no key: kvlife stores and looks up full chunks only. ``extra_keys`` apply to every
    chunk (for example a multimodal input digest). Arguments of the wrong type raise
    InvalidArgument naming the argument.
    """
    pos = _check_prompt_args(identity, namespace, start, parent, extra_keys)
    spans = check_spans(sources)
    tb = token_buffer(tokens)
    n = identity.layout.tokens_per_chunk
    step = 4 * n
    # Everything but the parent, the position and the tokens is the same for every
    # chunk: encode it once; per chunk only one join and one hash remain (the hash is
    # most of the time, and BLAKE3 of a 1 KiB input cannot be parallelised).
    head = _CHUNK_TAG + identity.digest + namespace.salt
    count_field = _U32.pack(n)
    extras = _extras(extra_keys)
    tokens_mv = memoryview(tb)
    pack_u64 = _U64.pack
    join = b"".join
    hasher = blake3.blake3
    key = bytes(parent)
    keys: list[ChunkKey] = []
    count = len(tb) // step
    if spans:
        per_chunk = chunk_sources(spans, pos, count, n)
        sections: dict[int, bytes] = {}  # by id of the (shared) tuple of a run of chunks
        for i in range(count):
            deps = per_chunk[i]
            tail = sections.get(id(deps))
            if tail is None:
                tail = sections[id(deps)] = extras + _sources_section(deps)
            part = tokens_mv[i * step : (i + 1) * step]
            key = hasher(join((head, key, pack_u64(pos + i * n), count_field, part, tail))).digest()
            keys.append(ChunkKey(key))
        return keys
    for i in range(count):
        part = tokens_mv[i * step : (i + 1) * step]
        key = hasher(join((head, key, pack_u64(pos + i * n), count_field, part, extras))).digest()
        keys.append(ChunkKey(key))
    return keys


def _check_prompt_args(
    identity: object, namespace: object, start: object, parent: object, extra_keys: object
) -> int:
    """Type checks of prompt_chunk_keys, once per call (not per chunk); returns ``start``
    as an int (numpy integers are accepted: positions often come out of arrays)."""
    if not isinstance(identity, ModelIdentity):
        raise InvalidArgument(f"identity must be a ModelIdentity, got {type(identity).__name__}")
    if not isinstance(namespace, Namespace):
        hint = " (use Namespace.parse for text)" if isinstance(namespace, str) else ""
        raise InvalidArgument(
            f"namespace must be a Namespace, got {type(namespace).__name__}{hint}"
        )
    if not isinstance(start, (int, np.integer)) or isinstance(start, bool):
        raise InvalidArgument(f"start must be an int position >= 0, got {start!r}")
    start = int(start)
    if start < 0 or start >= 2**64:
        raise InvalidArgument(f"start position must be in [0, 2**64), got {start}")
    if not isinstance(parent, (bytes, bytearray)):
        raise InvalidArgument(
            f"parent must be a {KEY_BYTES}-byte chunk key (bytes), got {type(parent).__name__}"
        )
    if len(parent) != KEY_BYTES:
        raise InvalidArgument(f"parent key must be {KEY_BYTES} bytes, got {len(parent)}")
    if isinstance(extra_keys, (str, bytes, bytearray)) or not isinstance(extra_keys, Sequence):
        raise InvalidArgument(
            f"extra_keys must be a sequence of bytes, got {type(extra_keys).__name__}"
        )
    for i, extra in enumerate(extra_keys):
        if not isinstance(extra, (bytes, bytearray)):
            raise InvalidArgument(
                f"extra_keys[{i}] must be bytes, got {type(extra).__name__} {extra!r}"
            )
    return start

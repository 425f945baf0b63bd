"""The wire of ``kvlife serve``: length-prefixed msgpack frames over a Unix socket, and
the decoder that validates every field before the server uses it.

A frame is a 4-byte big-endian length followed by that many bytes of msgpack
(:data:`MAX_MESSAGE` at most). A request is ``[rid, verb, args]``: ``rid`` an int
(0: the client wants no reply), ``verb`` one of :data:`VERBS`, ``args`` a map whose
fields each verb declares with type, range and length (:class:`Field`); a missing
required field, an unknown field, a wrong type or an out-of-range value is a
:class:`~kvlife.core.errors.ProtocolError` naming it. A reply is ``[rid, True, result]``
or ``[rid, False, [error_class, message]]``; a streamed load sends ``[rid, "part", grant]``
frames before it.

Bulk bytes never travel here: they are in the shared-memory arena, and a reply names
the extents (grants) the session may read or write.
"""

from __future__ import annotations

import dataclasses
import socket
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from kvlife.core.errors import InvalidArgument, LimitExceeded, ProtocolError, StoreUnavailable
from kvlife.core.identity import (
    KEY_BYTES,
    ROOT_PARENT,
    ChunkKey,
    KVLayout,
    ModelIdentity,
    Namespace,
    token_bytes,
)
from kvlife.core.objects import PromptRef
from kvlife.core.sources import MAX_SOURCE_NAME, MAX_SPANS, Source, SourceSpan
from kvlife.results import PutResult
from kvlife.server.limits import MAX_REQUEST, Limits
from kvlife.transforms.base import ErrorBound, Exactness
from kvlife.transforms.contract import Accept

PROTOCOL_VERSION = 4
"""2: lookups carry an ``accept`` and answer each hit's representation. 3: lookups
answer where DRAM hits lie (hints), loads may carry them back (the client copied from
there already); the one-round-trip ``put`` into staged extents. 4: ``put_commit`` may carry
the chunks' seals, hashed by the client as it copied them."""
MAX_MESSAGE = MAX_REQUEST
"""Largest frame either side accepts (a 1M-token prompt is 4 MiB of token ids); a
server may be set to accept less (``--max-request-bytes``)."""
DEFAULT_LIMITS = Limits()
_LEN = struct.Struct(">I")
_MAX_STR = 4096
_MAX_ID = 2**63 - 1
_U64_MAX = 2**64 - 1


@dataclass(frozen=True, slots=True)
class Field:
    """One argument of a verb: a type check, an optional range/length check."""

    kind: str
    """``int``, ``bool``, ``str``, ``bytes``, ``keys`` (bytes of whole 32-byte keys),
    ``key`` (one 32-byte key), ``bytes_list``, ``identity``, ``map``, ``spans``
    (``[name, version, start, end]`` lists, :func:`decode_spans`)."""
    required: bool = True
    lo: int = 0
    hi: int = _MAX_ID
    """Range of an int; length bounds of a str, bytes or list."""


_OPT = False
IDENTITY = Field("identity")
NAMESPACE = Field("str", hi=_MAX_STR)
TOKENS = Field("bytes", hi=MAX_MESSAGE)
PROMPT: dict[str, Field] = {
    "identity": IDENTITY,
    "namespace": NAMESPACE,
    "tokens": TOKENS,
    "start": Field("int", _OPT, 0, 2**40),
    "parent": Field("key", _OPT),
    "extra_keys": Field("bytes_list", _OPT, 0, 1 << 16),
    # [[name, version, start, end], ...]: the prompt's upstream sources (kvlife.core.sources)
    "sources": Field("spans", _OPT, 0, MAX_SPANS),
    # every token before start (u32 ids): the server derives the parent from them
    "prefix_tokens": Field("bytes", _OPT, hi=MAX_MESSAGE),
}
ID = Field("int", True, 1, _MAX_ID)
MAX_SEALS_BYTES = 16 << 20
"""The longest ``seals`` of a ``put_commit`` (16 bytes a chunk: a million chunks)."""

VERBS: dict[str, dict[str, Field]] = {
    # token: who the client is, where its Unix credentials do not say (kvlife.tenancy)
    "hello": {"version": Field("int", True, 0, 1 << 16), "token": Field("str", _OPT, 1, 256)},
    "lookup": {**PROMPT, "opts": Field("map", _OPT, 0, 64)},
    "load": {
        "keys": Field("keys", True, 0, MAX_MESSAGE),
        "starts": Field("int_list", True, 0, 1 << 20),
        "chunks_total": Field("int", True, 0, 1 << 24),
        "layout": Field("layout", _OPT),
        "into": Field("int_list", _OPT, 0, 1 << 21),
        "stream": Field("bool", _OPT),
        # streamed: the landed bytes of the chunk being read may be told before it
        # verified ([i, offset, dtype, shape, bytes] parts; kvlife.server.loads)
        "early": Field("bool", _OPT),
        "request_id": Field("str", _OPT, 0, _MAX_STR),
        "accept": Field("accept", _OPT),
        "hints": Field("int_list", _OPT, 0, 1 << 21),
        # the chunks' bytes in the reply (a session that maps no arena: shm_copies)
        "inline": Field("bool", _OPT),
        # the client read each chunk's disk frame itself: [segment, offset] of each, as
        # the lookup named them; the server confirms how many are live there
        # (kvlife.store.direct)
        "direct": Field("int_list", _OPT, 0, 1 << 21),
    },
    "release": {"load": ID},
    "alloc_buffer": {"nbytes": Field("int", True, 1, 1 << 40)},
    "free_buffer": {"buffer": ID},
    "prepare_put": {
        **PROMPT,
        "request_id": Field("str", _OPT, 0, _MAX_STR),
        "stage": Field("int", _OPT, 0, 1 << 10),
        "chained": Field("bool", _OPT),
    },
    "put": {
        **PROMPT,
        "request_id": Field("str", _OPT, 0, _MAX_STR),
        "staged": Field("int_list", True, 1, 1 << 20),
        "deferred": Field("bool", _OPT),
        "chained": Field("bool", _OPT),
    },
    # seals: the xxh3-128 of each chunk of the put as the client copied it (16 bytes
    # each, in order; kvlife.native.copies.copy_sealed): taken as the new chunks' seals
    # instead of hashing the arena (kvlife.server.puts)
    "put_commit": {"seals": Field("bytes", _OPT, 16, MAX_SEALS_BYTES)},
    # the client of a direct load verified the first ``chunks`` frames it read (no
    # reply wanted): the server counts those it confirmed (kvlife.store.direct)
    "direct_kept": {"chunks": Field("int", True, 0, 1 << 21)},
    # the client of a deferred put wrote its first ``bytes`` bytes (no reply wanted)
    "put_written": {"bytes": Field("int", True, 1, 1 << 50)},
    # a put with its chunks' bytes (a session that maps no arena: server/shm_copies.py)
    "put_inline": {
        **PROMPT,
        "request_id": Field("str", _OPT, 0, _MAX_STR),
        "chained": Field("bool", _OPT),
        "chunks": Field("bytes_list", True, 0, 1 << 20),
    },
    "commit_put": {"put": ID},
    "abort_put": {"put": ID, "reason": Field("str", _OPT, 0, _MAX_STR)},
    "invalidate": {
        "weights_digest": Field("str", _OPT, 0, _MAX_STR),
        "adapter_id": Field("str", _OPT, 0, _MAX_STR),
        "namespace": Field("str", _OPT, 0, _MAX_STR),
        "prefix": Field("key", _OPT),
        "source": Field("str", _OPT, 1, MAX_SOURCE_NAME),
        # the source's versions [lo, hi); no hi: every version from lo
        "source_lo": Field("int", _OPT, 0, _U64_MAX),
        "source_hi": Field("int", _OPT, 1, _U64_MAX),
        "model": Field("str", _OPT, 1, _MAX_STR),
        "keep_weights_digest": Field("str", _OPT, 1, _MAX_STR),
    },
    "evict": {"tier": Field("str", True, 1, 256), "nbytes": Field("int", True, 0, _MAX_ID)},
    "flush": {},
    "drain": {},
    "info": {},
    "counters": {},
    "check": {},
    "state": {},
    # kvlife top: the events after sequence number `since`, at most `events` of them
    "stats": {"since": Field("int", _OPT, 0, _MAX_ID), "events": Field("int", _OPT, 0, 256)},
}
"""Every verb and its arguments."""

LOOKUP_OPTIONS: dict[str, Field] = {"accept": Field("accept"), "direct": Field("bool")}
"""Options of ``lookup`` beyond the prompt, by name: each is validated here, decoded by
the session and passed to ``KVStore.lookup`` as a keyword (``accept``: which replica
representations the lookup takes, :func:`encode_accept`), but ``direct``, which the
session answers itself: the reply names each disk hit's frame, for a client that reads
it (:mod:`kvlife.store.direct`)."""


@dataclass(frozen=True, slots=True)
class Request:
    rid: int
    verb: str
    args: dict[str, Any]


def _check(name: str, spec: Field, value: object) -> None:
    kind = spec.kind
    if kind == "int":
        if type(value) is not int or not spec.lo <= value <= spec.hi:
            raise ProtocolError(f"field {name!r} must be an int in [{spec.lo}, {spec.hi}]")
    elif kind == "bool":
        if type(value) is not bool:
            raise ProtocolError(f"field {name!r} must be a bool")
    elif kind == "str":
        if type(value) is not str or not spec.lo <= len(value) <= spec.hi:
            raise ProtocolError(f"field {name!r} must be a str of {spec.lo}..{spec.hi} chars")
    elif kind in ("bytes", "keys", "key"):
        if type(value) is not bytes:
            raise ProtocolError(f"field {name!r} must be bytes")
        if kind == "key" and len(value) != KEY_BYTES:
            raise ProtocolError(f"field {name!r} must be a {KEY_BYTES}-byte key")
        if kind == "keys" and len(value) % KEY_BYTES:
            raise ProtocolError(f"field {name!r} must hold whole {KEY_BYTES}-byte keys")
        if not spec.lo <= len(value) <= spec.hi:
            raise ProtocolError(f"field {name!r} must be {spec.lo}..{spec.hi} bytes")
    elif kind in ("bytes_list", "int_list"):
        want: type = bytes if kind == "bytes_list" else int
        if type(value) is not list or not spec.lo <= len(value) <= spec.hi:
            raise ProtocolError(f"field {name!r} must be a list of {spec.lo}..{spec.hi} items")
        for item in value:
            if type(item) is not want or (type(item) is int and not 0 <= item <= _MAX_ID):
                raise ProtocolError(f"field {name!r} must hold only {want.__name__} items")
    elif kind == "map":
        if type(value) is not dict or len(value) > spec.hi:
            raise ProtocolError(f"field {name!r} must be a map of at most {spec.hi} entries")
    elif kind == "spans":
        if type(value) is not list or not spec.lo <= len(value) <= spec.hi:
            raise ProtocolError(f"field {name!r} must be a list of {spec.lo}..{spec.hi} spans")
        for item in value:
            if (
                type(item) is not list
                or len(item) != 4
                or type(item[0]) is not str
                or not all(type(x) is int and 0 <= x <= _U64_MAX for x in item[1:])
            ):
                raise ProtocolError(f"field {name!r} must hold [name, version, start, end] spans")
    elif kind == "identity":
        check_identity(value)
    elif kind == "layout":
        check_layout(value)
    elif kind == "accept":
        check_accept(value)
    else:  # pragma: no cover - a bad schema is a bug in this module
        raise AssertionError(kind)


def check_args(verb: str, args: object) -> dict[str, Any]:
    """Validate ``args`` against ``verb``'s fields; the same map, now trusted."""
    schema = VERBS.get(verb) if type(verb) is str else None
    if schema is None:
        raise ProtocolError(f"unknown verb {str(verb)[:64]!r}; known: {sorted(VERBS)}")
    if type(args) is not dict:
        raise ProtocolError(f"arguments of {verb!r} must be a map")
    for name in args:
        if type(name) is not str or name not in schema:
            raise ProtocolError(f"{verb!r} takes no field {str(name)[:64]!r}")
    for name, spec in schema.items():
        if name not in args:
            if spec.required:
                raise ProtocolError(f"{verb!r} needs field {name!r}")
            continue
        _check(name, spec, args[name])
    if verb == "lookup" and "opts" in args:
        for opt, value in args["opts"].items():
            known = LOOKUP_OPTIONS.get(opt) if type(opt) is str else None
            if known is None:
                raise ProtocolError(f"unknown lookup option {str(opt)[:64]!r}")
            _check(opt, known, value)
    return args


class DecodeLimit(LimitExceeded, ProtocolError):
    """A frame whose decoding would exceed the decoder's bounds (too many containers,
    a list, map or string longer than any request has): refused before it is built
    (a LimitExceeded on the wire)."""


SMALL_BODY = 64 << 10
"""Bodies up to this decode without counting their containers (at most about 70 bytes
of Python objects per byte: 4.5 MiB)."""
MAX_CONTAINERS = 64
"""Lists and maps in one larger request (the largest verb has about a dozen): a frame
of empty maps cost 70 times its length decoded; its containers are counted as they are
built and the decoding stops at the first one too many."""


class _Containers:
    """Counts the containers a decoding builds; raises at one too many."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = MAX_CONTAINERS

    def __call__(self, obj: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise DecodeLimit(f"a request holds at most {MAX_CONTAINERS} lists and maps")
        return obj


def decode_request(body: bytes, limits: Limits = DEFAULT_LIMITS) -> Request:
    """Parse and validate one request frame's body (ProtocolError on anything wrong;
    DecodeLimit when decoding it would exceed the decoder's bounds, checked before each
    list, map, string or byte string is built)."""
    hooks: dict[str, Any] = {}
    if len(body) > SMALL_BODY:
        count = _Containers()
        hooks = {"list_hook": count, "object_hook": count}
    try:
        msg = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            max_ext_len=0,
            max_str_len=4 * _MAX_STR,
            max_bin_len=limits.max_request_bytes,
            max_array_len=max(64, 2 * limits.max_chunks),
            max_map_len=64,
            **hooks,
        )
    except DecodeLimit:
        raise
    except ValueError as exc:
        if "exceeds max_" in str(exc):  # msgpack's own bounds, checked before building
            raise DecodeLimit(f"a request field is too long to decode: {exc}") from None
        raise ProtocolError(f"not a msgpack message: {type(exc).__name__}") from None
    except Exception as exc:  # every msgpack failure is the client's bad frame
        raise ProtocolError(f"not a msgpack message: {type(exc).__name__}") from None
    if type(msg) is not list or len(msg) != 3:
        raise ProtocolError("a request is [rid, verb, args]")
    rid, verb, args = msg
    if type(rid) is not int or not 0 <= rid <= _MAX_ID:
        raise ProtocolError("request id must be an int in [0, 2**63)")
    try:
        return Request(rid, verb, check_args(verb, args))
    except ProtocolError as exc:
        put = args.get("put") if type(args) is dict else None
        raise Rejected(
            rid, exc, verb if type(verb) is str else "", put if type(put) is int else None
        ) from None


class Rejected(ProtocolError):
    """A request whose id is known but whose verb or arguments are bad: the error reply
    goes to that id (a client waiting for it gets it). ``verb``: the verb it named, when
    that is a string; ``put``: the pending put it named, when that is an int (the
    session undoes what a refused ``put_commit``, ``commit_put`` or ``abort_put``
    leaves)."""

    def __init__(
        self, rid: int, error: ProtocolError, verb: str = "", put: int | None = None
    ) -> None:
        super().__init__(str(error))
        self.rid = rid
        self.verb = verb
        self.put = put


# ---------------------------------------------------------------------- identity


def _wire_fields(cls: type) -> dict[str, type]:
    """Every constructor field of an identity dataclass and the scalar type it holds,
    read from the class itself: a field added to ``ModelIdentity`` or ``KVLayout``
    travels without an edit here (an identity that lost a field on the wire would key
    another shard's or another engine's KV the same)."""
    kinds = {"str": str, "int": int, "bool": bool}
    out: dict[str, type] = {}
    for f in dataclasses.fields(cls):
        if not f.init or f.name == "layout":
            continue
        kind = kinds.get(str(f.type))
        if kind is None:
            raise AssertionError(f"{cls.__name__}.{f.name}: no wire form for {f.type!r}")
        out[f.name] = kind
    return out


IDENTITY_FIELDS = _wire_fields(ModelIdentity)
"""Scalar fields of a ModelIdentity on the wire (plus ``layout``)."""
LAYOUT_FIELDS = _wire_fields(KVLayout)


def _check_fields(what: str, value: object, fields: dict[str, type]) -> dict[str, Any]:
    if type(value) is not dict or set(value) != set(fields):
        raise ProtocolError(f"{what} must be a map of exactly {sorted(fields)}")
    for name, kind in fields.items():
        v = value[name]
        if type(v) is not kind:
            raise ProtocolError(f"{what} field {name!r} must be a {kind.__name__}")
        if isinstance(v, str) and len(v) > _MAX_STR:
            raise ProtocolError(f"{what} field {name!r} must be <= {_MAX_STR} chars")
        if type(v) is int and not -(1 << 20) <= v <= 1 << 20:
            raise ProtocolError(f"{what} field {name!r} must be an int in [-2**20, 2**20]")
    return value


def encode_identity(identity: ModelIdentity) -> dict[str, Any]:
    out: dict[str, Any] = {k: getattr(identity, k) for k in IDENTITY_FIELDS}
    out["layout"] = encode_layout(identity.layout)
    return out


def check_identity(value: object) -> None:
    if type(value) is not dict or "layout" not in value:
        raise ProtocolError("identity must be a map with a layout")
    _check_fields("identity", {k: v for k, v in value.items() if k != "layout"}, IDENTITY_FIELDS)
    check_layout(value["layout"])


def check_layout(lay: object) -> None:
    _check_fields("identity layout", lay, LAYOUT_FIELDS)


def encode_layout(lay: KVLayout) -> dict[str, Any]:
    return {k: getattr(lay, k) for k in LAYOUT_FIELDS}


def decode_layout(lay: dict[str, Any]) -> KVLayout:
    """A checked layout map as a KVLayout (InvalidArgument if its values are bad)."""
    return KVLayout(**lay)


def decode_identity(value: dict[str, Any]) -> ModelIdentity:
    """A checked identity map as a ModelIdentity (InvalidArgument if its values are bad)."""
    layout = decode_layout(value["layout"])
    return ModelIdentity(layout=layout, **{k: value[k] for k in IDENTITY_FIELDS})


# ---------------------------------------------------------------------- accept

_EXACTNESS = {e.value: e for e in Exactness}


def encode_accept(accept: Accept) -> list[Any]:
    """``[exactness, [range, magnitude, absolute] | None, max_kl | None, names | None]``."""
    b = accept.max_bound
    bound = None if b is None else [b.range_factor, b.magnitude_factor, b.absolute]
    names = None if accept.transforms is None else sorted(accept.transforms)
    return [accept.exactness.value, bound, accept.max_kl, names]


def check_accept(value: object) -> None:
    if type(value) is not list or len(value) != 4:
        raise ProtocolError("accept must be [exactness, bound, max_kl, transforms]")
    exactness, bound, max_kl, names = value
    if type(exactness) is not str or exactness not in _EXACTNESS:
        raise ProtocolError(f"accept exactness must be one of {sorted(_EXACTNESS)}")
    if bound is not None and (
        type(bound) is not list or len(bound) != 3 or any(type(f) is not float for f in bound)
    ):
        raise ProtocolError("accept bound must be three floats or nil")
    if max_kl is not None and type(max_kl) is not float:
        raise ProtocolError("accept max_kl must be a float or nil")
    if names is not None and (
        type(names) is not list
        or len(names) > 64
        or any(type(n) is not str or len(n) > 256 for n in names)
    ):
        raise ProtocolError("accept transforms must be at most 64 names or nil")


def decode_accept(value: list[Any]) -> Accept:
    """A checked accept list as an Accept (InvalidArgument if its values are bad)."""
    exactness, bound, max_kl, names = value
    try:
        eb = None if bound is None else ErrorBound(*bound)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"accept bound {bound}: {exc}") from None
    return Accept(_EXACTNESS[exactness], eb, max_kl, None if names is None else frozenset(names))


def encode_prompt(prompt: PromptRef) -> dict[str, Any]:
    """A prompt's fields of a ``lookup``, ``prepare_put`` or ``put`` (defaults left out)."""
    args: dict[str, Any] = {
        "identity": encode_identity(prompt.identity),
        "namespace": str(prompt.namespace),
        "tokens": token_bytes(prompt.tokens),
    }
    if prompt.start:
        args["start"] = prompt.start
    if prompt.parent != ROOT_PARENT:
        args["parent"] = bytes(prompt.parent)
    if prompt.extra_keys:
        args["extra_keys"] = [bytes(e) for e in prompt.extra_keys]
    if prompt.sources:
        args["sources"] = [
            [s.source.name, s.source.version, s.start, s.end] for s in prompt.sources
        ]
    if prompt.prefix_tokens is not None:
        args["prefix_tokens"] = token_bytes(prompt.prefix_tokens)
    return args


def decode_spans(value: list[list[Any]]) -> tuple[SourceSpan, ...]:
    """Checked ``sources`` of a prompt as spans (InvalidArgument naming a bad one)."""
    return tuple(SourceSpan(Source(n, v), start, end) for n, v, start, end in value)


def split_keys(blob: bytes) -> list[ChunkKey]:
    """Chunk keys sent as one blob."""
    return [ChunkKey(blob[i : i + KEY_BYTES]) for i in range(0, len(blob), KEY_BYTES)]


_PUT_COUNTS = [f.name for f in dataclasses.fields(PutResult) if f.name != "keys"]


def encode_put_result(res: PutResult) -> dict[str, Any]:
    """A PutResult as a reply (its keys as one blob)."""
    out: dict[str, Any] = {k: getattr(res, k) for k in _PUT_COUNTS}
    out["keys"] = b"".join(res.keys)
    return out


def decode_put_result(r: dict[str, Any]) -> PutResult:
    return PutResult(**{k: r[k] for k in _PUT_COUNTS}, keys=split_keys(r["keys"]))


_NAMESPACES: dict[str, Namespace] = {}
NAMESPACES_KEPT = 1024
"""Namespaces decoded from text and kept (a namespace is immutable; parsing one hashes
its encoding, about 40 us of a put on a slow CPU, issue 28). At most this many, each
named by at most :data:`NAMESPACE_KEPT_CHARS` characters; the rest are decoded anew."""
NAMESPACE_KEPT_CHARS = 256


def decode_namespace(text: str) -> Namespace:
    ns = _NAMESPACES.get(text)
    if ns is not None:
        return ns
    try:
        ns = Namespace.parse(text)
    except InvalidArgument:
        raise
    except Exception as exc:
        raise InvalidArgument(f"bad namespace {text[:64]!r}: {exc}") from None
    if len(text) <= NAMESPACE_KEPT_CHARS:
        if len(_NAMESPACES) >= NAMESPACES_KEPT:
            _NAMESPACES.clear()  # whoever names many namespaces decodes them anew
        _NAMESPACES[text] = ns
    return ns


# ---------------------------------------------------------------------- framing


def pack(obj: object) -> bytes:
    body: bytes = msgpack.packb(obj, use_bin_type=True)
    if len(body) > MAX_MESSAGE:
        raise ProtocolError(f"message of {len(body)} bytes exceeds the limit of {MAX_MESSAGE}")
    return _LEN.pack(len(body)) + body


class Idle(Exception):
    """No frame began within the socket's timeout (a waiting server goes on waiting)."""


POLL_WAIT_S = 3600.0
"""Timeout the server sets on its connections, so that a thread waiting for a request
waits in ``poll`` for input only. A blocking ``recv`` sleeps on the socket's wait queue
unfiltered: every time the client consumes a reply, the freed send buffer wakes the
server thread for nothing, and on a VM that wake of an idle vCPU was measured at about
50 us, paid inside the client's ``recv``."""


def recv_exact(sock: socket.socket, n: int, idle_ok: bool = False) -> bytes | None:
    """``n`` bytes, or None at a clean end of stream before the first byte; with
    ``idle_ok`` a timeout before the first byte is :class:`Idle`."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got)
        except TimeoutError:
            if got == 0 and idle_ok:
                raise Idle from None
            raise
        if k == 0:
            if got == 0:
                return None
            raise ConnectionResetError(f"stream ended after {got} of {n} bytes")
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket, idle_ok: bool = False) -> bytes | None:
    """One frame's body; None at end of stream. ProtocolError on an oversized length
    (the stream cannot be resynchronised after it: the caller closes); with ``idle_ok``
    :class:`Idle` when no frame began within the socket's timeout."""
    head = recv_exact(sock, _LEN.size, idle_ok)
    if head is None:
        return None
    (n,) = _LEN.unpack(head)
    if n > MAX_MESSAGE:
        raise ProtocolError(f"frame of {n} bytes exceeds the limit of {MAX_MESSAGE}")
    body = recv_exact(sock, n)
    if body is None:
        raise ConnectionResetError("stream ended inside a frame")
    return body


def error_reply(rid: int, exc: BaseException) -> bytes:
    """``[rid, False, [class, message]]``, the class being the nearest one a client can
    rebuild (of ``kvlife.core.errors``: a server-side subclass travels as its base)."""
    kind = next(
        (c.__name__ for c in type(exc).__mro__ if c.__module__ == "kvlife.core.errors"),
        type(exc).__name__,
    )
    return pack([rid, False, [kind, str(exc)[:_MAX_STR]]])


def ok_reply(rid: int, result: object) -> bytes:
    return pack([rid, True, result])


PART = "part"
"""Second element of a partial reply ``[rid, "part", payload]``: a streamed load sends one
per chunk as its read completes, before the final reply."""


def part_reply(rid: int, payload: object) -> bytes:
    return pack([rid, PART, payload])


def unavailable(where: str, exc: BaseException | None = None) -> StoreUnavailable:
    detail = f": {exc}" if exc is not None else ""
    return StoreUnavailable(f"kvlife server at {where} is unavailable{detail}")


Handler = Callable[[Mapping[str, Any]], object]

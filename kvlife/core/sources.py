"""Upstream sources: what a prompt's tokens were built from.

A RAG pipeline or an agent loop builds a prompt from segments: a system prompt, retrieved
documents, tool outputs, user turns. Each segment comes from a :class:`Source` at a
version (``doc:42@3``). A chunk of KV depends on the sources of every token up to its
end (attention reads all of them), so when a source changes, exactly the chunks that
depend on its old version are stale. This module holds the value types and the rule
"which sources does a chunk depend on" (:func:`dependent`, :func:`chunk_sources`); the
chunk identity (:mod:`kvlife.core.identity` hashes them into the key) and the
invalidation by source (:mod:`kvlife.store.invalidation`) build on it.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import blake3

from kvlife.core.errors import InvalidArgument

MAX_VERSION = 1 << 64
"""Versions are in ``[0, MAX_VERSION)``."""

MAX_SOURCE_NAME = 256
"""Bytes of a source's name in UTF-8 (names travel in keys and on the wire)."""

_HEAD = struct.Struct("<HQ")


@dataclass(frozen=True, slots=True, order=True)
class Source:
    """One upstream input at one version: ``Source("doc:42", 3)`` is ``doc:42@3``."""

    name: str
    version: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidArgument(f"a source's name must be a non-empty str, got {self.name!r}")
        try:  # strictly, as the key encodes it: a lone surrogate is not UTF-8
            raw = self.name.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidArgument(f"a source's name must be UTF-8 text: {exc}") from None
        if len(raw) > MAX_SOURCE_NAME:
            raise InvalidArgument(
                f"source name {self.name[:40]!r}... is {len(raw)} bytes, over {MAX_SOURCE_NAME}"
            )
        if "\0" in self.name or "@" in self.name:
            raise InvalidArgument(f"a source's name may not hold NUL or '@': {self.name!r}")
        if isinstance(self.version, bool) or not isinstance(self.version, int):
            raise InvalidArgument(
                f"source {self.name!r}: version must be an int, got {self.version!r}"
            )
        if not 0 <= self.version < MAX_VERSION:
            raise InvalidArgument(f"source {self.name!r}: version {self.version} out of [0, 2**64)")

    def encoded(self) -> bytes:
        """Canonical bytes (what a chunk key hashes): length, version, UTF-8 name."""
        raw = self.name.encode("utf-8")
        return _HEAD.pack(len(raw), self.version) + raw

    @classmethod
    def parse(cls, text: str) -> Source:
        """``"doc:42@3"`` -> ``Source("doc:42", 3)``; no ``@`` means version 0."""
        if not isinstance(text, str):
            raise InvalidArgument(f"a source must be written as name@version, got {text!r}")
        name, sep, version = text.rpartition("@")
        if not sep:
            return cls(text, 0)
        if not version.isdigit():
            raise InvalidArgument(f"source {text!r}: version {version!r} is not a number")
        return cls(name, int(version))

    def __str__(self) -> str:
        return f"{self.name}@{self.version}"


@dataclass(frozen=True, slots=True)
class SourceSpan:
    """The tokens ``[start, end)`` of one prompt that came from ``source``.

    A prompt declares its spans in order; a chunk ending at token ``e`` depends on every
    span that starts before ``e`` (attention reads every earlier token)."""

    source: Source
    start: int
    end: int

    def __post_init__(self) -> None:
        if not isinstance(self.source, Source):
            raise InvalidArgument(f"a span's source must be a Source, got {self.source!r}")
        for name in ("start", "end"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgument(f"span of {self.source}: {name} must be an int >= 0")
        if self.end <= self.start:
            raise InvalidArgument(
                f"span of {self.source}: end {self.end} must be after start {self.start}"
            )


SOURCES_TAG = b"kvlife.sources.v1\0"
"""Prefix of the per-chunk sources section of a chunk key (:mod:`kvlife.core.identity`)."""

MAX_SPANS = 1024
"""Spans one prompt may declare (they travel in every put and lookup of it)."""


def check_spans(spans: object) -> tuple[SourceSpan, ...]:
    """``spans`` as a tuple of SourceSpan: a sequence (not a str or bytes) of SourceSpan
    only, at most :data:`MAX_SPANS`; InvalidArgument naming the bad item otherwise.
    Spans may overlap and come in any order (a chunk depends on a span by its start)."""
    if isinstance(spans, (str, bytes, bytearray)) or not isinstance(spans, Sequence):
        raise InvalidArgument(
            f"sources must be a sequence of SourceSpan, got {type(spans).__name__}"
        )
    if len(spans) > MAX_SPANS:
        raise InvalidArgument(f"{len(spans)} source spans in one prompt; at most {MAX_SPANS}")
    for i, span in enumerate(spans):
        if not isinstance(span, SourceSpan):
            raise InvalidArgument(
                f"sources[{i}] must be a SourceSpan, got {type(span).__name__} {span!r:.80}"
            )
    return tuple(spans)


def dependent(spans: Sequence[SourceSpan], end: int) -> tuple[Source, ...]:
    """The sources a chunk ending at absolute position ``end`` depends on: those of
    every span that starts before ``end``, sorted and without repeats (the canonical
    set a key hashes and a record keeps)."""
    return tuple(sorted({s.source for s in spans if s.start < end}))


def chunk_sources(
    spans: Sequence[SourceSpan], start: int, chunks: int, tokens_per_chunk: int
) -> list[tuple[Source, ...]]:
    """:func:`dependent` for each of ``chunks`` chunks of ``tokens_per_chunk`` tokens
    from absolute position ``start``, in one pass over the spans sorted by start (the
    same tuple object while no new span begins: a prompt's chunks share them)."""
    order = sorted(spans, key=lambda s: s.start)
    out: list[tuple[Source, ...]] = []
    have: set[Source] = set()
    current: tuple[Source, ...] = ()
    j = 0
    for i in range(chunks):
        end = start + (i + 1) * tokens_per_chunk
        grew = False
        while j < len(order) and order[j].start < end:
            if order[j].source not in have:
                have.add(order[j].source)
                grew = True
            j += 1
        if grew:
            current = tuple(sorted(have))
        out.append(current)
    return out


def sources_digest(sources: Sequence[Source]) -> bytes:
    """BLAKE3 of the canonical encoding of a chunk's dependent sources (count, then
    each :meth:`Source.encoded`), 32 bytes: what a chunk key hashes for them."""
    parts = [struct.pack("<I", len(sources))]
    parts += [s.encoded() for s in sources]
    return bytes(blake3.blake3(b"".join(parts)).digest())


def covers_version(source: Source, name: str, versions: tuple[int, int]) -> bool:
    """Whether ``source`` is ``name`` at a version in ``[lo, hi)``."""
    return source.name == name and versions[0] <= source.version < versions[1]

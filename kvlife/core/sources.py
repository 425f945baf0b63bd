"""Upstream sources: what a prompt's tokens were built from.

A RAG pipeline or an agent loop builds a prompt from segments: a system prompt, retrieved
documents, tool outputs, user turns. Each segment comes from a :class:`Source` at a
version (``doc:42@3``). A chunk of KV depends on the sources of every token up to its
end (attention reads all of them), so when a source changes, exactly the chunks that
depend on its old version are stale. This module holds the value type only; the chunk
identity and the invalidation by source build on it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvlife.core.errors import InvalidArgument

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
        raw = self.name.encode("utf-8", "surrogatepass")
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
        if not 0 <= self.version < 1 << 64:
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

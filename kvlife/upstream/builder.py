"""The prompt builder: how an application declares where each part of its prompt came from.

A RAG pipeline or an agent loop assembles a prompt from segments (a system prompt,
retrieved documents ``d@v``, tool outputs ``t@v``, user turns ``u@v``). It tells
:class:`PromptBuilder` each segment's :class:`~kvlife.core.sources.Source` and content,
and gets back a :class:`BuiltPrompt`: the token ids, one
:class:`~kvlife.core.sources.SourceSpan` per segment, and the segments themselves. The
spans are what the store hashes into chunk keys (so a chunk depends on the sources of
its tokens, and ``invalidate(source=...)`` finds it); the segments are what segment
reuse (:mod:`kvlife.upstream.blend`) looks up when the order changes.

Each segment is tokenised on its own and the prompt is their concatenation, so a
segment's tokens are the same wherever it sits: the condition for reusing its KV at
another position, and the reason a span's boundaries are exact.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Self

from kvlife.core.errors import InvalidArgument
from kvlife.core.sources import Source, SourceSpan

Tokenize = Callable[[str], Sequence[int]]
"""Text to token ids (no special tokens added: segments are concatenated as they are)."""


class SegmentKind(enum.Enum):
    """What a segment is, for reports and for an application's own rules."""

    SYSTEM = "system"
    DOCUMENT = "document"
    TOOL = "tool"
    USER = "user"
    ASSISTANT = "assistant"
    QUERY = "query"


@dataclass(frozen=True, slots=True)
class Segment:
    """One declared part of a prompt: its source at a version, its kind and its tokens."""

    source: Source
    kind: SegmentKind
    tokens: tuple[int, ...]
    """Token ids of this segment alone (never empty)."""

    def __post_init__(self) -> None:
        if not isinstance(self.source, Source):
            raise InvalidArgument(f"a segment's source must be a Source, got {self.source!r}")
        if not isinstance(self.kind, SegmentKind):
            raise InvalidArgument(f"segment {self.source}: kind must be a SegmentKind")
        if not self.tokens:
            raise InvalidArgument(f"segment {self.source} has no tokens")
        for t in self.tokens:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise InvalidArgument(f"segment {self.source}: token {t!r} is not an int >= 0")


@dataclass(frozen=True, slots=True)
class BuiltPrompt:
    """A prompt with its provenance: ``spans[i]`` covers ``segments[i]``'s tokens."""

    tokens: tuple[int, ...]
    segments: tuple[Segment, ...]
    spans: tuple[SourceSpan, ...]

    @property
    def sources(self) -> tuple[Source, ...]:
        return tuple(s.source for s in self.segments)

    def provenance(self) -> list[tuple[Source, int]]:
        """Per token, the source it came from and the token id: what an oracle compares
        to decide whether KV computed for one prompt is valid for another."""
        out: list[tuple[Source, int]] = []
        for seg in self.segments:
            out += [(seg.source, t) for t in seg.tokens]
        return out

    def first_change(self, previous: BuiltPrompt) -> int:
        """The first token position where this prompt and ``previous`` differ in token
        id or in the source (name and version) it came from; ``len(self.tokens)`` when
        this prompt is ``previous`` or extends it. Everything before it may reuse
        ``previous``'s KV exactly; nothing from it on may."""
        mine, theirs = self.provenance(), previous.provenance()
        n = min(len(mine), len(theirs))
        for i in range(n):
            if mine[i] != theirs[i]:
                return i
        return n

    def span_of(self, name: str) -> SourceSpan:
        """The span of the segment whose source is called ``name``."""
        for span in self.spans:
            if span.source.name == name:
                return span
        raise InvalidArgument(f"no segment of source {name!r} in this prompt")


class PromptBuilder:
    """Declare segments in prompt order, then :meth:`build`.

    ``tokenize`` turns a segment's text into ids (for a transformers tokenizer:
    ``lambda s: tok(s, add_special_tokens=False)["input_ids"]``); segments may also be
    given as ids. A source name may appear once per prompt (a chunk's identity would not
    say which of two copies it depends on).
    """

    def __init__(self, tokenize: Tokenize | None = None) -> None:
        self._tokenize = tokenize
        self._segments: list[Segment] = []

    def add(self, kind: SegmentKind, source: Source | str, content: str | Sequence[int]) -> Self:
        """Append one segment; ``source`` as a Source or as ``"name@version"``."""
        src = source if isinstance(source, Source) else Source.parse(source)
        if any(s.source.name == src.name for s in self._segments):
            raise InvalidArgument(f"source {src.name!r} already has a segment in this prompt")
        if isinstance(content, str):
            if self._tokenize is None:
                raise InvalidArgument(
                    f"segment {src}: text given but the builder has no tokenizer; pass ids"
                )
            ids = tuple(int(t) for t in self._tokenize(content))
        else:
            ids = tuple(content)
        self._segments.append(Segment(src, kind, ids))
        return self

    def system(self, content: str | Sequence[int], source: Source | str = "system") -> Self:
        return self.add(SegmentKind.SYSTEM, source, content)

    def document(self, source: Source | str, content: str | Sequence[int]) -> Self:
        return self.add(SegmentKind.DOCUMENT, source, content)

    def tool(self, source: Source | str, content: str | Sequence[int]) -> Self:
        return self.add(SegmentKind.TOOL, source, content)

    def user(self, source: Source | str, content: str | Sequence[int]) -> Self:
        return self.add(SegmentKind.USER, source, content)

    def query(self, source: Source | str, content: str | Sequence[int]) -> Self:
        return self.add(SegmentKind.QUERY, source, content)

    def build(self) -> BuiltPrompt:
        """The prompt so far (the builder can go on adding segments after)."""
        if not self._segments:
            raise InvalidArgument("a prompt needs at least one segment")
        return build(self._segments)


def build(segments: Sequence[Segment]) -> BuiltPrompt:
    """A :class:`BuiltPrompt` of ``segments`` in this order (names must be distinct)."""
    names = [s.source.name for s in segments]
    if len(set(names)) != len(names):
        raise InvalidArgument(f"source names repeat in one prompt: {names}")
    tokens: list[int] = []
    spans: list[SourceSpan] = []
    for seg in segments:
        start = len(tokens)
        tokens += seg.tokens
        spans.append(SourceSpan(seg.source, start, len(tokens)))
    return BuiltPrompt(tuple(tokens), tuple(segments), tuple(spans))

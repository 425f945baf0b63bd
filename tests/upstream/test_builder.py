"""The prompt builder's invariants (hypothesis): spans cover the tokens in order, a
changed version changes only the spans from its segment on, and ``first_change`` is the
first token whose KV may not be reused; the stale oracle catches stale reuse."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.core.errors import InvalidArgument
from kvlife.core.sources import Source
from kvlife.upstream.builder import PromptBuilder, Segment, SegmentKind, build
from kvlife.upstream.oracle import StaleOracle

_segments = st.lists(
    st.tuples(
        st.sampled_from(list(SegmentKind)),
        st.integers(0, 5),
        st.lists(st.integers(0, 1000), min_size=1, max_size=12),
    ),
    min_size=1,
    max_size=7,
)


def _make(spec: list[tuple[SegmentKind, int, list[int]]]) -> list[Segment]:
    return [Segment(Source(f"s{i}", v), k, tuple(ids)) for i, (k, v, ids) in enumerate(spec)]


@settings(max_examples=80, deadline=None)
@given(_segments)
def test_spans_cover_the_tokens_in_order(spec: list[tuple[SegmentKind, int, list[int]]]) -> None:
    segs = _make(spec)
    p = build(segs)
    assert len(p.spans) == len(segs)
    pos = 0
    for span, seg in zip(p.spans, segs, strict=True):
        assert span.start == pos and span.source == seg.source
        assert p.tokens[span.start : span.end] == seg.tokens
        pos = span.end
    assert pos == len(p.tokens)
    assert [t for _, t in p.provenance()] == list(p.tokens)


@settings(max_examples=80, deadline=None)
@given(_segments, st.data())
def test_a_changed_version_changes_only_the_spans_from_there_on(
    spec: list[tuple[SegmentKind, int, list[int]]], data: st.DataObject
) -> None:
    segs = _make(spec)
    i = data.draw(st.integers(0, len(segs) - 1))
    new_ids = data.draw(
        st.one_of(st.just(segs[i].tokens), st.lists(st.integers(0, 1000), min_size=1, max_size=12))
    )
    old = build(segs)
    changed = list(segs)
    src = segs[i].source
    changed[i] = Segment(Source(src.name, src.version + 1), segs[i].kind, tuple(new_ids))
    new = build(changed)
    assert new.spans[:i] == old.spans[:i]
    assert new.spans[i].source != old.spans[i].source
    assert new.spans[i].start == old.spans[i].start
    shift = len(new_ids) - len(segs[i].tokens)
    for a, b in zip(old.spans[i + 1 :], new.spans[i + 1 :], strict=True):
        assert (b.source, b.start, b.end) == (a.source, a.start + shift, a.end + shift)
    # a new version is a change even where the text is the same
    assert new.first_change(old) == old.spans[i].start
    assert old.first_change(old) == len(old.tokens)


def test_appending_keeps_the_whole_earlier_prompt_reusable() -> None:
    b = PromptBuilder().system([1, 2, 3]).user("u@0", [4, 5])
    first = b.build()
    second = b.tool("t@1", [6, 7]).build()
    assert second.first_change(first) == len(first.tokens)
    assert second.span_of("t").start == len(first.tokens)


def test_bad_segments_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="already has a segment"):
        PromptBuilder().document("d@1", [1]).document("d@2", [2])
    with pytest.raises(InvalidArgument, match="no tokens"):
        PromptBuilder().document("d@1", [])
    with pytest.raises(InvalidArgument, match="no tokenizer"):
        PromptBuilder().document("d@1", "text")
    with pytest.raises(InvalidArgument, match="at least one"):
        PromptBuilder().build()
    with pytest.raises(InvalidArgument, match="not an int"):
        PromptBuilder().document("d@1", [1, -2])
    words = PromptBuilder(lambda s: [len(w) for w in s.split()]).document("d@1", "ab c").build()
    assert words.tokens == (2, 1)


def test_the_oracle_counts_stale_prefix_and_segment_reuse() -> None:
    old = PromptBuilder().system([1, 2]).document("d@1", [3, 4]).build()
    new = PromptBuilder().system([1, 2]).document("d@2", [3, 4]).build()
    o = StaleOracle()
    o.prefix_reused(new.provenance(), old.provenance(), 2)
    assert (o.reused_tokens, o.stale_tokens) == (2, 0)
    o.prefix_reused(new.provenance(), old.provenance(), 4)  # d@1's KV served for d@2
    assert o.stale_tokens == 2 and "d@2" in o.events[0]
    o.segment_reused(new.provenance(), 2, old.provenance()[2:])
    assert o.stale_tokens == 4
    o.segment_reused(new.provenance(), 2, new.provenance()[2:])
    assert (o.reused_tokens, o.stale_tokens) == (10, 4)

"""Upstream-aware reuse for RAG pipelines and agent loops (issue 26, application side).

:mod:`~kvlife.upstream.builder` lets an application declare the segments of a prompt
and their sources; :mod:`~kvlife.upstream.sourced` is the one place that hands those
sources to the store (chunk keys and ``invalidate(source=...)``);
:mod:`~kvlife.upstream.rope` and :mod:`~kvlife.upstream.blend` reuse a segment's KV at
another position (re-rotated keys plus a bounded selective recompute, CacheBlend-style),
a lossy replica served only where a lookup's ``Accept`` takes it;
:mod:`~kvlife.upstream.oracle` counts stale KV served.
"""

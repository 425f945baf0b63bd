"""Segment replicas: a segment's KV kept for reuse at any position, served only as lossy.

A :class:`SegmentCache` keeps, per model and namespace, the KV of segments (a source at
a version and its exact token ids) as computed at some position. Reusing one elsewhere
(re-rotated by :mod:`kvlife.upstream.rope`, blended by :mod:`kvlife.upstream.blend`)
gives KV that is not what a full prefill computes, so every segment replica has the
contract of the ``segment-blend`` representation: :attr:`Exactness.LOSSY
<kvlife.transforms.base.Exactness>`, no element-wise bound, and the mean KL measured by
``kvlife experiment upstream`` at its recompute ratio (:data:`MEASURED_KL`). A lookup
states what it accepts with the same :class:`~kvlife.transforms.contract.Accept` as a
store lookup: ``Accept.EXACT`` (the default) and ``Accept.LOSSLESS`` never get a segment
hit, ``Accept.lossy(max_kl=...)`` only where the measured KL is within it. The exact
prefix path (the store's chunks) stays the default.

The key is the namespace, the source at its version and the digest of its token ids,
so a new version of a source or other text is never served an old segment; a new
version also makes :meth:`SegmentCache.invalidate` drop the old ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import blake3
import numpy as np
from numpy.typing import NDArray

from kvlife.core.errors import InvalidArgument, LayoutMismatch
from kvlife.core.identity import ModelIdentity, Namespace, token_bytes
from kvlife.core.sources import Source, SourceSpan
from kvlife.transforms.base import Exactness
from kvlife.transforms.contract import Accept, Contract
from kvlife.upstream.blend import DEFAULT_RATIO, ReusedSpan
from kvlife.upstream.builder import BuiltPrompt, Segment

SEGMENT_BLEND = "segment-blend"
"""The representation's name in contracts (and in an ``Accept``'s ``transforms``)."""
SEGMENT_BLEND_VERSION = 1

MEASURED_KL: dict[float, float] = {0.15: 0.080}
"""KL(exact || blended) of the first output token's distribution per recompute ratio:
the worst of the three workloads' means measured on SmolLM2-135M by ``kvlife experiment
upstream`` on 2026-12-02 (rag 0.080, agent 0.004, edits 0.003; docs/upstream.md). A
ratio not here has no measured KL, and a lookup that bounds KL refuses it."""


def segment_contract(ratio: float) -> Contract:
    """The contract of a segment replica blended with ``ratio`` recomputed."""
    return Contract(
        SEGMENT_BLEND, SEGMENT_BLEND_VERSION, Exactness.LOSSY, None, MEASURED_KL.get(ratio)
    )


@dataclass(frozen=True, slots=True)
class SegmentReplica:
    """One segment's KV as computed at ``computed_at``."""

    source: Source
    tokens: tuple[int, ...]
    computed_at: int
    """Absolute position of the segment's first token when its KV was computed."""
    kv: NDArray[np.float32]
    """``(layers, 2, kv_heads, T, head_dim)``, read-only (a private copy)."""

    @property
    def provenance(self) -> list[tuple[Source, int]]:
        return [(self.source, t) for t in self.tokens]


@dataclass(frozen=True, slots=True)
class SegmentHit:
    """A replica to place at ``span`` of the prompt looked up."""

    span: SourceSpan
    replica: SegmentReplica

    @property
    def delta(self) -> int:
        """Positions to move the replica's keys by."""
        return self.span.start - self.replica.computed_at


@dataclass(frozen=True, slots=True)
class SegmentLookup:
    hits: list[SegmentHit]
    refused: str
    """Why the cache's replicas were not offered (empty when they were)."""


@dataclass(slots=True)
class SegmentCounters:
    puts: int = 0
    hits: int = 0
    refused_lookups: int = 0
    invalidated: int = 0


@dataclass
class SegmentCache:
    """In-process segment replicas of one model (see the module docstring)."""

    identity: ModelIdentity
    ratio: float = DEFAULT_RATIO
    """Recompute ratio the replicas are blended with (their contract's KL is for it)."""
    counters: SegmentCounters = field(default_factory=SegmentCounters)
    _replicas: dict[tuple[bytes, Source, bytes], SegmentReplica] = field(
        default_factory=dict, init=False, repr=False
    )

    @property
    def contract(self) -> Contract:
        return segment_contract(self.ratio)

    def _key(self, namespace: Namespace, segment: Segment) -> tuple[bytes, Source, bytes]:
        return (namespace.salt, segment.source, blake3.blake3(token_bytes(segment.tokens)).digest())

    def put(
        self, namespace: Namespace, segment: Segment, computed_at: int, kv: NDArray[np.generic]
    ) -> None:
        """Keep ``kv`` (copied) as ``segment``'s KV computed at ``computed_at``."""
        lay = self.identity.layout
        want = (lay.num_layers, 2, lay.num_kv_heads, len(segment.tokens), lay.head_dim)
        if tuple(kv.shape) != want:
            raise LayoutMismatch(f"segment {segment.source}: KV {kv.shape}, expected {want}")
        if isinstance(computed_at, bool) or not isinstance(computed_at, int) or computed_at < 0:
            raise InvalidArgument(f"segment {segment.source}: computed_at must be an int >= 0")
        own = np.array(kv, dtype=np.float32, copy=True)
        own.flags.writeable = False
        self._replicas[self._key(namespace, segment)] = SegmentReplica(
            segment.source, segment.tokens, computed_at, own
        )
        self.counters.puts += 1

    def lookup(
        self, namespace: Namespace, prompt: BuiltPrompt, accept: Accept = Accept.EXACT
    ) -> SegmentLookup:
        """Replicas for the prompt's segments, where ``accept`` takes a segment replica's
        contract; none otherwise (the caller computes exactly)."""
        refusal = accept.refusal(self.contract)
        if refusal:
            self.counters.refused_lookups += 1
            return SegmentLookup([], refusal)
        hits: list[SegmentHit] = []
        for seg, span in zip(prompt.segments, prompt.spans, strict=True):
            rep = self._replicas.get(self._key(namespace, seg))
            if rep is not None:
                hits.append(SegmentHit(span, rep))
        self.counters.hits += len(hits)
        return SegmentLookup(hits, "")

    def invalidate(self, source: str, before_version: int | None = None) -> int:
        """Drop the replicas of source ``source`` (all versions, or those below
        ``before_version``); returns how many."""
        gone = [
            k
            for k in self._replicas
            if k[1].name == source and (before_version is None or k[1].version < before_version)
        ]
        for k in gone:
            del self._replicas[k]
        self.counters.invalidated += len(gone)
        return len(gone)

    def __len__(self) -> int:
        return len(self._replicas)


def reused_spans(hits: Sequence[SegmentHit], inv_freq: object) -> list[ReusedSpan]:
    """The hits as :class:`~kvlife.upstream.blend.ReusedSpan`, keys moved into place."""
    import torch

    from kvlife.upstream.rope import move_kv

    out: list[ReusedSpan] = []
    for h in hits:
        kv = torch.from_numpy(np.array(h.replica.kv))
        out.append(ReusedSpan(h.span.start, move_kv(kv, h.delta, inv_freq)))
    return out

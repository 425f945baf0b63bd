"""Chunks stored as layer groups, and a transformers cache that takes each layer's
loaded prefix only when that layer's group has landed (layer-by-layer injection).

A chunk's KV is ``(layers, 2, kv_heads, tokens, head_dim)``. Stored as one object, a
load must read and verify all of it before the engine can use any layer. Stored as
``G`` layer-group objects, group ``g`` holding the contiguous layers
:func:`layer_groups` gives it, the engine can start the forward of the rest of the
prompt as soon as group 0 has landed and verified: attention of layer ``l`` waits only
for group ``g(l)``.

Each group object is a full kvlife object with its own identity and its own checksum.
The identity reuses the pipeline-stage fields of :class:`~kvlife.core.identity.KVLayout`
(``pp_rank``, ``pp_size``, ``first_layer`` with ``num_layers``): a pipeline stage and a
layer group are the same thing to the store, a contiguous run of a model's layers, and
those fields already make the layers an object holds part of its key. Nothing is added
to the key format: ``G = 1`` is the whole-chunk identity itself (keys of existing stores
stay valid), and group ``g`` of ``G`` has the key a pipeline stage ``g`` of ``G`` with
those layers would have, whose bytes are the same (same model, tokens, positions; the
engine digest tells engines apart).

A chunk is usable only when every group of it is: :func:`lookup_groups` answers the
minimum over groups. A put prepares every group before it commits any
(:func:`put_groups`); a group committed before another failed is never served alone,
since the lookup takes the minimum.

:class:`LandingCache` is a ``DynamicCache`` whose layers report the prefix's length
before it is there (the mask and positions are built from it) and whose first
``update`` of layer ``l`` calls ``land(l)``: that waits for the layer's group, then
returns the layer's prefix KV, which the layer takes before appending the new tokens.
``land`` raises when the group cannot be had (missing, corrupt, past its deadline): the
forward is then abandoned, since the layers before it already attended to the loaded
prefix; the caller recomputes (:class:`~kvlife.engines.hf_plan.PlannedEngine`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from kvlife.core.errors import InvalidArgument, LayoutMismatch
from kvlife.core.identity import ModelIdentity, Namespace
from kvlife.results import ChunkHit, LookupResult
from kvlife.store import KVStore

Land = Callable[[int], tuple[Any, Any]]
"""``land(layer)``: wait for the layer's group and return its prefix (keys, values), each
``(1, kv_heads, tokens, head_dim)``; raises :class:`GroupUnavailable` when it cannot."""


class GroupUnavailable(Exception):
    """A layer group of the loaded prefix did not land whole (missing, corrupt, past its
    deadline): the forward that was waiting for it is abandoned."""

    def __init__(self, group: int, layer: int, landed: int, timed_out: bool) -> None:
        why = "ran past its deadline" if timed_out else "ended at a miss"
        super().__init__(f"layer group {group} (layer {layer}) {why} after {landed} chunks")
        self.group = group
        self.layer = layer
        self.landed = landed
        self.timed_out = timed_out


def layer_groups(num_layers: int, groups: int) -> tuple[tuple[int, int], ...]:
    """``(first layer, layer count)`` of each of ``groups`` contiguous groups covering
    ``num_layers`` layers, sizes differing by at most one (the first ones larger)."""
    if not isinstance(groups, int) or isinstance(groups, bool) or not 1 <= groups <= num_layers:
        raise InvalidArgument(
            f"layer groups must be an int in [1, {num_layers}] (the model's layers), got {groups!r}"
        )
    base, extra = divmod(num_layers, groups)
    out, first = [], 0
    for g in range(groups):
        n = base + (1 if g < extra else 0)
        out.append((first, n))
        first += n
    return tuple(out)


def group_identities(identity: ModelIdentity, groups: int) -> tuple[ModelIdentity, ...]:
    """The identity of each layer group of ``identity``'s chunks: the identity itself
    for one group, else its layout narrowed to the group's layers as a pipeline stage
    (``pp_rank = g``, ``pp_size = groups``, ``first_layer``, ``num_layers``)."""
    lay = identity.layout
    spans = layer_groups(lay.num_layers, groups)
    if groups == 1:
        return (identity,)
    if lay.staged:
        raise InvalidArgument(
            f"identity {identity.model_id!r} already names pipeline stage {lay.pp_rank} of "
            f"{lay.pp_size}; its layers are not split into groups again"
        )
    return tuple(
        replace(
            identity,
            layout=replace(lay, num_layers=n, pp_rank=g, pp_size=groups, first_layer=first),
        )
        for g, (first, n) in enumerate(spans)
    )


def layer_group_index(num_layers: int, groups: int) -> tuple[int, ...]:
    """The group of each layer."""
    out: list[int] = []
    for g, (_, n) in enumerate(layer_groups(num_layers, groups)):
        out += [g] * n
    return tuple(out)


def lookup_groups(
    store: KVStore,
    identities: Sequence[ModelIdentity],
    namespace: Namespace,
    ids: Sequence[int],
    start: int,
) -> tuple[LookupResult, ...]:
    """Each group's lookup, every one cut to the shortest run (a chunk is usable only when
    every group of it is indexed)."""
    found = [store.lookup(ident, namespace, list(ids), start=start) for ident in identities]
    usable = min(len(f.hits) for f in found)
    return tuple(f.sub(0, usable) for f in found)


def combined_hits(found: Sequence[LookupResult]) -> list[ChunkHit]:
    """One hit per chunk for the planner: group 0's hit with the bytes (stored, decoded)
    and decode time of every group summed. The tier is group 0's (the groups of a chunk
    are put together, so they sit in one tier unless an eviction split them)."""
    if len(found) == 1:
        return list(found[0].hits)
    out = []
    for parts in zip(*(f.hits for f in found), strict=True):
        out.append(
            replace(
                parts[0],
                stored_nbytes=sum(p.stored_nbytes for p in parts),
                decode_nbytes=sum(p.decode_nbytes for p in parts),
                decode_seconds=sum(p.decode_seconds for p in parts),
            )
        )
    return out


def group_views(
    buf: np.ndarray, spans: Sequence[tuple[int, int]], count: int, tpc: int
) -> list[list[np.ndarray]]:
    """Per group, the landing view of each of ``count`` chunks in ``buf`` (layers, 2,
    heads, count * tpc, dim): the group's layers of the chunk's positions."""
    return [
        [buf[first : first + n, :, :, i * tpc : (i + 1) * tpc, :] for i in range(count)]
        for first, n in spans
    ]


def put_groups(
    store: KVStore,
    identities: Sequence[ModelIdentity],
    namespace: Namespace,
    ids: Sequence[int],
    chunks: Sequence[np.ndarray],
    *,
    start: int,
    request_id: str,
) -> int:
    """Store each full chunk (``(layers, 2, heads, tpc, dim)`` arrays) as one object per
    layer group: every group is prepared (validated, TENTATIVE) before any commits, and a
    failure aborts the groups not yet committed. Returns the chunks newly stored in some
    group."""
    if not chunks:
        return 0
    # the groups' layers, from their identities: every chunk must hold all of them (a
    # chunk's extra layers would be cut off by the slices below, not refused, and the
    # groups would store a chunk the whole-chunk put refuses)
    layers = sum(ident.layout.num_layers for ident in identities)
    for i, c in enumerate(chunks):
        if np.ndim(c) < 1 or int(np.shape(c)[0]) != layers:
            raise LayoutMismatch(
                f"chunk {i} has shape {tuple(np.shape(c))}; its {len(identities)} layer "
                f"groups hold {layers} layers (layers, k/v, kv_heads, tokens_per_chunk, "
                "head_dim)"
            )
    spans = layer_groups(layers, len(identities))
    pending: list[Any] = []
    try:
        for ident, (first, n) in zip(identities, spans, strict=True):
            parts = [c[first : first + n] for c in chunks]
            pending.append(
                store.prepare_put(
                    ident, namespace, list(ids), parts, start=start, request_id=request_id
                )
            )
    except BaseException:
        for p in pending:
            store.abort_put(p, "another layer group of the put was refused")
        raise
    stored = 0
    for i, p in enumerate(pending):
        try:
            stored = max(stored, store.commit_put(p).stored)
        except BaseException:
            for rest in pending[i + 1 :]:
                store.abort_put(rest, "another layer group of the put failed")
            raise
    return stored


@functools.cache
def _landing_layer_type() -> type:
    from transformers.cache_utils import DynamicLayer

    class LandingLayer(DynamicLayer):  # type: ignore[misc]
        """A layer whose prefix is still landing: it reports the prefix's length and
        takes the prefix (``land(layer)``) at its first update."""

        def __init__(self, layer: int, tokens: int, land: Land) -> None:
            super().__init__()
            self._layer = layer
            self._tokens = tokens
            self._land: Land | None = land

        def get_seq_length(self) -> int:
            if self._land is not None:
                return self._tokens
            return int(super().get_seq_length())

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> Any:
            if self._land is not None:
                keys, values = self._land(self._layer)
                self._land = None  # taken: from here on a plain dynamic layer
                self.lazy_initialization(keys, values)
                self.keys, self.values = keys, values
            return super().update(key_states, value_states, *args, **kwargs)

    return LandingLayer


def landing_cache(config: Any, num_layers: int, tokens: int, land: Land) -> Any:
    """A ``DynamicCache`` for ``config`` whose every layer holds ``tokens`` positions of
    prefix that ``land(layer)`` hands over at the layer's first update. Only models whose
    layers are all plain (full-attention) dynamic layers are supported."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=config)
    if len(cache.layers) != num_layers or any(type(x) is not DynamicLayer for x in cache.layers):
        from kvlife.engines.errors import UnsupportedModel

        raise UnsupportedModel(
            "layer-by-layer injection needs a cache of plain full-attention layers; this "
            f"model's are {sorted({type(x).__name__ for x in cache.layers})}"
        )
    kind = _landing_layer_type()
    cache.layers = [kind(layer, tokens, land) for layer in range(num_layers)]
    return cache

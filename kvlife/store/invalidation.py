"""Invalidation by model version, adapter, namespace or key prefix (criteria intersect).

The chosen objects stop being served at once (under the index lock); their replicas are
deleted in the plan order of the sequencer, and the call returns only once the deletes
are durable, so an invalidation survives a crash the moment it returns.
"""

from __future__ import annotations

from kvlife.core.errors import InvalidArgument
from kvlife.core.identity import ChunkKey, Namespace
from kvlife.core.lifecycle import Move, ObjectState
from kvlife.core.objects import TierName
from kvlife.store.core import StoreCore

SERVABLE = (ObjectState.INDEXED, ObjectState.COMMITTED)


def invalidate(
    core: StoreCore,
    *,
    weights_digest: str | None,
    adapter_id: str | None,
    namespace: Namespace | None,
    prefix: ChunkKey | None,
) -> int:
    core.check_open()
    if weights_digest is None and adapter_id is None and namespace is None and prefix is None:
        raise InvalidArgument("invalidate needs at least one criterion")
    _check(weights_digest, str, "weights_digest")
    _check(adapter_id, str, "adapter_id")
    _check(namespace, Namespace, "namespace")
    if prefix is not None and (not isinstance(prefix, bytes) or len(prefix) != 32):
        raise InvalidArgument(f"prefix must be a 32-byte chunk key, got {prefix!r:.80}")
    with core.lock:
        index = core.index
        sets: list[set[ChunkKey]] = []
        reasons: list[str] = []
        if weights_digest is not None:
            sets.append(index.by_weights(weights_digest))
            reasons.append("weights")
        if adapter_id is not None:
            sets.append(index.by_adapter(adapter_id))
            reasons.append("adapter")
        if namespace is not None:
            sets.append(index.by_namespace(str(namespace)))
            reasons.append("namespace")
        if prefix is not None:
            sets.append(set(index.subtree([ChunkKey(prefix)])))
            reasons.append("prefix")
        chosen = set.intersection(*sets)
        reason = "invalidated:" + "+".join(reasons)
        doomed: list[tuple[TierName, ChunkKey]] = []
        count = 0
        for key in chosen:
            rec = index.get(key)
            if rec is None or rec.state not in SERVABLE:
                continue  # a put still writing it decides its own fate
            doomed += core.retire(rec, Move.INVALIDATE, reason)
            count += 1
        core.counters.invalidated += count
        ticket = core.seq.take()
    with core.seq.turn(ticket):
        core.delete_replicas(doomed)
    return count


def _check(value: object, kind: type, name: str) -> None:
    if value is not None and not isinstance(value, kind):
        raise InvalidArgument(f"{name} must be a {kind.__name__}, got {type(value).__name__}")

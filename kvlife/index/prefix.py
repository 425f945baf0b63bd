"""The in-memory index of objects: by key, by parent (prefix tree), by model, model
version, adapter, namespace and upstream source name, so that lookups are dict probes
and invalidation finds its victims without a scan.

The prefix tree is gap-safe: the edge from a parent to a child outlives both records, so
"this chunk and every chunk chained after it" reaches chunks behind a missing one (a
chunk dropped as corrupt or evicted, whose children are still indexed). An edge is
dropped only when neither end can lead to an indexed record any more.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import TypeVar

from kvlife.core.identity import ChunkKey
from kvlife.core.objects import ObjectRecord

N = TypeVar("N", str, bytes)


class ObjectIndex:
    """Records by key plus secondary indexes. Not thread-safe: the store holds its lock."""

    def __init__(self) -> None:
        self._records: dict[ChunkKey, ObjectRecord] = {}
        self._children: defaultdict[bytes, set[ChunkKey]] = defaultdict(set)
        """parent key -> child keys, kept for absent parents and children alike."""
        self._parent: dict[ChunkKey, bytes] = {}
        """child key -> parent key, for every key with an edge."""
        self._by_weights: defaultdict[str, set[ChunkKey]] = defaultdict(set)
        self._by_adapter: defaultdict[str, set[ChunkKey]] = defaultdict(set)
        self._by_namespace: defaultdict[str, set[ChunkKey]] = defaultdict(set)
        self._by_model: defaultdict[str, set[ChunkKey]] = defaultdict(set)
        self._by_source: defaultdict[str, set[ChunkKey]] = defaultdict(set)
        """source name -> keys of the records that depend on it (at any version)."""

    def add(self, rec: ObjectRecord) -> None:
        self._records[rec.key] = rec
        info = rec.info
        parent = bytes(info.parent)
        self._children[parent].add(rec.key)
        self._parent[rec.key] = parent
        self._by_weights[info.weights_digest].add(rec.key)
        if info.adapter_id:
            self._by_adapter[info.adapter_id].add(rec.key)
        self._by_namespace[info.namespace].add(rec.key)
        self._by_model[info.model_id].add(rec.key)
        for source in info.sources:
            self._by_source[source.name].add(rec.key)

    def remove(self, key: ChunkKey) -> ObjectRecord | None:
        rec = self._records.pop(key, None)
        if rec is None:
            return None
        info = rec.info
        _discard(self._by_weights, info.weights_digest, key)
        _discard(self._by_adapter, info.adapter_id, key)
        _discard(self._by_namespace, info.namespace, key)
        _discard(self._by_model, info.model_id, key)
        for source in info.sources:
            _discard(self._by_source, source.name, key)
        self._prune(key)
        return rec

    def _prune(self, key: bytes) -> None:
        """Drop the edges of absent keys that no longer lead to any child."""
        while key not in self._records and not self._children.get(key):
            self._children.pop(key, None)
            parent = self._parent.pop(ChunkKey(key), None)
            if parent is None:
                return
            _discard(self._children, parent, ChunkKey(key))
            key = parent

    def add_edge(self, child: ChunkKey, parent: bytes) -> None:
        """A link kept for an absent chunk (from a durable tier, at open)."""
        if child not in self._parent:
            self._children[parent].add(child)
            self._parent[child] = parent

    def children(self, key: bytes) -> frozenset[ChunkKey]:
        """Keys chained directly after ``key`` that the index knows (records, or absent
        keys kept for their own children)."""
        return frozenset(self._children.get(key, ()))

    def kept_edge(self, key: ChunkKey) -> bytes | None:
        """The parent of ``key`` if chunks chained after it are still indexed (the link a
        durable tier must keep when ``key``'s record goes), else None."""
        if self._children.get(key):
            return self._parent.get(key)
        return None

    def prune_edges(self) -> list[ChunkKey]:
        """Drop the links of absent keys that lead to no indexed record; returns them."""
        before = set(self._parent)
        for key in list(self._parent):
            if key not in self._records and not self._children.get(key):
                self._prune(key)
        return [k for k in before if k not in self._parent]

    def get(self, key: ChunkKey) -> ObjectRecord | None:
        return self._records.get(key)

    def get_many(self, keys: Iterable[ChunkKey]) -> list[ObjectRecord | None]:
        """``get`` of every key, in order, in one C-level pass (a lookup's probe)."""
        return list(map(self._records.get, keys))

    def __contains__(self, key: object) -> bool:
        return key in self._records

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[ObjectRecord]:
        return iter(list(self._records.values()))

    def by_weights(self, digest: str) -> set[ChunkKey]:
        return set(self._by_weights.get(digest, ()))

    def by_adapter(self, adapter_id: str) -> set[ChunkKey]:
        return set(self._by_adapter.get(adapter_id, ()))

    def by_namespace(self, namespace: str) -> set[ChunkKey]:
        return set(self._by_namespace.get(namespace, ()))

    def by_model(self, model_id: str) -> set[ChunkKey]:
        return set(self._by_model.get(model_id, ()))

    def by_source(self, name: str) -> set[ChunkKey]:
        """Keys of the records that depend on source ``name`` at any version."""
        return set(self._by_source.get(name, ()))

    def subtree(self, roots: Iterable[ChunkKey]) -> list[ChunkKey]:
        """Indexed keys among ``roots`` and every key chained after them, parents before
        children, walking through absent chunks."""
        out: list[ChunkKey] = []
        stack = list(roots)
        seen: set[ChunkKey] = set()
        while stack:
            key = stack.pop()
            if key in seen:
                continue
            seen.add(key)
            if key in self._records:
                out.append(key)
            stack.extend(self._children.get(bytes(key), ()))
        return out


def _discard(table: defaultdict[N, set[ChunkKey]], name: N, key: ChunkKey) -> None:
    members = table.get(name)
    if members is not None:
        members.discard(key)
        if not members:
            del table[name]

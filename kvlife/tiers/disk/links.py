"""Prefix links the disk tier keeps (:class:`~kvlife.tiers.base.KeepsEdges`): for every
chunk it holds, and every ancestor it was chained from, the link child key -> parent
key, so that invalidating a prefix reaches every durable descendant after a restart
whatever of its chain lived only in faster tiers or was lost.

The links are durable in the catalog's ``edges`` table and mirrored here in memory, so
:meth:`Links.parent` answers without I/O. A replica's links are written in its own
commit (the writer inserts them with its row, then calls :meth:`Links.learn` as it
publishes); a delete that drops them does so in its catalog transaction, then calls
:meth:`Links.unlearn`. The map is guarded by the tier lock; catalog writes run under
the tier's write mutex, never under the lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from kvlife.tiers.disk.catalog import Catalog


class Links:
    """The kept links of one disk tier: catalog ``edges`` plus their mirror in memory."""

    def __init__(self, catalog: Catalog, lock: threading.RLock) -> None:
        self._catalog = catalog
        self._lock = lock
        self._kept: dict[bytes, bytes] = {}

    def load(self) -> None:
        """Read the kept links from the catalog (at open)."""
        kept = dict(self._catalog.edges())
        with self._lock:
            self._kept = kept

    def parent(self, child: bytes) -> bytes | None:
        """The kept parent of ``child`` (None if no link is kept), without I/O."""
        return self._kept.get(child)

    def all(self) -> list[tuple[bytes, bytes]]:
        with self._lock:
            return list(self._kept.items())

    def keep(self, links: Sequence[tuple[bytes, bytes]]) -> None:
        """Make ``links`` durable in one catalog transaction (under the write mutex)."""
        self._catalog.keep_edges(links)
        self.learn(links)

    def forget(self, children: Sequence[bytes]) -> None:
        """Drop the kept links of ``children`` in one transaction (under the write mutex)."""
        self._catalog.forget_edges(children)
        self.unlearn(children)

    def learn(self, links: Iterable[tuple[bytes, bytes]]) -> None:
        """Mirror links a catalog transaction just made durable."""
        with self._lock:
            self._kept.update(links)

    def unlearn(self, children: Iterable[bytes]) -> None:
        """Mirror links a catalog transaction just dropped."""
        with self._lock:
            for child in children:
                self._kept.pop(child, None)

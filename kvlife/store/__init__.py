"""The store: a facade (:class:`KVStore`) over a tier chain, placement, the ledger of
moves, writes, reads, invalidation, recovery and metrics, each in its own module.

- :mod:`.api` :class:`StoreAPI`, the public API both stores (``KVStore``, the served
  store's ``RemoteStore``) have, with its argument checks in :mod:`.args`;

- :mod:`.config` settings and the tier chain; :mod:`.lock` the directory lock and the
  plan sequencer; :mod:`.lifecycle` opening and closing a directory in order;
  :mod:`.core` the shared state; :mod:`.ledger` moves and events;
- :mod:`.writes` puts, write-through, flush, eviction; :mod:`.reads` lookups, loads
  (sync and async) and promotion; :mod:`.executor` runs placement plans with real I/O;
- :mod:`.forms` replica representations: encode for a transforming tier, verified
  decode of frames, decode-cost estimates;
- :mod:`.invalidation`, :mod:`.recovery`, :mod:`.metrics`.
"""

from kvlife.store.api import StoreAPI
from kvlife.store.config import GiB, MiB, StoreConfig, TierSpec
from kvlife.store.facade import KVStore
from kvlife.store.reads import LoadHandle
from kvlife.store.writes import PendingPut
from kvlife.transforms.contract import Accept

__all__ = [
    "Accept",
    "GiB",
    "KVStore",
    "LoadHandle",
    "MiB",
    "PendingPut",
    "StoreAPI",
    "StoreConfig",
    "TierSpec",
]

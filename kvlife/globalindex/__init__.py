"""The global index of a shared remote tier: publication records, leases with fencing
tokens, invalidation rules with epochs, and the health of the connection to them.

Several hosts share one remote tier. Each publishes under a lease whose fencing token
comes from Redis; every remote object carries a record with its frame header (key,
dtype, shape, xxh3-128 checksum), its full object info (identity digest, namespace,
parent, start) and the index incarnation and epoch its KV was created under.
Invalidations are rules with an epoch; a reader applies every rule newer than an
object's epoch, a record of another incarnation (an index that lost its state) is never
adopted, and a reader that cannot read the index serves nothing remote
(``docs/remote.md``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvlife.globalindex.health import Health
    from kvlife.globalindex.index import GlobalIndex, IndexConfig, IndexMismatch
    from kvlife.globalindex.lease import Lease
    from kvlife.globalindex.record import RemoteRecord
    from kvlife.globalindex.rules import InvalidationRule, RuleSync

# Imported on first use: the store imports ``globalindex.rules`` (one rule mechanism for
# local and global invalidations), and that must not need redis-py, an optional extra
# (the vLLM virtualenv has none).
_WHERE = {
    "GlobalIndex": "index",
    "Health": "health",
    "IndexConfig": "index",
    "IndexMismatch": "index",
    "InvalidationRule": "rules",
    "Lease": "lease",
    "RemoteRecord": "record",
    "RuleSync": "rules",
}


def __getattr__(name: str) -> object:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'kvlife.globalindex' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvlife.globalindex.{module}"), name)


__all__ = [
    "GlobalIndex",
    "Health",
    "IndexConfig",
    "IndexMismatch",
    "InvalidationRule",
    "Lease",
    "RemoteRecord",
    "RuleSync",
]

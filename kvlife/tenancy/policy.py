"""A store's tenancy: its principals, its keyed scopes and each principal's counters,
opened once by ``kvlife serve --tenants FILE`` (or by an embedded store's trusted
process, which then names its principal itself)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvlife.core.identity import ChunkKey, digest_bytes
from kvlife.tenancy.counters import TenantCounters
from kvlife.tenancy.principals import TenancyConfig, load_config
from kvlife.tenancy.scopes import Scopes
from kvlife.tenancy.secret import store_secret

ADMIN_VERBS = frozenset({"evict", "flush", "drain", "check", "stats"})
"""Verbs that act on (or show) the whole store: an admin principal's only (``state``, ``info`` and
``counters`` answer a tenant with its own figures instead)."""

WITHHELD = ChunkKey(digest_bytes(b"kvlife.tenancy.withheld"))
"""The key a load is given in place of a key its principal may not read: no chunk has
it (a chunk key is a BLAKE3 output of a chunk's encoding), so the load behaves exactly
as for a key that is not stored, and "not allowed" reads the same as "not present"."""


@dataclass(slots=True)
class Tenancy:
    """What a server enforces when it has principals."""

    config: TenancyConfig
    scopes: Scopes
    counters: TenantCounters = field(default_factory=TenantCounters)

    @classmethod
    def open(cls, store_dir: Path, config: TenancyConfig | Path) -> Tenancy:
        """The tenancy of the store in ``store_dir`` (its secret made on first use)."""
        if isinstance(config, Path):
            config = load_config(config)
        return cls(config, Scopes(store_secret(store_dir)))

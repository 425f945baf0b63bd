"""kvlife: a KV-cache storage layer with identity, lifecycle and crash-safe tiers.

The package's face. :class:`kvlife.store.KVStore` is the store embedded in a process;
:func:`connect` is a client of the store ``kvlife serve`` serves to many processes, with
the same public API. Nothing is imported here at module level, so importing any part of
kvlife (``kvlife.core``, a tier) does not pull in the rest.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvlife.client.remote import RemoteStore

__version__ = "0.1.0"


def connect(socket: str | Path, *, timeout: float | None = 60.0, lazy: bool = False) -> RemoteStore:
    """A client of the store that ``kvlife serve`` serves on ``socket``: the public API
    of ``KVStore``, shared by many processes (docs/server.md). StoreUnavailable if no
    server answers there; with ``lazy`` the first call connects instead, so a client may
    start before its server."""
    from kvlife.client.remote import RemoteStore

    return RemoteStore(socket, timeout=timeout, lazy=lazy)

"""Clients of ``kvlife serve``: :class:`RemoteStore` has the public API of ``KVStore``."""

from kvlife.client.handles import RemoteLoadHandle, RemoteLookup, RemotePendingPut
from kvlife.client.remote import RemoteStore

__all__ = ["RemoteLoadHandle", "RemoteLookup", "RemotePendingPut", "RemoteStore"]

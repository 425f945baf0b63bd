"""Clients of ``kvlife serve``: :class:`RemoteStore` has the public API of ``KVStore``."""

from kvlife.client.remote import RemoteLoadHandle, RemotePendingPut, RemoteStore

__all__ = ["RemoteLoadHandle", "RemotePendingPut", "RemoteStore"]

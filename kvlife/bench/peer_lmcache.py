"""LMCache's LocalDiskBackend as a side-by-side peer for ``kvlife bench io --peer lmcache``.

The I/O benchmark compares kvlife with the raw limits of the machine; this adapter runs
the same workload (same object sizes, batch and directory) through LMCache's own local
disk backend (``lmcache.v1.storage_backend.local_disk_backend.LocalDiskBackend``), so a
reader sees what a widely used KV cache reaches on the same hardware.

LMCache is never a dependency of kvlife: it is imported lazily here and only when the
peer is asked for. It needs torch and a set of pure-Python packages; one way that works
on a CPU-only machine (PyTorch's CUDA wheel runs without a GPU)::

    python -m venv peer-venv
    peer-venv/bin/pip install torch
    peer-venv/bin/pip install --no-deps lmcache
    peer-venv/bin/pip install pyyaml requests cachetools sortedcontainers numba \\
        prometheus_client py-cpuinfo psutil aiohttp aiofile msgspec pyzmq transformers \\
        cryptography blake3 xxhash msgpack tqdm
    peer-venv/bin/pip install --no-deps -e .   # kvlife itself

What the backend does, read from its source (lmcache 0.5.6), and how it is driven:

* one file per key (``<dir>/<key>.pt``), written by a pool of ``disk_io_threads``
  (default 4) with ``open``/``write``/``close``; **no fsync or fdatasync** of the file or
  its directory, so a completed put is not durable; with ``extra_config["use_odirect"]``
  the write uses O_DIRECT (the peer enables it whenever kvlife's directory supports it,
  so that both sides move bytes to the device and loads come from the device, not the
  page cache);
* loads (``batched_get_blocking``) read each file with ``readinto`` into a buffer from
  its own preallocated host pool, in parallel threads; **no checksum is stored or
  verified**: whatever bytes the file holds are returned;
* the completion of a put is observed through the ``on_complete_callback`` the backend
  calls after each file is written.

LMCache logs at INFO by default; unless ``LMCACHE_LOG_LEVEL`` is set, this module sets
it to WARNING before importing LMCache.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import itertools
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

GiB = 1 << 30

NOTES = {
    "backend": "lmcache.v1.storage_backend.local_disk_backend.LocalDiskBackend",
    "layout": "one file per key, written by a thread pool (disk_io_threads, default 4)",
    "fsync_on_store": False,
    "verifies_checksums_on_load": False,
    "evidence": (
        "LocalDiskBackend.write_file: open/write/close, no fsync; read_file: readinto, "
        "no checksum; no checksum is recorded in DiskCacheMetadata"
    ),
}
"""What the peer does and does not do, recorded in the benchmark's JSON."""


class PeerUnavailable(RuntimeError):
    """The peer cannot run here; the message says why and how to install it."""


def _import_lmcache() -> dict[str, Any]:
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    try:
        import torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_allocators.mixed_memory_allocator import MixedMemoryAllocator
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend
    except ImportError as exc:
        raise PeerUnavailable(
            f"LMCache's LocalDiskBackend cannot be imported in this interpreter ({exc}). "
            "Install lmcache beside kvlife, never as a kvlife dependency: torch, then "
            "`pip install --no-deps lmcache`, then its pure-Python imports (see the "
            "docstring of kvlife.bench.peer_lmcache for the list)."
        ) from exc
    return {
        "torch": torch,
        "CacheEngineKey": CacheEngineKey,
        "LMCacheEngineConfig": LMCacheEngineConfig,
        "MixedMemoryAllocator": MixedMemoryAllocator,
        "MemoryFormat": MemoryFormat,
        "LocalCPUBackend": LocalCPUBackend,
        "LocalDiskBackend": LocalDiskBackend,
    }


def check_available() -> str:
    """The installed LMCache version; raises PeerUnavailable when it cannot be used."""
    _import_lmcache()
    try:
        return importlib.metadata.version("lmcache")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class LMCacheDiskPeer:
    """LMCache's LocalDiskBackend driven directly, without an engine, GPU or vLLM.

    ``pool_bytes`` sizes LMCache's host buffer pool (it must hold one batch);
    ``disk_bytes`` is the backend's disk budget. It must cover every byte put during
    the peer's life, not just those held at once: ``LocalDiskBackend.remove()`` deletes
    the file but does not lower ``current_cache_size`` (only its own eviction does), so
    explicitly dropped batches keep counting against the budget.
    """

    name = "lmcache"

    def __init__(
        self, directory: Path, *, pool_bytes: int, disk_bytes: int, direct_io: bool
    ) -> None:
        m = _import_lmcache()
        self._m = m
        self.version = check_available()
        self.direct_io = direct_io
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        config = m["LMCacheEngineConfig"].from_defaults(
            chunk_size=256,
            local_cpu=False,
            max_local_cpu_size=pool_bytes / GiB,
            local_disk=str(directory),
            max_local_disk_size=disk_bytes / GiB,
            extra_config={"use_odirect": direct_io},
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="lmcache-peer-loop", daemon=True
        )
        self._thread.start()
        self._allocator = m["MixedMemoryAllocator"](pool_bytes)
        self._cpu = m["LocalCPUBackend"](config, memory_allocator=self._allocator)
        self._disk = m["LocalDiskBackend"](config, self._loop, self._cpu, dst_device="cpu")
        self.io_threads = int(config.get_extra_config_value("disk_io_threads", 4))
        self._ids = itertools.count(1)

    def describe(self) -> dict[str, object]:
        return {
            "version": self.version,
            "use_odirect": self.direct_io,
            "disk_io_threads": self.io_threads,
            **NOTES,
        }

    def _allocate(self, nbytes: int) -> Any:
        torch = self._m["torch"]
        obj = self._cpu.allocate(torch.Size([nbytes]), torch.uint8, self._m["MemoryFormat"].KV_2LTD)
        if obj is None:
            raise RuntimeError(f"LMCache's host pool has no room for {nbytes} more bytes")
        return obj

    def store(self, payloads: Sequence[np.ndarray]) -> tuple[list[Any], float]:
        """Put one batch; returns its keys and the seconds until every file was written.

        The payloads are first copied into LMCache's own host buffers (where an engine's
        offloaded KV would already be), outside the timed part.
        """
        torch = self._m["torch"]
        objs = []
        for arr in payloads:
            obj = self._allocate(arr.nbytes)
            obj.tensor.copy_(torch.from_numpy(np.ascontiguousarray(arr).reshape(-1).view(np.uint8)))
            objs.append(obj)
        keys = [
            self._m["CacheEngineKey"]("kvlife-bench", 1, 0, next(self._ids), torch.uint8)
            for _ in payloads
        ]
        written = threading.Semaphore(0)
        nbytes = sum(a.nbytes for a in payloads)
        t0 = time.perf_counter()
        self._disk.batched_submit_put_task(
            keys, objs, on_complete_callback=lambda _k: written.release()
        )
        skipped = [
            k for k in keys if not (self._disk.exists_in_put_tasks(k) or self._disk.contains(k))
        ]
        if skipped:  # the backend drops a put it has no room for without calling back
            raise RuntimeError(
                f"LMCache skipped {len(skipped)} of {len(keys)} puts (its disk budget is "
                "spent: LocalDiskBackend.remove() does not give back current_cache_size)"
            )
        deadline = t0 + 60.0 + nbytes / 20e6
        for _ in keys:
            if not written.acquire(timeout=max(deadline - time.perf_counter(), 0.001)):
                raise RuntimeError("LMCache did not finish writing the batch in time")
        elapsed = time.perf_counter() - t0
        for obj in objs:
            obj.ref_count_down()
        missing = sum(not self._disk.contains(k) for k in keys)
        if missing:
            raise RuntimeError(f"LMCache reports {missing} of {len(keys)} stored keys missing")
        return keys, elapsed

    def load(self, keys: Sequence[Any], expect: Sequence[np.ndarray] | None = None) -> float:
        """Load a batch into LMCache's host buffers; returns the seconds it took.

        With ``expect``, the first and last objects are compared with it afterwards.
        """
        t0 = time.perf_counter()
        objs = self._disk.batched_get_blocking(list(keys))
        elapsed = time.perf_counter() - t0
        try:
            if any(o is None for o in objs):
                raise RuntimeError("LMCache failed to load part of the batch")
            if expect is not None:
                for i in {0, len(objs) - 1}:
                    got = objs[i].tensor.numpy().view(np.uint8)
                    want = np.ascontiguousarray(expect[i]).reshape(-1).view(np.uint8)
                    if not np.array_equal(got[: want.size], want):
                        raise RuntimeError(f"LMCache returned wrong bytes for object {i}")
        finally:
            for obj in objs:
                if obj is not None:
                    obj.ref_count_down()
        return elapsed

    def drop(self, keys: Sequence[Any]) -> None:
        """Delete a batch's files."""
        for key in keys:
            self._disk.remove(key)

    def close(self) -> None:
        try:
            self._disk.close()
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._cpu.close()

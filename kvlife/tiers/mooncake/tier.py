"""MooncakeTier: payloads in Mooncake Store (``mooncake-transfer-engine-non-cuda``, TCP),
each under a fresh object name; its publication record in the global index on Redis.

Mooncake has no conditional write, so fencing is done by the record: a payload is
``put`` first under a name no reader knows yet, then the index's publish script checks
the lease and writes the record that names it. A reader trusts nothing from Mooncake
alone: ``is_exist`` was seen to report a key present while ``get`` returned empty for
about 10 s after the holder of its segment died, so a payload is served only when its
length and xxh3-128 match the record; empty or short is a miss.

Mooncake's clients (and the master's built-in HTTP metadata server) bind every
interface; see ``docs/remote.md`` for running them on loopback only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from redis.exceptions import NoScriptError, RedisError

from kvlife.core.errors import InvalidArgument, RemoteTierError
from kvlife.core.identity import ChunkKey
from kvlife.globalindex import GlobalIndex, Health, IndexConfig, RemoteRecord
from kvlife.globalindex.health import REFUSALS
from kvlife.tiers.redis.connect import RedisEndpoint
from kvlife.tiers.redis.published import PublishedTier, _Pending

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class MooncakeConfig:
    """Where the Mooncake client connects and what it contributes."""

    master: str
    """Master RPC address, ``127.0.0.1:50051``."""
    metadata: str
    """HTTP metadata server, ``http://127.0.0.1:8080/metadata``."""
    local_hostname: str = "127.0.0.1"
    segment_bytes: int = 256 << 20
    """Memory this client contributes to the pool (0: none, a pure client)."""
    buffer_bytes: int = 64 << 20
    """The client's local transfer buffer."""
    protocol: str = "tcp"

    def __post_init__(self) -> None:
        if not self.metadata.startswith("http://"):
            raise InvalidArgument(f"mooncake metadata {self.metadata!r} must be http://...")
        if self.segment_bytes < 0 or self.buffer_bytes <= 0:
            raise InvalidArgument("mooncake segment_bytes >= 0 and buffer_bytes > 0")


class MooncakeTier(PublishedTier):
    """Replicas in Mooncake Store, published in the global index on Redis."""

    def __init__(
        self,
        config: MooncakeConfig,
        index_endpoint: RedisEndpoint,
        capacity_bytes: int,
        name: str = "mooncake",
        index: IndexConfig | None = None,
        *,
        backoff_s: float = 0.05,
    ) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:  # the wheel, or libibverbs1 under it, is missing
            raise RemoteTierError(
                f"mooncake tier {name}: cannot import mooncake.store ({exc}); "
                "pip install 'kvlife[remote]' and apt-get install libibverbs1"
            ) from exc
        health = Health(f"mooncake tier {name}", base_s=backoff_s)
        self.config = config
        self.mc: Any = MooncakeDistributedStore()
        rc = self.mc.setup(
            config.local_hostname,
            config.metadata,
            config.segment_bytes,
            config.buffer_bytes,
            config.protocol,
            "",
            config.master,
        )
        if rc != 0:
            raise RemoteTierError(
                f"mooncake tier {name}: setup against {config.master} returned {rc}"
            )
        self.client = index_endpoint.connect()
        super().__init__(
            name, capacity_bytes, GlobalIndex(self.client, index or IndexConfig(), health), health
        )
        self.mc_health = Health(f"mooncake store {name}", base_s=backoff_s)

    def close(self) -> None:
        self.mc.close()
        self.client.close()

    def _mc(self, what: str, fn: Callable[[], T]) -> T:
        """A Mooncake call: any failure is a RemoteTierError and starts a backoff."""

        def run() -> T:
            try:
                return fn()
            except Exception as exc:  # pybind11 surfaces C++ failures as RuntimeError
                raise OSError(f"{type(exc).__name__}: {exc}") from exc

        return self.mc_health.call(what, run)

    def _location(self, key: ChunkKey, pending: _Pending) -> str:
        return f"kvl/{self.index.config.namespace}/{key.hex()}/{pending.nonce}"

    def _publish(
        self, pending: _Pending, records: list[RemoteRecord], payloads: list[np.ndarray]
    ) -> None:
        idx = self.index
        lease = pending.lease
        olds = self._records([ChunkKey(r.header.key) for r in records])
        put: list[str] = []
        try:
            for rec, arr in zip(records, payloads, strict=True):
                loc, view = rec.location, arr.data.cast("B")
                rc: int = self._mc("put", lambda: int(self.mc.put(loc, view)))  # noqa: B023
                if rc != 0:
                    raise RemoteTierError(f"{self.name}: mooncake put returned {rc}")
                put.append(rec.location)

            def run() -> list[Any]:
                for attempt in (0, 1):
                    pipe = self.client.pipeline(transaction=False)
                    for rec in records:
                        key = rec.header.key
                        idx.evalsha(
                            pipe,
                            "PUBLISH",
                            [idx.fence_key(key), idx.record_key(key)],
                            [lease.host, lease.token, lease.deadline_ms, rec.encode()],
                        )
                    res = list(pipe.execute(raise_on_error=False))
                    if attempt == 0 and any(isinstance(r, NoScriptError) for r in res):
                        idx._sha.clear()
                        continue
                    return res
                raise AssertionError("unreachable")

            results = self.health.call("publish", run)
        except BaseException:
            self._remove(put)
            raise
        errors = [r for r in results if isinstance(r, Exception)]
        if errors:
            done = [
                ChunkKey(rec.header.key) for rec, r in zip(records, results, strict=True) if r == 1
            ]
            with contextlib.suppress(RemoteTierError):
                self._unpublish(done, [None] * len(done))
            self._remove(put)
            first = errors[0]
            if isinstance(first, RedisError) and str(first).startswith(REFUSALS):
                raise idx.refused(first)
            raise RemoteTierError(f"{self.name}: publish failed: {first}")
        replaced = [o.location for o in olds if isinstance(o, RemoteRecord) and o.location]
        self._remove(replaced)  # payloads of records just overwritten

    def _remove(self, locations: Sequence[str]) -> None:
        for loc in locations:
            with contextlib.suppress(
                RemoteTierError
            ):  # unreferenced: Mooncake's own eviction reclaims it
                self._mc("remove", lambda: int(self.mc.remove(loc, True)))  # noqa: B023

    def _fetch(self, records: list[RemoteRecord]) -> list[memoryview | bytes | Exception | None]:
        locs = [r.location for r in records]
        try:
            got: list[bytes | None] = list(self.mc.get_batch(locs))
        except Exception:  # one object removed under the batch fails it: read singly
            got = []
            for loc in locs:
                try:
                    got.append(self.mc.get(loc))
                except Exception:
                    got.append(None)
        if not all(got) and self.mc.health_check() != 0:  # gone, or the master is?
            self.mc_health.failed("mooncake master unreachable")
            err = RemoteTierError(f"{self.name}: mooncake master unreachable")
            return [g if g else err for g in got]
        return [g if g else None for g in got]

    def _unpublish(self, keys: Sequence[ChunkKey], records: Sequence[RemoteRecord | None]) -> None:
        idx = self.index

        def run() -> None:
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.delete(idx.record_key(k))
            pipe.execute()

        self.health.call("delete", run)
        self._remove([r.location for r in records if r is not None and r.location])

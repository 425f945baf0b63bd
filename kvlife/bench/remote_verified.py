"""The bare verified Mooncake calls of ``kvlife bench remote`` (issue 28): Mooncake's own
zero-copy calls with every payload hashed (xxh3-128, compared with its digest) and
nothing else, no index, no records, no bookkeeping: the simplest store that verifies
every byte it puts and gets through those calls, timed beside kvlife's tier, so that
what kvlife's bookkeeping costs is told apart from what the verification costs.

- put: ``batch_put_from`` on a worker thread while this thread hashes the payloads (as
  kvlife's tier does: both release the interpreter lock);
- get, ``serial``: the fetch groups of kvlife's tier (about 8 MiB each) one after the
  other, each group's payloads hashed right after its ``batch_get_into`` while they are
  still in the cache;
- get, ``pipelined``: the next group fetched on a worker thread while this thread hashes
  the last one.

``bare_published`` is the pipelined contestant whose put also publishes one record per
payload (its digest and length) in one ``MSET`` to the Redis server beside, after the
copy: the least a put that other hosts find only once its payload is whole must add to
the copy (no lease, no fence, no bucket: kvlife's publish checks them all in its script).

A verified get reads every byte once more than a copy does; on a machine whose memory
bandwidth the copy fills, that read costs time. The better of the two gets is reported
(``bare_verified`` in each row); it is no ceiling: kvlife's tier, which fetches ahead
beside its record reads, measured faster than both (README, issue 28).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvlife.tiers.disk.frame import payload_checksum
from kvlife.tiers.mooncake.tier import _schedule as fetch_groups

Round = Callable[[list[np.ndarray], int], tuple[float, float, int, float, float]]
"""One contestant's round, as :data:`kvlife.bench.remote.Run`."""


class BareVerified:
    """The two bare verified contestants over one Mooncake client (``mc``); :meth:`close`
    stops the worker thread."""

    def __init__(
        self, mc: Any, remove: Callable[[list[str]], None], records: Any | None = None
    ) -> None:
        self.mc = mc
        self.remove = remove
        self.records = records
        """A redis-py client the ``bare_published`` contestant publishes its records to
        (None: no such contestant)."""
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="kvlife-bare")
        self._buf = np.zeros(0, np.uint8)
        self._sums: tuple[int, list[bytes]] = (0, [])

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def runs(self, size: int) -> dict[str, Round]:
        runs = {
            "bare_serial": self._run(size, pipelined=False),
            "bare_pipelined": self._run(size, pipelined=True),
        }
        if self.records is not None:
            runs["bare_published"] = self._run(size, pipelined=True, published=True)
        return runs

    def _digests(self, arrs: list[np.ndarray]) -> list[bytes]:
        """The payloads' digests, computed once per batch of arrays (untimed)."""
        if self._sums[0] != id(arrs) or len(self._sums[1]) != len(arrs):
            self._sums = (id(arrs), [payload_checksum(a) for a in arrs])
        return self._sums[1]

    def _put(self, names: list[str], arrs: list[np.ndarray], want: list[bytes]) -> int:
        """The payloads put while this thread hashes them; how many digests differ."""
        mc = self.mc

        def put() -> list[int]:
            return [
                int(rc)
                for rc in mc.batch_put_from(
                    names, [a.ctypes.data for a in arrs], [a.nbytes for a in arrs]
                )
            ]

        fut = self.pool.submit(put)
        wrong = sum(payload_checksum(a) != w for a, w in zip(arrs, want, strict=True))
        rcs = fut.result()
        if any(rc != 0 for rc in rcs):
            raise RuntimeError(f"mooncake batch_put_from returned {rcs[:4]}")
        return wrong

    def _publish(self, names: list[str], arrs: list[np.ndarray], want: list[bytes]) -> None:
        """One record per payload, its digest and length, in one ``MSET``."""
        assert self.records is not None
        self.records.mset(
            {
                _record_key(name): digest + a.nbytes.to_bytes(8, "little")
                for name, a, digest in zip(names, arrs, want, strict=True)
            }
        )

    def _get(self, names: list[str], size: int, want: list[bytes], pipelined: bool) -> int:
        """The payloads got into one reused buffer group by group, each hashed once its
        group landed; how many are short or differ."""
        n = len(names)
        if self._buf.nbytes != n * size:
            self._buf = np.ones(n * size, np.uint8)  # touched once: no page faults timed
        dests = [self._buf[i * size : (i + 1) * size] for i in range(n)]
        mc = self.mc

        def fetch(group: list[int]) -> list[int]:
            got = mc.batch_get_into(
                [names[i] for i in group],
                [dests[i].ctypes.data for i in group],
                [size] * len(group),
            )
            return [int(rc) for rc in got]

        groups = fetch_groups([size] * n)
        wrong = 0

        def check(group: list[int], rcs: list[int]) -> int:
            return sum(
                rc != size or payload_checksum(dests[i]) != want[i]
                for i, rc in zip(group, rcs, strict=True)
            )

        if not pipelined:
            for group in groups:
                wrong += check(group, fetch(group))
            return wrong
        fut = self.pool.submit(fetch, groups[0])
        for k, group in enumerate(groups):
            rcs = fut.result()
            if k + 1 < len(groups):
                fut = self.pool.submit(fetch, groups[k + 1])
            wrong += check(group, rcs)
        return wrong

    def _run(self, size: int, pipelined: bool, published: bool = False) -> Round:
        def run(arrs: list[np.ndarray], rep: int) -> tuple[float, float, int, float, float]:
            want = self._digests(arrs)
            names = [f"bare:{size}:{rep}:{i}" for i in range(len(arrs))]
            c0, t0 = time.process_time(), time.perf_counter()
            wrong = self._put(names, arrs, want)
            if published:
                self._publish(names, arrs, want)
            c1, t1 = time.process_time(), time.perf_counter()
            wrong += self._get(names, size, want, pipelined)
            c2, t2 = time.process_time(), time.perf_counter()
            self.remove(names)
            if published and self.records is not None:
                self.records.delete(*(_record_key(name) for name in names))
            return t1 - t0, t2 - t1, wrong, c1 - c0, c2 - c1

        return run


def _record_key(name: str) -> str:
    """The Redis key of the ``bare_published`` record of payload ``name``."""
    return f"bare-record:{name}"

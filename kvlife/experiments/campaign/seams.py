"""The file seam the in-process fault kinds inject through.

:class:`CampaignIO` is a :class:`~kvlife.faults.fileio.FaultyIO` (so ENOSPC and EIO are
armed as its ``arm`` does) with three more faults a device commits:

- :meth:`CampaignIO.flip_next_read`: the next frame read comes back with one bit
  inverted, in the frame's header or in its payload (what a bad sector or a bus error
  hands up; the bytes on disk stay good);
- :meth:`CampaignIO.lose_writes`: the next ``n`` segment writes are acknowledged and
  never reach the file (a lost write: a device that lies about what it stored);
- :meth:`CampaignIO.slow`: every read, write and fdatasync takes ``factor`` times as
  long as the real call did (a tier slowed 10-1000x).

Each takes an ``after`` (so many matching calls pass first) so that faults combined in
one operation (:mod:`kvlife.experiments.campaign.combos`) land at different calls of it;
write faults can be ``gated``: they wait for a segment read first (in a store that only
puts, a segment read is compaction's, so they hit compaction and not the put itself).

Each counts what it did (``flips``, ``lost``, ``slowed_s``), so a campaign can assert
that its fault fired.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from typing import Literal

import numpy as np

from kvlife.faults.fileio import FaultyIO
from kvlife.tiers.disk.frame import HEADER_BYTES, HEADER_USED

Region = Literal["header", "payload"]
SEGMENTS = "seg-*.kvs"


def _flip_bit(bufs: Sequence[np.ndarray], at: int, bit: int) -> bool:
    """Invert bit ``bit`` of byte ``at`` of the buffers taken end to end."""
    for b in bufs:
        raw = b.reshape(-1).view(np.uint8)
        if at < len(raw):
            raw[at] ^= np.uint8(1 << bit)
            return True
        at -= len(raw)
    return False


class CampaignIO(FaultyIO):
    """A FaultyIO that can also flip bits on read, lose writes and slow calls down."""

    def __init__(self, payload_bytes: int, seed: int, direct: bool = False) -> None:
        super().__init__(direct=direct)
        self._payload_bytes = payload_bytes
        self._rng = random.Random(seed)
        self._mu = threading.Lock()
        self._flip: Region | None = None
        self._flip_after = 0
        self._lose = 0
        self._lose_after = 0
        self._gated: list[tuple[str, int, int]] = []
        """Errno faults (op, errno, after) armed at the next segment read."""
        self._lose_gated = False
        self._factor = 1.0
        self.flips = 0
        self.lost = 0
        self.slowed_s = 0.0

    def flip_next_read(self, region: Region, after: int = 0) -> None:
        """Invert one random bit of the frame read ``after`` segment reads from now, in
        ``region``."""
        with self._mu:
            self._flip = region
            self._flip_after = after

    def lose_writes(self, n: int, after: int = 0, gated: bool = False) -> None:
        """Acknowledge ``n`` segment writes without writing them, once ``after`` more
        have landed (``gated``: counting from the next segment read)."""
        with self._mu:
            self._lose = n
            self._lose_after = after
            self._lose_gated = gated

    def arm_gated(self, op: str, err: int, after: int = 0, gated: bool = False) -> None:
        """:meth:`arm` (sticky, segment files only), now or (``gated``) at the next
        segment read."""
        if gated:
            with self._mu:
                self._gated.append((op, err, after))
        else:
            self.arm(op, err, after=after, path=SEGMENTS)

    def slow(self, factor: float) -> None:
        """Make reads and writes take ``factor`` times their real time (1: normal)."""
        if factor < 1.0:
            raise ValueError(f"a slowdown factor is >= 1, got {factor}")
        with self._mu:
            self._factor = factor

    def heal(self) -> None:
        """Every fault of this seam off (armed errno faults included)."""
        with self._mu:
            self._flip = None
            self._flip_after = 0
            self._lose = 0
            self._lose_after = 0
            self._lose_gated = False
            self._gated = []
            self._factor = 1.0
        self.disarm()

    def _stretch(self, started: float) -> None:
        with self._mu:
            factor = self._factor
        if factor > 1.0:
            extra = (time.perf_counter() - started) * (factor - 1.0)
            time.sleep(extra)
            with self._mu:
                self.slowed_s += extra

    def preadv(self, fd: int, buffers: Sequence[np.ndarray], offset: int) -> int:
        started = time.perf_counter()
        try:
            n = super().preadv(fd, buffers, offset)
        finally:  # a slow device is slow to fail too
            self._stretch(started)
        path = self._path(fd)
        segment = path is not None and path.match(SEGMENTS)
        with self._mu:
            gated, self._gated = (self._gated, []) if segment else ([], self._gated)
            if segment:
                self._lose_gated = False
            region = self._flip if segment else None
            if region is not None and self._flip_after > 0:
                self._flip_after -= 1
                region = None
            if region is not None:
                self._flip = None
        for op, err, after in gated:
            self.arm(op, err, after=after, path=SEGMENTS)
        if region is None:
            return n
        with self._mu:
            if region == "header":
                at = self._rng.randrange(HEADER_USED)
            else:
                at = HEADER_BYTES + self._rng.randrange(self._payload_bytes)
            if _flip_bit(buffers, at, self._rng.randrange(8)):
                self.flips += 1
        return n

    def pwritev(self, fd: int, buffers: Sequence[np.ndarray], offset: int) -> int:
        path = self._path(fd)
        with self._mu:
            lose = (
                self._lose > 0
                and not self._lose_gated
                and path is not None
                and path.match(SEGMENTS)
            )
            if lose and self._lose_after > 0:
                self._lose_after -= 1
                lose = False
            elif lose:
                self._lose -= 1
                self.lost += 1
        if lose:
            return sum(b.nbytes for b in buffers)
        started = time.perf_counter()
        try:
            return super().pwritev(fd, buffers, offset)
        finally:
            self._stretch(started)

    def fdatasync(self, fd: int) -> None:
        started = time.perf_counter()
        try:
            super().fdatasync(fd)
        finally:
            self._stretch(started)

"""The file seam the in-process fault kinds inject through.

:class:`CampaignIO` is a :class:`~kvlife.faults.fileio.FaultyIO` (so ENOSPC and EIO are
armed as its ``arm`` does) with three more faults a device commits:

- :meth:`CampaignIO.flip_next_read`: the next frame read comes back with one bit
  inverted, in the frame's header or in its payload (what a bad sector or a bus error
  hands up; the bytes on disk stay good);
- :meth:`CampaignIO.lose_writes`: the next ``n`` segment writes are acknowledged and
  never reach the file (a lost write: a device that lies about what it stored);
- :meth:`CampaignIO.slow`: every read and write takes ``factor`` times as long as the
  real call did (a tier slowed 10-1000x).

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
        self._lose = 0
        self._factor = 1.0
        self.flips = 0
        self.lost = 0
        self.slowed_s = 0.0

    def flip_next_read(self, region: Region) -> None:
        """Invert one random bit of the next frame read, in ``region``."""
        with self._mu:
            self._flip = region

    def lose_writes(self, n: int) -> None:
        """Acknowledge the next ``n`` segment writes without writing them."""
        with self._mu:
            self._lose = n

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
            self._lose = 0
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
        n = super().preadv(fd, buffers, offset)
        self._stretch(started)
        path = self._path(fd)
        with self._mu:
            region = self._flip if path is not None and path.match(SEGMENTS) else None
            if region is None:
                return n
            self._flip = None
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
            lose = self._lose > 0 and path is not None and path.match(SEGMENTS)
            if lose:
                self._lose -= 1
                self.lost += 1
        if lose:
            return sum(b.nbytes for b in buffers)
        started = time.perf_counter()
        n = super().pwritev(fd, buffers, offset)
        self._stretch(started)
        return n

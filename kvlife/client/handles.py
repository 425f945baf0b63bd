"""What a RemoteStore hands out between calls: a pending put, a lookup answer that
remembers its identity, and the handle of an asynchronous load."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from kvlife.client.direct import Frame
from kvlife.core.errors import InvalidArgument
from kvlife.core.identity import ChunkKey, ModelIdentity
from kvlife.core.objects import PromptRef
from kvlife.results import LoadResult, LookupResult
from kvlife.store.reads import LoadCompletion


@dataclass(slots=True)
class RemotePendingPut:
    """A put between ``prepare_put`` and ``commit_put`` on the server."""

    put: int
    epoch: int
    keys: list[ChunkKey]
    tokens_per_chunk: int
    present: int
    in_flight: int
    stored_chunks: list[int] = field(default_factory=list)
    """Chunk numbers whose bytes this client wrote into the arena."""
    done: bool = False
    held: tuple[PromptRef, list[np.ndarray], str] | None = None
    """A put of a session that maps no arena (nothing to prepare into on the server):
    its prompt, a copy of its chunks and its request id, held here and sent whole
    through the socket by the commit (``put``, ``keys`` and counts are 0 and empty
    until then; nothing of it is on the server before)."""


@dataclass(frozen=True, slots=True)
class RemoteLookup(LookupResult):
    """A lookup answer that remembers its identity (a load needs the chunk layout) and
    where its DRAM hits lay in the server's arena (offset, generation per hit; 0, 0 for
    other tiers), valid for the connection that answered it."""

    identity: ModelIdentity | None = None
    hints: tuple[int, ...] = ()
    epoch: int = 0
    frames: tuple[Frame | None, ...] = ()
    """Each hit's disk frame, when the lookup asked for them (direct reads:
    :mod:`kvlife.client.direct`)."""

    def sub(self, first: int, stop: int) -> RemoteLookup:
        hits = self.hits[first:stop]
        start = min(first, len(self.hits))
        hints = self.hints[2 * start : 2 * (start + len(hits))]
        frames = self.frames[start : start + len(hits)] if self.frames else ()
        return dataclasses.replace(self, hits=hits, hints=hints, frames=frames)


class RemoteLoadHandle(LoadCompletion):
    """An asynchronous remote load, shaped like :class:`~kvlife.store.reads.LoadHandle`:
    ``chunk(i)`` returns as soon as chunk ``i`` was copied into its buffer."""

    def __init__(self, requested: int) -> None:
        super().__init__()
        self._requested = requested
        self._events = [threading.Event() for _ in range(requested)]
        self._arrays: list[np.ndarray | None] = [None] * requested

    def _chunk_events(self) -> Iterable[threading.Event]:
        return self._events

    def __len__(self) -> int:
        return self._requested

    def _chunk_done(self, i: int, arr: np.ndarray | None) -> None:
        self._arrays[i] = arr
        self._events[i].set()

    def _finish(self, fut: Future[LoadResult]) -> None:
        exc = fut.exception()
        if exc is not None:
            self._error = exc
        else:
            res = fut.result()
            # from now on ``chunk`` says what the result says: a chunk handed out while
            # the load ran (streamed once it verified) that the load's publication no
            # longer counts (invalidated meanwhile) is a miss, as in the result
            got = min(res.loaded, self._requested)
            self._arrays = [*res.arrays[:got], *[None] * (self._requested - got)]
            self._result = res
        self._finished.set()
        for ev in self._events:
            ev.set()

    def chunk(self, i: int, timeout: float | None = None) -> np.ndarray | None:
        if not 0 <= i < self._requested:
            raise InvalidArgument(f"chunk {i} is not in this load of {self._requested} hits")
        if not self._events[i].wait(timeout):
            raise TimeoutError(f"chunk {i} did not complete within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._arrays[i]

"""The verified ceiling of ``kvlife bench concurrency`` (issue 28): the readers' own disk
frames read and verified by the extension alone, from T threads, with none of the
store's Python.

Each reader thread's prompts are looked up once before the slice; their disk frames
(:meth:`~kvlife.store.facade.KVStore.frame_hints`: segment file, offset, the header and
checksum the catalog holds) are then read and verified again and again by
:func:`kvlife.client.direct.read_frames`, the served client's direct reads: one read in
flight and the checksum of a frame beside the read of the next, as the disk tier's own
native reads, each frame's header compared byte for byte and its payload's xxh3-128
checked. No lookup, no pin, no ledger, no probe, no writer. What a verified load at
queue depth T cannot beat on this machine; the loads' distance under it is the store's
own cost (Python, the interpreter lock, the probe), the ceiling's distance under raw
reads the cost of verifying every byte here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np

from kvlife.client.direct import Frame, read_frames
from kvlife.core.identity import PUBLIC, ModelIdentity
from kvlife.native import frames as native
from kvlife.store import KVStore
from kvlife.store.direct import FrameHint


def frame_of(hint: FrameHint) -> Frame:
    """The direct read of one catalog row's frame."""
    row = hint.row
    return Frame(
        hint.path,
        row.seg,
        row.off,
        row.header(),
        row.checksum,
        row.nbytes,
        np.dtype(row.dtype),
        tuple(row.shape),
    )


def prompt_frames(
    store: KVStore, ident: ModelIdentity, prompts: Sequence[np.ndarray]
) -> list[list[Frame]]:
    """Each prompt's disk frames, in chunk order (RuntimeError if a hit is not an exact
    disk replica: the readers' chunks live on disk only)."""
    out: list[list[Frame]] = []
    for tokens in prompts:
        hits = store.lookup(ident, PUBLIC, tokens).hits
        hints = store.frame_hints(hits)
        if not hits or any(h is None for h in hints):
            raise RuntimeError("a reader's prompt has hits that are not exact disk frames")
        out.append([frame_of(h) for h in hints if h is not None])
    return out


def verified_slice(
    frames: Sequence[Sequence[Sequence[Frame]]],
    outs: Sequence[Sequence[np.ndarray]],
    seconds: float,
) -> tuple[float, int]:
    """GB/s (1e9 B/s) of ``len(frames)`` threads, thread t reading and verifying the
    prompts ``frames[t]`` in turn into ``outs[t]`` for ``seconds``, and how many frames
    failed to verify (moved or rewritten since they were looked up: not counted)."""
    if not native.available():
        return float("nan"), 0
    threads = len(frames)
    done = [0] * threads
    failed = [0] * threads
    errors: list[BaseException] = []
    stop = threading.Event()
    start = threading.Barrier(threads + 1)

    def run(t: int) -> None:
        mine, bufs = frames[t], outs[t]
        try:
            start.wait()
            i = 0
            while not stop.is_set():
                fs = mine[i % len(mine)]
                got = read_frames(fs, bufs[: len(fs)])
                done[t] += sum(f.nbytes for f in fs[:got])
                failed[t] += len(fs) - got
                i += 1
        except BaseException as exc:  # raised below
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    start.wait()
    t0 = time.perf_counter()
    stop.wait(seconds)
    stop.set()
    for w in workers:
        w.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return sum(done) / wall / 1e9, sum(failed)

"""A real ``kvlife serve`` whose disk reads a test holds or damages, chunk by chunk:
``python -m tests.server.stalled_server STORE SOCKET PID_FILE [one-cpu]`` (``one-cpu``:
the server on one CPU, where the store reads a load's chunks back to back and verifies
each on a helper thread: ``kvlife.store.reads``, ``_Feed.pipelined``).

The server is :func:`kvlife.server.server.run` with the disk tier's file seam
(``ServeConfig.fileio``) a :class:`MarkedIO`: a segment read whose payload begins with
:data:`STALL_MARK` is held after the bytes arrived (the read has not returned, so
nothing of it is verified yet) until the test releases it; one whose payload begins
with :data:`CORRUPT_MARK` has a byte of its payload flipped before it returns (damage on
the device, as the reader sees it). A test marks a chunk by writing the mark at the
start of its KV (:func:`mark`), so which chunk stalls does not hang on the order the
I/O threads issue their reads in.

Commands on stdin, one a line, each answered on stdout: ``release`` (``released``).
``entered`` is printed when a marked read is held. SIGTERM stops the server.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvlife.faults.fileio import FaultyIO
from kvlife.server.server import ServeConfig, run

STALL_MARK = np.array([1234.0, -1234.0, 4321.0, -4321.0, 1111.0, -1111.0, 2222.0, -2222.0])
"""float16 values a chunk's KV starts with when its read is to be held."""
CORRUPT_MARK = np.array([777.0, -777.0, 555.0, -555.0, 333.0, -333.0, 999.0, -999.0])
"""float16 values a chunk's KV starts with when its read is to be damaged."""
HOLD_S = 60.0
"""A held read is let go after this long at most (a broken test never hangs)."""


def mark(kv: np.ndarray, chunk: int, tokens_per_chunk: int, values: np.ndarray) -> None:
    """Write ``values`` at the start of chunk ``chunk`` of ``kv`` (layers, 2, heads,
    tokens, dim): the first bytes of its payload on disk."""
    kv[0, 0, 0, chunk * tokens_per_chunk, : len(values)] = values.astype(kv.dtype)


def _starts_with(buf: np.ndarray, values: np.ndarray) -> bool:
    want = values.astype(np.float16).view(np.uint8)
    raw = buf.reshape(-1).view(np.uint8)
    return raw.nbytes >= want.nbytes and bytes(raw[: want.nbytes]) == want.tobytes()


class MarkedIO(FaultyIO):
    """Real reads; a read of a marked payload held (stall mark) or damaged (corrupt mark)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.released = threading.Event()

    def preadv(self, fd: int, buffers: Sequence[np.ndarray], offset: int) -> int:
        n = super().preadv(fd, buffers, offset)
        if len(buffers) < 2:
            return n
        payload = buffers[1]
        if _starts_with(payload, STALL_MARK) and not self.released.is_set():
            self.entered.set()
            self.released.wait(HOLD_S)
        elif _starts_with(payload, CORRUPT_MARK):
            raw = payload.reshape(-1).view(np.uint8)
            # the byte after the mark (the buffer may be longer than the payload: its
            # padding is not hashed): the mark stays readable, the checksum fails
            raw[CORRUPT_MARK.size * 2] ^= 0xFF
        return n


def _control(io: MarkedIO) -> None:
    def announce() -> None:
        io.entered.wait()
        print("entered", flush=True)

    threading.Thread(target=announce, daemon=True).start()
    for line in sys.stdin:
        if line.strip() == "release":
            io.released.set()
            print("released", flush=True)


def main() -> int:
    store, sock, pid_file = (Path(a) for a in sys.argv[1:4])
    if sys.argv[4:] == ["one-cpu"]:  # as ``kvlife serve --cpus`` with one: pipelined loads
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    io = MarkedIO()
    threading.Thread(target=_control, args=(io,), daemon=True).start()
    cfg = ServeConfig(
        path=store,
        socket=sock,
        pid_file=pid_file,
        dram_bytes=8 << 20,
        disk_bytes=64 << 20,
        staging_bytes=4 << 20,
        promote_on_hit=False,
        fileio=io,
    )
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())

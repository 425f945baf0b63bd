"""The bare server of ``kvlife bench server``'s floor (:mod:`kvlife.bench.server.floor`):
no store, no identity, no budgets, only what a served put or a served disk load cannot
do without. Run as ``python -m kvlife.bench.server.floor_server SOCKET SHM BYTES CPUS``
by :class:`~kvlife.bench.server.floor.FloorServer`; it serves one connection, then exits.

Messages are fixed headers (:data:`~kvlife.bench.server.floor.HEADER`: an operation
byte and two integers):

- ``P`` (chunk bytes, chunks): a put begins; the client copies its chunks, in order,
  into the shared memory from offset 0.
- ``W`` (bytes written): the client wrote that many bytes; they are hashed now, while
  it copies the rest (each chunk's xxh3-128 once it is hashed whole).
- ``C``: the put is written; the rest is hashed, the reply is the chunks' seals.
- ``S`` (chunks): the put is written and the client hashed it; its seals follow the
  header and are taken as they are (sent back as the reply).
- ``O`` (path length, direct): the file the loads read (the path follows the header).
- ``L`` (chunk bytes, chunks): read the file's first chunks into the shared memory,
  the reads issued back to back in this thread, each chunk hashed by a helper thread as
  soon as its read returned; the reply is their seals.
- ``N``: a no-op; the reply is one byte (``kvlife bench server`` times the round
  trip: :meth:`~kvlife.bench.server.floor.FloorServer.round_trips`).
- ``Q``: exit.
"""

from __future__ import annotations

import mmap
import os
import socket
import sys
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import xxhash

from kvlife.bench.server.floor import HEADER


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    got = bytearray()
    while len(got) < n:
        part = conn.recv(n - len(got))
        if not part:
            raise EOFError("the client closed the connection")
        got += part
    return bytes(got)


class _Put:
    """The hashing state of one put: what is hashed so far and the seals made."""

    def __init__(self, shm: np.ndarray, chunk: int, n: int) -> None:
        self.shm, self.chunk, self.n = shm, chunk, n
        self.done = 0
        self.state = xxhash.xxh3_128()
        self.seals: list[bytes] = []

    def hash_upto(self, upto: int) -> None:
        upto = min(upto, self.chunk * self.n)
        while self.done < upto:
            i, at = divmod(self.done, self.chunk)
            end = min(upto, (i + 1) * self.chunk) - i * self.chunk
            if at == 0:
                self.state = xxhash.xxh3_128()
            self.state.update(self.shm[i * self.chunk + at : i * self.chunk + end].data)
            if end == self.chunk:
                self.seals.append(self.state.digest())
            self.done = i * self.chunk + end


def serve(sock_path: str, shm_path: str, shm_bytes: int) -> None:
    fd = os.open(shm_path, os.O_RDWR)
    try:
        mapping = mmap.mmap(fd, shm_bytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    shm = np.frombuffer(mapping, np.uint8)
    helper = ThreadPoolExecutor(1, thread_name_prefix="floor-hash")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(sock_path)
    listener.listen(1)
    conn, _ = listener.accept()
    listener.close()
    put: _Put | None = None
    src = -1
    while True:
        op, a, b = HEADER.unpack(_recv_exact(conn, HEADER.size))
        if op == b"P":
            put = _Put(shm, a, b)
        elif op in (b"W", b"C") and put is not None:
            put.hash_upto(a if op == b"W" else put.chunk * put.n)
            if op == b"C":
                conn.sendall(b"".join(put.seals))
                put = None
        elif op == b"S" and put is not None:
            # the client's seals of the put it wrote, taken as they are (sent back)
            conn.sendall(_recv_exact(conn, 16 * a))
            put = None
        elif op == b"O":
            path = _recv_exact(conn, a).decode()
            if src >= 0:
                os.close(src)
            src = os.open(path, os.O_RDONLY | (os.O_DIRECT if b else 0))
        elif op == b"L" and src >= 0:
            conn.sendall(_load(src, shm, a, b, helper))
        elif op == b"N":
            conn.sendall(b"n")
        elif op == b"Q":
            break
        else:
            raise ValueError(f"floor server: unexpected message {op!r} ({a}, {b})")
    helper.shutdown()
    conn.close()


def _load(src: int, shm: np.ndarray, chunk: int, n: int, helper: ThreadPoolExecutor) -> bytes:
    hashed: list[Future[bytes]] = []
    for i in range(n):
        view = shm[i * chunk : (i + 1) * chunk]
        got = os.preadv(src, [view.data], i * chunk)
        if got != chunk:
            raise OSError(f"floor server: short read of chunk {i}: {got} of {chunk} bytes")
        hashed.append(helper.submit(xxhash.xxh3_128_digest, view.data))
    return b"".join(h.result() for h in hashed)


def main(argv: list[str]) -> int:
    sock_path, shm_path, shm_bytes, cpus = argv
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    serve(sock_path, shm_path, int(shm_bytes))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

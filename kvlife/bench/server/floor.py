"""The protocol's floor (issue 28): the same served put and served disk load as
``kvlife bench server`` times through ``kvlife serve``, done by a bare server process
with no store (:mod:`kvlife.bench.server.floor_server`), on the same CPU, through the
same kind of socket and the same shared memory.

A served put cannot do less than copy the caller's bytes into memory the server holds,
have the server hash them (here while the copy goes on, told every ``notice`` bytes)
and wait for one reply; a served disk load cannot do less than send one request, have
the server read the chunks into the caller's shared buffer and hash them (here each
chunk on a helper thread while the next is read) and wait for one reply. What kvlife
spends beyond the floor is its own (identity, index, budgets, pins, the store's
bookkeeping); what the floor spends beyond the limit (memcpy, raw reads) is the
machine's, for any design that crosses a process boundary and verifies every byte.
Every reply is checked: the seals must be the chunks' (or the floor raises).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import xxhash

from kvlife.native.copies import copy_sealed, sealing, stream_copy
from kvlife.tiers.base import seal_of

HEADER = struct.Struct("<cQQ")
"""A message to the floor server: an operation byte and two unsigned 64-bit integers
(:mod:`~kvlife.bench.server.floor_server` lists them)."""

SEAL_PIECE_BYTES = 512 << 10
"""A put that seals on the client side copies and hashes this many bytes at a time, so
that the hash reads what the copy just wrote from the cache."""

ROUND_TRIPS = 200
"""Round trips :meth:`FloorServer.round_trips` times each way (idle, back to back)."""
QUICK_ROUND_TRIPS = 40
"""The same in a ``--quick`` run."""
ROUND_TRIP_GAP_S = 0.002
"""Idleness before each idle round trip: about the gap between two calls of a bench."""

START_TIMEOUT_S = 30.0
CALL_TIMEOUT_S = 60.0


class FloorError(RuntimeError):
    """The floor server failed, or answered with seals that are not the chunks'."""


class FloorServer:
    """A bare server process (:mod:`~kvlife.bench.server.floor_server`) and its shared
    memory: ``shm_bytes`` in ``shm_dir`` (the bench's arena tmpfs), mapped by both;
    its socket in a short directory of its own; pinned to ``cpus`` (a ``--cpus`` list,
    empty: not pinned). Stopped by PID (:meth:`stop`), which removes both."""

    def __init__(self, shm_dir: Path, shm_bytes: int, cpus: str = "") -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="kvf-"))
        self.shm_path = Path(shm_dir) / f"kvlife-floor-{os.getpid()}-{time.monotonic_ns()}"
        self.shm_bytes = shm_bytes
        self.proc: subprocess.Popen[bytes] | None = None
        self.conn: socket.socket | None = None
        try:
            fd = os.open(self.shm_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, shm_bytes)
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                self._mapping = mmap.mmap(fd, shm_bytes, flags=flags)
            finally:
                os.close(fd)
            self.shm = np.frombuffer(self._mapping, np.uint8)
            sock = self._dir / "s"
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kvlife.bench.server.floor_server",
                    str(sock),
                    str(self.shm_path),
                    str(shm_bytes),
                    cpus,
                ],
                stdin=subprocess.DEVNULL,
            )
            self.conn = self._connect(sock)
            # both processes map it now (the server maps before it listens): its name
            # is not needed, and a bench killed from here on leaves no memory behind
            self.shm_path.unlink()
        except BaseException:
            self.stop()
            raise

    def _connect(self, sock: Path) -> socket.socket:
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                status = self.proc.returncode
                raise FloorError(f"the floor server exited at start (status {status})")
            if sock.exists():
                conn = socket.socket(socket.AF_UNIX)
                conn.settimeout(CALL_TIMEOUT_S)
                try:
                    conn.connect(str(sock))
                except OSError:
                    conn.close()
                else:
                    return conn
            time.sleep(0.01)
        raise FloorError(f"the floor server did not listen within {START_TIMEOUT_S:.0f} s")

    def _send(self, op: bytes, a: int = 0, b: int = 0, tail: bytes = b"") -> None:
        assert self.conn is not None
        try:
            self.conn.sendall(HEADER.pack(op, a, b) + tail)
        except OSError as exc:
            raise FloorError(f"the floor server is gone: {exc}") from None

    def _seals(self, n: int) -> list[bytes]:
        assert self.conn is not None
        got = bytearray()
        try:
            while len(got) < 16 * n:
                part = self.conn.recv(16 * n - len(got))
                if not part:
                    break
                got += part
        except OSError as exc:
            raise FloorError(f"the floor server did not answer: {exc}") from None
        if len(got) < 16 * n:
            raise FloorError("the floor server closed the connection (it failed: see its stderr)")
        return [bytes(got[i : i + 16]) for i in range(0, len(got), 16)]

    def _check(self, got: list[bytes], chunks: list[np.ndarray], what: str) -> None:
        want = [seal_of(c) for c in chunks]
        if got != want:
            raise FloorError(f"the floor server's seals of the {what} are not the chunks'")

    def put(self, chunks: list[np.ndarray], notice: int, client_seals: bool = False) -> float:
        """Seconds of one put of ``chunks`` (equal sizes, C-contiguous), copied into the
        shared memory in order (as kvlife's client copies a staged put:
        :func:`~kvlife.native.copies.stream_copy`), one reply of seals at the end
        (checked after). The server hashes them, told every ``notice`` bytes (0: never,
        it hashes all at the commit); or, ``client_seals``, this side hashes each chunk
        as it copies it, as kvlife's client does
        (:func:`~kvlife.native.copies.copy_sealed`; without the extension, each piece of
        :data:`SEAL_PIECE_BYTES` right after copying it, from the cache) and sends the
        seals with the commit (the server only takes them)."""
        size = chunks[0].nbytes
        total = size * len(chunks)
        self._fits(total)
        if any(not c.flags.c_contiguous or c.nbytes != size for c in chunks):
            raise ValueError("the floor's put takes C-contiguous chunks of one size")
        flat = [c.reshape(-1).view(np.uint8) for c in chunks]
        step = SEAL_PIECE_BYTES if client_seals else notice if notice > 0 else size
        seals: list[bytes] = []
        hashing_copy = client_seals and sealing()
        t0 = time.perf_counter()
        self._send(b"P", size, len(chunks))
        done = told = 0
        for i, src in enumerate(flat):
            if hashing_copy:  # as kvlife's client seals a put: hashed as it is copied
                seals.append(copy_sealed(self.shm[i * size : (i + 1) * size], src))
                continue
            hashing = xxhash.xxh3_128()
            for off in range(0, size, step):
                end = min(size, off + step)
                dst = self.shm[i * size + off : i * size + end]
                if client_seals:  # hashed next, from this core's cache
                    np.copyto(dst, src[off:end])
                else:  # as kvlife's client copies a staged put
                    stream_copy(dst, src[off:end])
                done += end - off
                told += end - off
                if client_seals:
                    hashing.update(dst.data)
                elif notice > 0 and told >= notice and done < total:
                    self._send(b"W", done)
                    told = 0
            if client_seals:
                seals.append(hashing.digest())
        if client_seals:
            self._send(b"S", len(seals), 0, b"".join(seals))
        else:
            self._send(b"C")
        got = self._seals(len(chunks))
        took = time.perf_counter() - t0
        self._check(got, chunks, "put")
        return took

    def open_file(self, path: Path, direct: bool) -> None:
        """The file the next loads read (its first chunks, back to back)."""
        name = str(path).encode()
        self._send(b"O", len(name), int(direct), name)

    def load(self, chunks: list[np.ndarray]) -> float:
        """Seconds of one disk load of the open file's first ``len(chunks)`` chunks into
        the shared memory; their seals (checked after) must be ``chunks``'."""
        size = chunks[0].nbytes
        self._fits(size * len(chunks))
        t0 = time.perf_counter()
        self._send(b"L", size, len(chunks))
        got = self._seals(len(chunks))
        took = time.perf_counter() - t0
        self._check(got, chunks, "load")
        return took

    def round_trips(
        self, rounds: int = ROUND_TRIPS, gap_s: float = ROUND_TRIP_GAP_S
    ) -> dict[str, float]:
        """One request and its one-byte reply, no work between: the least any served
        call pays beside its data (a message's way to the server's CPU and back, each
        side woken from a blocking read). ``idle_us``: the median after ``gap_s`` of
        idleness before each (as a call after the one before finished: both sides
        asleep); ``hot_us``: back to back; ``idle_p90_us`` beside."""
        idle: list[float] = []
        hot: list[float] = []
        for _ in range(rounds):
            time.sleep(gap_s)
            idle.append(self._ping())
        for _ in range(rounds):
            hot.append(self._ping())
        return {
            "idle_us": float(np.median(idle)) * 1e6,
            "idle_p90_us": float(np.percentile(idle, 90)) * 1e6,
            "hot_us": float(np.median(hot)) * 1e6,
            "gap_ms": gap_s * 1e3,
            "rounds": rounds,
        }

    def _ping(self) -> float:
        assert self.conn is not None
        t0 = time.perf_counter()
        self._send(b"N")
        try:
            got = self.conn.recv(1)
        except OSError as exc:
            raise FloorError(f"the floor server did not answer: {exc}") from None
        took = time.perf_counter() - t0
        if got != b"n":
            raise FloorError("the floor server closed the connection (it failed: see its stderr)")
        return took

    def _fits(self, nbytes: int) -> None:
        if nbytes > self.shm_bytes:
            raise ValueError(f"{nbytes} bytes do not fit the floor's {self.shm_bytes}")

    def stop(self) -> None:
        """Stop the process (by its PID) and remove its shared memory and socket."""
        if self.conn is not None:
            with_quit = self.proc is not None and self.proc.poll() is None
            if with_quit:
                with contextlib.suppress(FloorError):
                    self._send(b"Q")
            self.conn.close()
            self.conn = None
        if self.proc is not None:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.shm_path.unlink(missing_ok=True)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> FloorServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

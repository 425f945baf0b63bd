"""FaultProxy: a TCP proxy on loopback between a client and a server that injects
network faults for real (the kernel here has no ``tc netem``): delay, a bandwidth limit,
dropped connections (FIN), reset connections (RST), a partition (a black hole: bytes
vanish, nothing answers), truncated replies and flipped bytes.

It runs an asyncio loop in its own thread; :meth:`FaultProxy.set` changes the fault of
every connection, open or new, at once. Faults that damage bytes act on the server's
replies (``down``); delay, bandwidth and partition act both ways.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from dataclasses import dataclass
from types import TracebackType

from kvlife.core.errors import InvalidArgument

KINDS = ("none", "delay", "bandwidth", "drop", "reset", "partition", "truncate", "flip")


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault setting of a proxy."""

    kind: str = "none"
    delay_s: float = 0.0
    """``delay``: added before forwarding each piece of data, both ways."""
    bytes_per_s: float = 0.0
    """``bandwidth``: throughput cap per connection and direction."""
    after_bytes: int = 0
    """``truncate``: bytes of a reply forwarded before the connection is cut."""
    every_bytes: int = 0
    """``flip``: one byte in this many of the replies is inverted."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgument(f"unknown fault {self.kind!r}; known: {', '.join(KINDS)}")
        if self.delay_s < 0 or self.bytes_per_s < 0 or self.after_bytes < 0 or self.every_bytes < 0:
            raise InvalidArgument(f"fault {self.kind} has a negative setting")
        if self.kind == "bandwidth" and self.bytes_per_s <= 0:
            raise InvalidArgument("a bandwidth fault needs bytes_per_s > 0")
        if self.kind == "flip" and self.every_bytes <= 0:
            raise InvalidArgument("a flip fault needs every_bytes > 0")

    @classmethod
    def none(cls) -> Fault:
        return cls()

    @classmethod
    def delay(cls, seconds: float) -> Fault:
        return cls("delay", delay_s=seconds)

    @classmethod
    def bandwidth(cls, bytes_per_s: float) -> Fault:
        return cls("bandwidth", bytes_per_s=bytes_per_s)

    @classmethod
    def drop(cls) -> Fault:
        return cls("drop")

    @classmethod
    def reset(cls) -> Fault:
        return cls("reset")

    @classmethod
    def partition(cls) -> Fault:
        return cls("partition")

    @classmethod
    def truncate(cls, after_bytes: int) -> Fault:
        return cls("truncate", after_bytes=after_bytes)

    @classmethod
    def flip(cls, every_bytes: int) -> Fault:
        return cls("flip", every_bytes=every_bytes)


@dataclass(slots=True)
class ProxyCounters:
    connections: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    dropped_bytes: int = 0
    """Bytes a partition swallowed."""
    cut: int = 0
    """Connections the proxy closed or reset."""
    flipped: int = 0


class _Conn:
    def __init__(self, cw: asyncio.StreamWriter, sw: asyncio.StreamWriter) -> None:
        self.cw = cw
        self.sw = sw
        self.flip_pos = 0
        self.truncate_left: int | None = None

    def close(self, rst: bool) -> None:
        for w in (self.cw, self.sw):
            if rst:
                sock = w.get_extra_info("socket")
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
            w.close()


class FaultProxy:
    """``with FaultProxy(("127.0.0.1", server_port)) as p:`` clients connect to
    ``127.0.0.1:p.port``; ``p.set(Fault.delay(0.1))`` and so on."""

    def __init__(self, upstream: tuple[str, int], port: int = 0) -> None:
        self.upstream = upstream
        self._want_port = port
        self.port = 0
        self._fault = Fault()
        self.counters = ProxyCounters()
        self._conns: set[_Conn] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name="fault-proxy"
        )
        self._server: asyncio.base_events.Server | None = None

    # ------------------------------------------------------------------ control

    def start(self) -> FaultProxy:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        fut.result(timeout=10)
        return self

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self._want_port)
        self.port = int(self._server.sockets[0].getsockname()[1])

    def set(self, fault: Fault) -> None:
        """Change the fault now; ``drop`` and ``reset`` also cut every open connection."""
        self._fault = fault
        if fault.kind in ("drop", "reset", "truncate"):
            asyncio.run_coroutine_threadsafe(self._cut_all(fault), self._loop).result(timeout=10)

    @property
    def fault(self) -> Fault:
        return self._fault

    async def _cut_all(self, fault: Fault) -> None:
        for c in list(self._conns):
            if fault.kind == "truncate":
                c.truncate_left = fault.after_bytes
            else:
                c.close(rst=fault.kind == "reset")
                self.counters.cut += 1
                self._conns.discard(c)

    def stop(self) -> None:
        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for c in list(self._conns):
                c.close(rst=True)
            self._conns.clear()

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------ data path

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        fault = self._fault
        self.counters.connections += 1
        if fault.kind in ("drop", "reset"):
            _Conn(cw, cw).close(rst=fault.kind == "reset")
            self.counters.cut += 1
            return
        try:
            sr, sw = await asyncio.open_connection(*self.upstream)
        except OSError:
            cw.close()
            return
        conn = _Conn(cw, sw)
        if fault.kind == "truncate":
            conn.truncate_left = fault.after_bytes
        self._conns.add(conn)
        await asyncio.gather(
            self._pump(cr, sw, conn, down=False),
            self._pump(sr, cw, conn, down=True),
            return_exceptions=True,
        )
        self._conns.discard(conn)
        conn.close(rst=False)

    async def _pump(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, conn: _Conn, *, down: bool
    ) -> None:
        while True:
            data = await src.read(1 << 16)
            if not data:
                break
            f = self._fault
            if f.kind == "partition":
                self.counters.dropped_bytes += len(data)
                continue
            if f.kind in ("drop", "reset"):
                conn.close(rst=f.kind == "reset")
                self.counters.cut += 1
                return
            if f.kind == "delay" and f.delay_s:
                await asyncio.sleep(f.delay_s)
            if f.kind == "bandwidth":
                await asyncio.sleep(len(data) / f.bytes_per_s)
            if down and f.kind == "flip":
                data = self._flip(conn, data, f.every_bytes)
            if down and f.kind == "truncate":
                left = conn.truncate_left if conn.truncate_left is not None else f.after_bytes
                if len(data) >= left:
                    dst.write(data[:left])
                    await dst.drain()
                    conn.close(rst=False)
                    self.counters.cut += 1
                    return
                conn.truncate_left = left - len(data)
            dst.write(data)
            await dst.drain()
            if down:
                self.counters.bytes_down += len(data)
            else:
                self.counters.bytes_up += len(data)
        dst.close()

    def _flip(self, conn: _Conn, data: bytes, every: int) -> bytes:
        buf = bytearray(data)
        pos = conn.flip_pos
        i = (every - pos % every) % every
        while i < len(buf):
            buf[i] ^= 0xFF
            self.counters.flipped += 1
            i += every
        conn.flip_pos = pos + len(buf)
        return bytes(buf)

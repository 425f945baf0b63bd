"""Loads of chunks from the server's DRAM tier against memcpy and from its disk tier
against raw reads, into ordinary and into shared buffers; and the DRAM loads of a server
that verifies every load against its replica's seal."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from kvlife.bench.limits import (
    ReadCopier,
    hash_cpu_per_chunk,
    memcpy,
    process_cpu,
    raw_frame_reads,
    raw_read,
    raw_write,
    streamed,
    tasks_cpu_seconds,
)
from kvlife.bench.server.config import ServerBenchConfig
from kvlife.bench.server.floor import FloorServer
from kvlife.bench.server.servers import BenchServer, direct_ok
from kvlife.bench.server.workload import (
    NS,
    aligned_copy,
    bench_identity,
    chunk_layout,
    out_buffers,
    pct,
    point,
    prompt,
    same_bits,
    split_chunks,
)
from kvlife.client import RemoteStore
from kvlife.client.direct import read_frames
from kvlife.client.handles import RemoteLookup
from kvlife.core.identity import KVLayout
from kvlife.results import LoadResult, LookupResult
from kvlife.tiers.buffers import aligned_empty
from kvlife.tiers.disk.frame import HEADER_BYTES


def bench_load(
    cfg: ServerBenchConfig,
    remote: RemoteStore,
    size: int,
    seed: int,
    raw_dir: Path | None,
    server_pid: int | None = None,
    floor: FloorServer | None = None,
    direct_client: RemoteStore | None = None,
) -> dict[str, Any]:
    """Load ``chunks_per_call`` chunks into preallocated buffers; the limit is memcpy of
    the same bytes from warm memory (DRAM) or raw reads of a file of them (disk:
    ``raw_dir`` given, the chunks flushed and evicted from DRAM first). With
    ``server_pid``, the CPU per chunk each side spent (``cpu``: :func:`_cpu_budget`).
    ``floor`` (disk only): the same load of the raw file through a bare server with no
    store, timed beside (``floor``: :mod:`kvlife.bench.server.floor`). ``direct_client`` (disk
    only): a client of the same server with direct reads, loading into its shared
    buffers (``direct``: the client reads the frames itself while the server confirms
    them, :mod:`kvlife.client.direct`) and without buffers (``direct_new``: into new
    arrays of its pool, as the vLLM worker's loads). Disk only, beside them: ``copied``, the ceiling
    of any served load into the caller's own buffers (raw reads of the same file, each
    piece copied out and hashed as it lands: :class:`~kvlife.bench.limits.ReadCopier`),
    and ``no_landed``, the ordinary load again without landed parts (the client copies
    each chunk once it verified), in the same rounds (``landed_time_ratio``: the median
    of each round's time with them over without)."""
    layout = chunk_layout(size)
    ident = bench_identity(layout)
    n = cfg.chunks_per_call
    tokens, kv = prompt(layout, n, seed)
    remote.put_prompt(ident, NS, tokens, kv)
    chunks = split_chunks(kv, layout, n)
    if raw_dir is not None:
        remote.flush()
        remote.evict("dram", 1 << 62)
    outs = out_buffers(layout, n)
    lk = remote.lookup(ident, NS, tokens)
    want = "disk" if raw_dir is not None else "dram"
    if lk.tiers() != {want: n}:
        raise RuntimeError(f"expected {n} hits in {want}, got {lk.tiers()}")
    served, limit = [], []
    raw_file = raw_dir / f"raw-{size}" if raw_dir is not None else None
    direct = raw_dir is not None and direct_ok(raw_dir)
    if raw_file is not None:
        raw_write(raw_file, [aligned_copy(c) for c in chunks], direct)
        if floor is not None:
            floor.open_file(raw_file, direct)
    floored: list[float] = []
    flat = [o.view(np.uint8).reshape(-1) for o in outs]
    shared = shared_chunks(remote, layout, n)
    served_shared: list[float] = []
    served_new: list[float] = []
    direct_lk = direct_client.lookup(ident, NS, tokens) if direct_client is not None else None
    direct_bufs: list[np.ndarray] = []
    if direct_client is not None:
        direct_bufs = shared_chunks(direct_client, layout, n)
    served_direct: list[float] = []
    # the raw reads of the frames' own bytes (the direct client's lookup names them)
    frame_places = _frame_places(direct_lk) if raw_file is not None else []
    heads = [aligned_empty(HEADER_BYTES) for _ in frame_places]
    frames_raw: list[float] = []
    served_direct_new: list[float] = []
    served_late: list[float] = []
    verified: list[float] = []
    copied: list[float] = []
    streams: list[float] = []
    copies = out_buffers(layout, n) if raw_file is not None else []
    # the ceiling of a load into the caller's own buffers: the better of one copier and
    # two (at 16 MiB two did 0.81 of raw against 0.75-0.78, at 2 MiB no better)
    copiers = [ReadCopier(copiers=c) for c in (1, 2)] if raw_file is not None else []
    cpu = _CpuTally(server_pid)
    frames_before = remote.counters.frame_loads
    try:
        for rep in range(cfg.reps + 1):
            floor_first = (
                floor.load(chunks)
                if floor is not None and raw_file is not None and rep % 2
                else 0.0
            )
            cpu.start()
            # the two loads in turn, first one then the other, so that neither always
            # follows the other: the server handles the release of the load before while
            # the next one's request waits (a load right after another took 60-70 us
            # longer at 2 MiB from DRAM, whichever kind it was)
            took: dict[str, float] = {}
            got_by: dict[str, LoadResult] = {}
            phases = ["ordinary", "shared", "new"] + (
                ["direct", "direct_new"] if direct_client is not None else []
            )
            if raw_file is not None:  # the same ordinary load without landed parts, paired
                # and each of the two first, second, third and last once in four rounds
                # (a load first after the raw reads, or right after another, is slower)
                phases[1:1] = ["ordinary_late"]
                if rep % 4 >= 2:
                    phases[:2] = phases[1::-1]
            for phase in phases if rep % 2 == 0 else phases[::-1]:
                t0 = time.perf_counter()
                if phase == "direct":
                    assert direct_client is not None and direct_lk is not None
                    got_by[phase] = direct_client.load(direct_lk, direct_bufs)
                elif phase == "direct_new":  # no buffers: read into the client's new arrays
                    assert direct_client is not None and direct_lk is not None
                    got_by[phase] = direct_client.load(direct_lk)
                elif phase == "new":  # no buffers: new arrays (the vLLM worker's loads)
                    got_by[phase] = remote.load(lk)
                elif phase == "ordinary_late":
                    remote._loads.early = False
                    try:
                        got_by[phase] = remote.load(lk, outs)
                    finally:
                        remote._loads.early = True
                else:
                    got_by[phase] = remote.load(lk, outs if phase == "ordinary" else shared)
                took[phase] = time.perf_counter() - t0
                cpu.stop(phase, rep > 0)
            res, res_shared = got_by["ordinary"], got_by["shared"]
            t, t_shared = took["ordinary"], took["shared"]
            checked = [(res, outs), (res_shared, shared)]
            if "ordinary_late" in got_by:
                checked.append((got_by["ordinary_late"], outs))
            if direct_client is not None:
                checked.append((got_by["direct"], direct_bufs))
                checked.append((got_by["direct_new"], list(got_by["direct_new"].arrays)))
            checked.append((got_by["new"], list(got_by["new"].arrays)))
            for got, bufs in checked:
                same = rep > 0 or all(same_bits(o, c) for o, c in zip(bufs, chunks, strict=True))
                if got.loaded != n or not same:
                    raise RuntimeError(f"load served {got.loaded} of {n} chunks, or wrong bytes")
            # the new arrays dropped: their memory goes back to the client's pool
            del got, bufs, checked, got_by
            # beside the raw file's reads, before and after them in turn: the raw reads
            # of the same bytes where the store's frames hold them
            frames_first = bool(frame_places) and rep % 2 == 1
            t_frames = raw_frame_reads(frame_places, heads, flat) if frames_first else 0.0
            cpu.stop("frames_raw", False)
            t_lim = (
                raw_read(raw_file, flat, direct) if raw_file is not None else memcpy(outs, chunks)
            )
            cpu.stop("raw", rep > 0)
            if frame_places and not frames_first:
                t_frames = raw_frame_reads(frame_places, heads, flat)
                cpu.stop("frames_raw", False)
            if frame_places and rep:
                frames_raw.append(t_frames)
            if raw_file is None and rep:  # the machine's fastest copy of the same bytes
                streams.append(streamed(outs, chunks))
            if copiers and raw_file is not None:  # the first round warms their buffers
                t_copied = min(c.read_copy(raw_file, outs, copies, direct) for c in copiers)
                if rep:
                    copied.append(t_copied)
            if direct_lk is not None and rep:
                verified.append(_verified_read(direct_lk, direct_bufs))
            if floor is not None and raw_file is not None:
                # outside the CPU tally's phases; before the served loads every other time
                t_floor = floor_first if rep % 2 else floor.load(chunks)
                if rep:
                    floored.append(t_floor)
            if rep:  # the first is a warm-up
                served.append(t)
                served_shared.append(t_shared)
                served_new.append(took["new"])
                limit.append(t_lim)
                if direct_client is not None:
                    served_direct.append(took["direct"])
                    served_direct_new.append(took["direct_new"])
                if "ordinary_late" in took:
                    served_late.append(took["ordinary_late"])
    finally:
        for c in copiers:
            c.close()
    del shared, direct_bufs
    # disk chunks the server read from their frames without pins (its loads with disk
    # hits where the extension is built: kvlife.store.frame_loads), from both clients
    frame_loads = remote.counters.frame_loads - frames_before
    if direct_client is not None and direct_client.direct_fallbacks():
        raise RuntimeError(
            f"{direct_client.direct_fallbacks()} chunks of the direct loads went through the server"
        )
    if raw_file is not None:
        raw_file.unlink(missing_ok=True)
    remote.invalidate(namespace=NS)
    others = {"floor": floored} if floored else {}
    others["new"] = served_new
    if copied:
        others["copied"] = copied
    if served_late:
        others["no_landed"] = served_late
    if served_direct:
        others["direct"] = served_direct
        others["direct_new"] = served_direct_new
        others["verified"] = verified
    if streams:
        others["stream"] = streams
    if frames_raw:
        others["frames_raw"] = frames_raw
    out = point(layout, n, served, limit, raw=raw_file is not None, shared=served_shared, **others)
    if streams:  # DRAM: the loads against the streaming copy (memcpy is not the fastest)
        out["of_stream"] = out["server_gbps"] / out["stream_gbps"]
        out["shared_of_stream"] = out["shared_gbps"] / out["stream_gbps"]
        out["new_of_stream"] = out["new_gbps"] / out["stream_gbps"]
    out["server_p99_ms"] = pct(served, 99) * 1e3
    if copied:  # the loads into the caller's buffers against their own ceiling
        out["ordinary_of_copied"] = out["server_gbps"] / out["copied_gbps"]
    if verified:  # the loads into shared buffers against theirs
        out["shared_of_verified"] = out["shared_gbps"] / out["verified_gbps"]
    if frames_raw:  # each load against raw reads of the very bytes it reads
        for name in ("server", "shared", "new", "direct", "direct_new", "verified"):
            if f"{name}_gbps" in out:
                out[f"{name}_of_frames_raw"] = out[f"{name}_gbps"] / out["frames_raw_gbps"]
    if served_late:  # what landed parts gain, paired round by round
        out["landed_time_ratio"] = float(
            np.median([a / b for a, b in zip(served, served_late, strict=True)])
        )
    if raw_file is not None:
        out["direct_io"] = direct
        out["frame_loaded_chunks"] = frame_loads
    if server_pid is not None:
        chunks_timed = cfg.reps * n
        out["cpu"] = cpu.per_chunk(chunks_timed) | {
            "hash_us_per_chunk": hash_cpu_per_chunk(layout.chunk_nbytes, quick=cfg.quick) * 1e6
        }
    return out


def _verified_read(lk: LookupResult, bufs: list[np.ndarray]) -> float:
    """Seconds to read and verify the lookup's frames into ``bufs`` in the extension
    alone (:func:`kvlife.client.direct.read_frames`: no request, no server, no load's
    Python): the ceiling of any verified disk load here, the hash's memory traffic
    beside the reads and the last frame's hash after them."""
    if not isinstance(lk, RemoteLookup) or len(lk.frames) != len(bufs):
        raise RuntimeError("the direct client's lookup named no frames for its disk hits")
    frames = [f for f in lk.frames if f is not None]
    t0 = time.perf_counter()
    got = read_frames(frames, bufs)
    took = time.perf_counter() - t0
    if got != len(frames):
        raise RuntimeError(f"{got} of {len(frames)} frames read and verified")
    return took


def _frame_places(lk: LookupResult | None) -> list[tuple[str, int]]:
    """Where each disk hit's frame lies (segment file, offset), from a direct client's
    lookup; none without one (no direct client: the point has no ``frames_raw``)."""
    if not isinstance(lk, RemoteLookup) or any(f is None for f in lk.frames):
        return []
    return [(f.path, f.off) for f in lk.frames if f is not None]


def shared_chunks(remote: RemoteStore, layout: KVLayout, n: int) -> list[np.ndarray]:
    """``n`` chunk buffers of ``layout`` in one shared buffer of ``remote``'s session."""
    raw = remote.alloc_buffer(n * layout.chunk_nbytes)
    size = layout.chunk_nbytes
    return [
        raw[i * size : (i + 1) * size].view(np.float16).reshape(layout.chunk_shape)
        for i in range(n)
    ]


class _CpuTally:
    """CPU seconds of this (client) process and of the server's threads, per phase of a
    load point: ``ordinary`` and ``shared`` loads, and the ``raw`` (or memcpy) limit,
    which runs in this process alone (the server's CPU meanwhile is its idle cost)."""

    def __init__(self, server_pid: int | None) -> None:
        self.pid = server_pid
        self.spent: dict[str, list[float]] = {}
        self._mark = (0.0, 0.0)

    def _now(self) -> tuple[float, float]:
        server = tasks_cpu_seconds(self.pid) if self.pid is not None else 0.0
        return process_cpu().total, server

    def start(self) -> None:
        self._mark = self._now()

    def stop(self, phase: str, keep: bool) -> None:
        now = self._now()
        if keep:
            got = self.spent.setdefault(phase, [0.0, 0.0])
            got[0] += now[0] - self._mark[0]
            got[1] += now[1] - self._mark[1]
        self._mark = now

    def per_chunk(self, chunks: int) -> dict[str, float]:
        """µs per chunk of each phase, client and server (``client_<phase>_us_per_chunk``,
        ``server_<phase>_us_per_chunk``)."""
        out: dict[str, float] = {}
        for phase, (client, server) in self.spent.items():
            out[f"client_{phase}_us_per_chunk"] = client / max(chunks, 1) * 1e6
            out[f"server_{phase}_us_per_chunk"] = server / max(chunks, 1) * 1e6
        return out


def bench_verified(
    cfg: ServerBenchConfig,
    work: Path,
    dram: int,
    shm: Path,
    servers: list[BenchServer],
    pin: tuple[str, ...],
) -> list[dict[str, Any]]:
    """The DRAM load points on a server that verifies every load against the seal."""
    srv = BenchServer(work / "v", dram, 4 * dram, shm, *pin, "--verify-dram-on-load")
    servers.append(srv)
    remote = srv.client()
    try:
        return [bench_load(cfg, remote, s, 50 + i, None) for i, s in enumerate(cfg.sizes)]
    finally:
        remote.close()
        srv.stop()
        servers.remove(srv)

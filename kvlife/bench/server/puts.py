"""Puts through the server against memcpy into DRAM, and (write-through) against a raw
write plus fdatasync; the same puts into an in-process store beside."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from kvlife.bench.limits import (
    SplitSealer,
    memcpy,
    raw_write,
    sealed_copy,
    streamed,
    tasks_cpu_seconds,
)
from kvlife.bench.server.config import ServerBenchConfig
from kvlife.bench.server.floor import FloorServer
from kvlife.bench.server.servers import direct_ok
from kvlife.bench.server.workload import (
    NS,
    aligned_copy,
    bench_identity,
    chunk_layout,
    out_buffers,
    point,
    prompt,
    split_chunks,
)
from kvlife.client import RemoteStore
from kvlife.store import KVStore


def bench_put(
    cfg: ServerBenchConfig,
    remote: RemoteStore,
    size: int,
    seed: int,
    raw_dir: Path | None,
    embedded: KVStore | None = None,
    floor: FloorServer | None = None,
    server_pid: int | None = None,
) -> dict[str, Any]:
    """Put fresh prompts (invalidated after each, outside the timing); the limit is
    memcpy into warm DRAM, or (write-through server: ``raw_dir``) a raw write of the
    same bytes plus fdatasync. ``embedded``: the same puts into an in-process store too
    (what the store core costs without the server). A put within the client's
    ``SEAL_PUT_BYTES`` is sealed by the client as it copies (kvlife/client/puts.py). DRAM
    puts are timed twice more with the server hashing the chunks, interleaved: told by
    ``put_written`` notices as the client copies (``server_hashed``: how every put was
    made before 2026-12-07, and still above the threshold), and without the notices
    (``unnoticed``: every chunk at the commit, as before issue 28); and beside
    them the two ceilings of a verified put with no bookkeeping at all: the copy and its
    seal on one thread (``sealed``: what an in-process put cannot beat) and with the seal
    on a second thread, MiB by MiB (``split``: the served put's split of the work, the
    client copying while the server hashes; the served put, whose notices the server
    hashes as they come, passed it at 16 MiB once both copies streamed, so it is a
    reference, not a bound); and the client's streaming copy alone (``stream``: the
    machine's fastest copy of those bytes, ``of_stream`` the put against it). ``floor``:
    the same put through a bare server
    with no store, timed beside (:mod:`kvlife.bench.server.floor`): the server hashing
    what the notices say is written (``floor``), the client hashing as it copies and
    sending the seals (``floor_sealed``). ``server_pid``: the CPU each put cost the
    server (and the floor's server its put), beside its time (``server_cpu``: what
    bounds a put whose server is busy for most of it). DRAM puts: the server's time in
    each half of the put, the store's prepare and its commit (``server_halves``,
    :class:`_StoreHalves`)."""
    layout = chunk_layout(size)
    ident = bench_identity(layout)
    n = cfg.chunks_per_call
    dsts = out_buffers(layout, n)
    direct = raw_dir is not None and direct_ok(raw_dir)
    served, limit, inproc, unnoticed = [], [], [], []
    hashed: list[float] = []
    sealed: list[float] = []
    split: list[float] = []
    stream: list[float] = []
    floored: list[float] = []
    floored_sealed: list[float] = []
    sealer = SplitSealer() if raw_dir is None else None
    halves = _StoreHalves(remote) if raw_dir is None else None
    cpu = _ServerCpu(server_pid, floor.proc.pid if floor is not None and floor.proc else None)
    try:
        for rep in range(cfg.reps + 1):
            tokens, kv = prompt(layout, n, seed * 1000 + rep)
            chunks = split_chunks(kv, layout, n)
            src = [aligned_copy(c) for c in chunks] if raw_dir is not None else chunks

            def limit_once(src: list[np.ndarray] = src, chunks: list[np.ndarray] = chunks) -> float:
                if raw_dir is not None:  # O_DIRECT needs aligned memory
                    return raw_write(raw_dir / "raw-put", src, direct)
                return memcpy(dsts, chunks)

            def put_once(
                how: str = "", tokens: list[int] = tokens, chunks: list[np.ndarray] = chunks
            ) -> float:
                """One timed put: as the client makes it (``how`` empty), or with the
                server hashing the chunks (``server_hashed``: told by ``put_written``,
                no seals from the client; ``unnoticed``: every chunk at the commit)."""
                puts = remote._puts
                least, sealing = puts.notice_bytes, puts.seal_copies
                if how:
                    puts.seal_copies = False
                if how == "unnoticed":  # the commit hashes every chunk, as before issue 28
                    puts.notice_bytes = 0
                try:
                    c0 = cpu.server() if not how else 0.0
                    t0 = time.perf_counter()
                    res = remote.put_prompt(ident, NS, tokens, chunks)
                    took = time.perf_counter() - t0
                    if not how:
                        cpu.served(cpu.server() - c0, took)
                finally:
                    puts.notice_bytes, puts.seal_copies = least, sealing
                if res.stored != n:
                    raise RuntimeError(f"put stored {res.stored} of {n} chunks")
                remote.invalidate(namespace=NS)
                if halves is not None:
                    halves.after_put(not how)
                return took

            # the order alternates, so that neither side always finds the source in cache
            notice = remote._puts.notice_bytes
            if floor is not None and rep % 2:
                t_floor, t_sealed_floor = (
                    cpu.floor_put(floor, chunks, notice),
                    floor.put(chunks, 0, True),
                )
            t_lim = limit_once() if rep % 2 else 0.0
            if raw_dir is None and rep % 2:  # DRAM: the same put hashed by the server too
                unnoticed.append(put_once("unnoticed"))
                hashed.append(put_once("server_hashed"))
            t = put_once()
            if raw_dir is None and not rep % 2:
                hashed.append(put_once("server_hashed"))
                unnoticed.append(put_once("unnoticed"))
            if not rep % 2:
                t_lim = limit_once()
            if embedded is not None:
                t0 = time.perf_counter()
                mine = embedded.put_prompt(ident, NS, tokens, chunks)
                inproc.append(time.perf_counter() - t0)
                if mine.stored != n:
                    raise RuntimeError(f"in-process put stored {mine.stored} of {n} chunks")
                embedded.invalidate(namespace=NS)
            if floor is not None:
                if not rep % 2:
                    t_sealed_floor = floor.put(chunks, 0, True)
                    t_floor = cpu.floor_put(floor, chunks, notice)
                if rep:
                    floored.append(t_floor)
                    floored_sealed.append(t_sealed_floor)
            if sealer is not None:  # the ceilings, on the same (warm) sources
                t_sealed, t_split = sealed_copy(dsts, chunks), sealer.copy(dsts, chunks)
                t_stream = streamed(dsts, chunks)
                if rep:
                    sealed.append(t_sealed)
                    split.append(t_split)
                    stream.append(t_stream)
            if rep:
                served.append(t)
                limit.append(t_lim)
    finally:
        if sealer is not None:
            sealer.close()
    if raw_dir is not None:
        (raw_dir / "raw-put").unlink(missing_ok=True)
    others = {"inproc": inproc[1:]} if inproc else {}  # the first is a warm-up
    if unnoticed:
        others["unnoticed"] = unnoticed[1:]
        others["server_hashed"] = hashed[1:]
    if sealed:
        others |= {"sealed": sealed, "split": split, "stream": stream}
    if floored:
        others |= {"floor": floored, "floor_sealed": floored_sealed}
    out = point(layout, n, served, limit, raw=raw_dir is not None, **others)
    if stream:  # the put against the client's own copy alone (streaming stores)
        out["of_stream"] = out["server_gbps"] / out["stream_gbps"]
    if raw_dir is not None:
        out["direct_io"] = direct
    if cpu.spent:
        out["server_cpu"] = cpu.summary()
    if halves is not None and halves.per_put:
        out["server_halves"] = halves.summary()
    return out


class _StoreHalves:
    """The server's time in each half of a timed put, from its own latency histograms
    (``stats``, read after each put's invalidation, outside the timing: no request
    between two reads but one put and its invalidation): the ``put`` verb (the store's
    prepare, the replacement extents staged; while the client copies) and ``put_commit``
    (what the notices left to hash, the store's commit, the reply built; after the last
    byte is copied). Beside the server's CPU per put (:class:`_ServerCpu`), the rest of
    it is hashing what the notices said was written and reading the requests."""

    HALVES = ("store_prepare", "store_commit")

    def __init__(self, remote: RemoteStore) -> None:
        self.remote = remote
        self.per_put: list[tuple[float, ...]] = []
        self.last = self._sums()

    def _sums(self) -> tuple[float, ...]:
        latency = self.remote.server_stats(events=0)["latency"]
        return tuple(float(latency[h]["sum"]) for h in self.HALVES)

    def after_put(self, timed: bool) -> None:
        """Read the sums after a put and its invalidation; ``timed``: the put is one
        of the point's (with notices), kept."""
        now = self._sums()
        if timed:
            self.per_put.append(tuple(b - a for a, b in zip(self.last, now, strict=True)))
        self.last = now

    def summary(self) -> dict[str, float]:
        """``prepare_ms`` and ``commit_ms``: medians per put after the warm-up."""
        timed = self.per_put[1:] or self.per_put
        return {
            "prepare_ms": float(np.median([t[0] for t in timed])) * 1e3,
            "commit_ms": float(np.median([t[1] for t in timed])) * 1e3,
        }


class _ServerCpu:
    """The CPU the server spent on each timed put (its threads' time, read before and
    after the put, outside the timing), beside the put's time; the same for the floor's
    server. Medians over the puts after the warm-up."""

    def __init__(self, server_pid: int | None, floor_pid: int | None) -> None:
        self.pid = server_pid
        self.floor_pid = floor_pid if server_pid is not None else None
        self.spent: list[tuple[float, float]] = []
        self.floor_spent: list[float] = []

    def server(self) -> float:
        return tasks_cpu_seconds(self.pid) if self.pid is not None else 0.0

    def served(self, cpu_s: float, wall_s: float) -> None:
        if self.pid is not None:
            self.spent.append((cpu_s, wall_s))

    def floor_put(self, floor: FloorServer, chunks: list[np.ndarray], notice: int) -> float:
        if self.floor_pid is None:
            return floor.put(chunks, notice)
        c0 = tasks_cpu_seconds(self.floor_pid)
        took = floor.put(chunks, notice)
        self.floor_spent.append(tasks_cpu_seconds(self.floor_pid) - c0)
        return took

    def summary(self) -> dict[str, float]:
        """``ms_per_put`` (the server's CPU per put), ``busy`` (that CPU over the put's
        time: near 1, the server's CPU bounds the put) and ``floor_ms_per_put``."""
        timed = self.spent[1:] or self.spent
        out = {
            "ms_per_put": float(np.median([c for c, _ in timed])) * 1e3,
            "busy": float(np.median([c / w for c, w in timed if w > 0])),
        }
        if self.floor_spent:
            out["floor_ms_per_put"] = (
                float(np.median(self.floor_spent[1:] or self.floor_spent)) * 1e3
            )
        return out

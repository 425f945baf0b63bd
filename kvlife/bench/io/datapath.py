"""The data path of ``kvlife bench io``: kvlife's memory and disk tiers against the
machine's limits (:mod:`kvlife.bench.limits`), one object size at a time.

Each repetition is a paired round, limits and kvlife interleaved, in an order that
rotates with the repetition; every result is checked for the bytes it should hold.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from kvlife.bench.io.config import IOBenchConfig, MiB, size_label
from kvlife.bench.io.device_time import DeviceTimedIO
from kvlife.bench.limits import alloc_copy, memcpy, raw_read, raw_write
from kvlife.bench.peer_lmcache import LMCacheDiskPeer
from kvlife.core.identity import ChunkKey
from kvlife.tiers.base import ReplicaMeta, seal_of
from kvlife.tiers.buffers import ALIGN, aligned_empty
from kvlife.tiers.disk import DiskTier
from kvlife.tiers.memory import MemoryTier


def _fresh_keys(n: int) -> list[ChunkKey]:
    return [ChunkKey(os.urandom(32)) for _ in range(n)]


def _unaligned_empty(nbytes: int) -> np.ndarray:
    """A uint8 array of ``nbytes`` whose data pointer is *not* 4096-aligned (64 past)."""
    raw = np.empty(nbytes + 2 * ALIGN, dtype=np.uint8)
    offset = (-raw.ctypes.data) % ALIGN + 64
    return raw[offset : offset + nbytes]


@dataclass(slots=True)
class Batch:
    """The buffers of one object size: payloads (aligned and not) and output buffers."""

    size: int
    aligned: list[np.ndarray]
    unaligned: list[np.ndarray]
    outs: list[np.ndarray]

    @classmethod
    def make(cls, size: int, n: int, rng: np.random.Generator) -> Batch:
        pattern = rng.integers(0, 256, size=min(size, 4 * MiB), dtype=np.uint8)
        src = aligned_empty(n * size)
        uns = _unaligned_empty(n * size)
        out = aligned_empty(n * size)
        for block in (src, uns):
            for off in range(0, block.size, pattern.size):
                m = min(pattern.size, block.size - off)
                block[off : off + m] = pattern[:m]
        out.fill(0)  # fault every page in now, not inside a timed copy
        aligned = [src[i * size : (i + 1) * size] for i in range(n)]
        unaligned = [uns[i * size : (i + 1) * size] for i in range(n)]
        for i in range(n):  # tag each object so that a mix-up shows in the checks
            aligned[i][:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)
            unaligned[i][:8] = aligned[i][:8]
        return cls(size, aligned, unaligned, [out[i * size : (i + 1) * size] for i in range(n)])

    @property
    def nbytes(self) -> int:
        return self.size * len(self.aligned)


def _check_same(got: Sequence[np.ndarray], want: Sequence[np.ndarray], what: str) -> None:
    for i in {0, len(want) - 1}:
        g = np.asarray(got[i]).reshape(-1).view(np.uint8)
        if not np.array_equal(g, want[i]):
            raise RuntimeError(f"{what}: object {i} came back with wrong bytes")


@dataclass(slots=True)
class DataPathRun:
    config: IOBenchConfig
    raw_dir: Path
    """Where the raw-limit files go: the disk tier's own directory."""
    direct: bool
    disk: DiskTier
    rng: np.random.Generator
    bar: tqdm
    peer: LMCacheDiskPeer | None = None
    samples: dict[str, dict[str, list[float]]] = field(default_factory=dict)


def _metas(keys: Sequence[ChunkKey], size: int) -> list[ReplicaMeta]:
    return [ReplicaMeta(k, "uint8", (size,)) for k in keys]


def _rotate(ops: list[Callable[[], None]], k: int) -> None:
    """Run ``ops`` starting at index ``k`` mod len: no operation always goes first."""
    k %= len(ops)
    for op in ops[k:] + ops[:k]:
        op()


def bench_size(ctx: DataPathRun, size: int) -> dict[str, list[float]]:
    """All repetitions for one object size; returns seconds per metric per repetition."""
    b = Batch.make(size, ctx.config.batch, ctx.rng)
    mem = MemoryTier(b.nbytes, name="bench-dram")
    samples: dict[str, list[float]] = {}
    for rep in range(ctx.config.repeat):
        ctx.bar.set_description(f"bench io {size_label(size)} #{rep + 1}")
        _one_repetition(ctx, b, mem, rep, samples)
        ctx.bar.update(1)
    return samples


def _one_repetition(
    ctx: DataPathRun, b: Batch, mem: MemoryTier, rep: int, samples: dict[str, list[float]]
) -> None:
    """One paired round: memory, then disk writes, then disk reads of those writes.

    Within each group the order rotates with ``rep`` so that no operation is always
    first (the first one after a delete or an allocation may pay for it).
    """
    n, size, peer = len(b.aligned), b.size, ctx.peer

    def add(metric: str, seconds: float) -> None:
        samples.setdefault(metric, []).append(seconds)

    mem_keys = _fresh_keys(n)

    def mem_tier() -> None:
        keys = mem_keys
        metas = _metas(keys, size)
        t0 = time.perf_counter()
        if not mem.store(metas, b.aligned):
            raise RuntimeError("memory tier refused a batch that fits its capacity")
        add("mem_put", time.perf_counter() - t0)
        t0 = time.perf_counter()
        got = mem.read_batch(keys, b.outs)
        add("mem_get", time.perf_counter() - t0)
        _check_same(_verified(got, "memory tier get"), b.aligned, "memory tier get")
        t0 = time.perf_counter()
        views = mem.read_batch(keys)
        add("mem_get_zero_copy", time.perf_counter() - t0)
        _check_same(_verified(views, "memory tier view"), b.aligned, "memory tier view")
        t0 = time.perf_counter()
        got = mem.read_verified(keys, b.outs)
        add("mem_get_verified", time.perf_counter() - t0)
        _check_same(_verified(got, "memory tier verified get"), b.aligned, "verified get")
        t0 = time.perf_counter()
        views = mem.read_verified(keys)
        add("mem_get_verified_zero_copy", time.perf_counter() - t0)
        _check_same(_verified(views, "memory tier verified view"), b.aligned, "verified view")

    def seal() -> None:
        t0 = time.perf_counter()
        for a in b.aligned:
            seal_of(a)
        add("seal", time.perf_counter() - t0)

    _rotate(
        [
            lambda: add("memcpy", memcpy(b.outs, b.aligned)),
            mem_tier,
            lambda: add("alloc_copy", alloc_copy(b.aligned)),
            seal,
        ],
        rep,
    )

    raw_path = ctx.raw_dir / f"raw-{size_label(size)}-{rep}.bin"
    keys_a = _fresh_keys(n)
    keys_u = _fresh_keys(n)
    keys_w = _fresh_keys(n)
    keys_s = _fresh_keys(n)
    held = _verified(mem.read_batch(mem_keys), "memory tier view")  # write-back sources
    peer_keys: list[object] = []

    timed = ctx.disk.io if isinstance(ctx.disk.io, DeviceTimedIO) else None

    def store(keys: list[ChunkKey], payloads: list[np.ndarray], metric: str) -> None:
        metas = _metas(keys, size)
        device = timed.seconds if timed is not None else 0.0
        t0 = time.perf_counter()
        if not ctx.disk.store(metas, payloads):
            raise RuntimeError("disk tier refused a batch: capacity budget too small")
        add(metric, time.perf_counter() - t0)
        if timed is not None:  # of which inside the device's write calls
            add(metric + "_device", timed.seconds - device)

    def peer_store() -> None:
        assert peer is not None
        keys, secs = peer.store(b.aligned)
        peer_keys.extend(keys)
        add("peer_store", secs)

    def demote() -> None:
        """The store's demotion: the disk checks each replica's seal as it hashes the
        frame (one hash, overlapped with the writes as in a plain store)."""
        t0 = time.perf_counter()
        src = _verified(mem.read_batch(mem_keys), "memory tier view")
        metas = [
            ReplicaMeta(k, "uint8", (size,), checksum=mem.meta(m).checksum, verify_checksum=True)
            for k, m in zip(keys_s, mem_keys, strict=True)
        ]
        if not ctx.disk.store(metas, src):
            raise RuntimeError("disk tier refused a batch: capacity budget too small")
        add("disk_writeback_sealed", time.perf_counter() - t0)

    writes: list[Callable[[], None]] = [
        lambda: add("raw_write", raw_write(raw_path, b.aligned, ctx.direct)),
        lambda: store(keys_a, b.aligned, "disk_store"),
        lambda: store(keys_u, b.unaligned, "disk_store_unaligned"),
        lambda: store(keys_w, held, "disk_writeback"),
        demote,
    ]
    if peer is not None:
        writes.append(peer_store)
    _rotate(writes, rep)

    # reads of what was just written; with O_DIRECT they come from the device
    def raw_load() -> None:
        add("raw_read", raw_read(raw_path, b.outs, ctx.direct))
        _check_same(b.outs, b.aligned, "raw read")

    def load_into() -> None:
        t0 = time.perf_counter()
        got = ctx.disk.read_batch(keys_a, b.outs)
        add("disk_load", time.perf_counter() - t0)
        _check_same(_verified(got, "disk load"), b.aligned, "disk load")

    def load_new() -> None:
        t0 = time.perf_counter()
        got = ctx.disk.read_batch(keys_u)
        add("disk_load_new", time.perf_counter() - t0)
        _check_same(_verified(got, "disk load (new arrays)"), b.aligned, "disk load new")

    def peer_load() -> None:
        assert peer is not None
        add("peer_load", peer.load(peer_keys, b.aligned))

    reads: list[Callable[[], None]] = [raw_load, load_into, load_new]
    if peer is not None:
        reads.append(peer_load)
    _rotate(reads, rep)

    held.clear()
    for k in mem_keys:
        mem.delete(k)
    _check_same(
        _verified(ctx.disk.read_batch(keys_s[:1] + keys_s[-1:]), "sealed write-back"),
        [b.aligned[0], b.aligned[-1]],
        "sealed write-back",
    )
    ctx.disk.delete_batch(keys_a + keys_u + keys_w + keys_s)
    raw_path.unlink()
    if peer is not None:
        peer.drop(peer_keys)


def _verified(results: Sequence[object], what: str) -> list[np.ndarray]:
    arrays: list[np.ndarray] = []
    for r in results:
        if not isinstance(r, np.ndarray):
            raise RuntimeError(f"{what}: a replica failed verification: {r}")
        arrays.append(r)
    return arrays

"""``kvlife bench io``: kvlife's data path against the limits of the machine, in one run.

A storage layer for KV caches is only worth its checksums and its commit protocol if
they cost almost nothing next to what the hardware allows. This benchmark measures, in
the same process, directory and run (limits and kvlife interleaved, repetition by
repetition, so that noise from a shared machine hits both alike):

limits
    numpy memcpy (``np.copyto`` into warm, preallocated arrays); raw sequential write
    of the batch into a fresh file opened with O_DIRECT (one ``os.pwrite`` per object
    from 4096-aligned memory, then one ``fdatasync``) and O_DIRECT read of the same
    objects into aligned buffers, in the directory that holds kvlife's segments;
kvlife
    :class:`~kvlife.tiers.memory.MemoryTier` put (one copy, sealed with xxh3-128 block
    by block) and get into caller buffers, plain and verified against the seal (what
    ``verify_dram_on_load`` costs); :class:`~kvlife.tiers.disk.DiskTier` store
    (xxh3-128 framing, fdatasync, SQLite commit) from 4096-aligned memory (the
    headline: zero-copy direct I/O), from unaligned caller memory (one staging copy)
    and from the memory tier's own held arrays (the DRAM write-back path; and the
    store's demotion path, where the disk checks the DRAM seal as it hashes the frame,
    no second hash), and verified loads into the caller's aligned buffers
    (headline) and into new arrays (``store.load(hit)`` without buffers: the arrays
    come from memory recycled when earlier results were garbage collected, so the
    first repetition pays fresh pages and later ones do not; the first one is reported
    apart); plus the time of :meth:`~kvlife.store.KVStore.lookup` of a 128-chunk
    prompt, BLAKE3 chunk keys included;
diagnostics
    copy into freshly allocated arrays vs memcpy: the first-touch page-fault cost that
    any path allocating per object pays; the seal alone (xxh3-128 of the batch) against
    memcpy and its share of a memory tier put.

Ratios are throughput ratios, kvlife ÷ limit, taken per repetition (paired) and
reported as their median; above 1 means faster than the limit, which noise allows.
GB/s are 10**9 bytes per second of payload (kvlife's frame headers are its own cost).
With ``--peer lmcache`` the same workload also runs through LMCache's LocalDiskBackend
(see :mod:`kvlife.bench.peer_lmcache`).

:func:`run_io_bench` returns the JSON document; :func:`main` is the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from kvlife.bench.peer_lmcache import LMCacheDiskPeer, PeerUnavailable, check_available
from kvlife.core.identity import PUBLIC, ChunkKey, KVLayout, ModelIdentity, prompt_chunk_keys
from kvlife.report import format_table
from kvlife.store import KVStore
from kvlife.tiers.base import ReplicaMeta, seal_of
from kvlife.tiers.buffers import ALIGN, aligned_empty
from kvlife.tiers.disk import DiskTier, DiskTierConfig
from kvlife.tiers.disk.fileio import probe_direct_io
from kvlife.tiers.disk.frame import frame_len
from kvlife.tiers.memory import MemoryTier

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

DEFAULT_SIZES = (256 * KiB, 2 * MiB, 16 * MiB)
QUICK_SIZES = (16 * KiB, 64 * KiB)
LOOKUP_CHUNKS = 128
PEERS = ("lmcache",)

DISK_TARGET = 0.9
"""Minimum disk store/load ratio vs raw O_DIRECT, for objects of TARGET_MIN_BYTES and up."""
MEM_TARGET = 0.8
"""Minimum memory tier put/get ratio vs memcpy, for objects of TARGET_MIN_BYTES and up."""
USER_PATH_TARGET = 0.85
"""Minimum ratio of the paths users take (stores from unaligned caller memory, DRAM
write-back, loads into new arrays) against the same raw limit, from TARGET_MIN_BYTES up."""
TARGET_MIN_BYTES = 2 * MiB
LOOKUP_TARGET_US = 500.0
"""Maximum time to look up a 128-chunk prompt, key computation included."""

SCHEMA_VERSION = 1


@dataclass(frozen=True, slots=True)
class IOBenchConfig:
    """What one run of the I/O benchmark measures."""

    sizes: tuple[int, ...] = DEFAULT_SIZES
    """Object sizes in bytes (positive multiples of 4096, as O_DIRECT needs)."""
    batch: int = 64
    """Objects per batch (one store or load call)."""
    repeat: int = 5
    """Repetitions per size; medians are reported."""
    directory: Path | None = None
    """Where the scratch directory is made (None: the current directory; it is removed
    at the end). Limits and kvlife share it, so they share the filesystem and device."""
    peer: str | None = None
    """Also run the workload through a peer (``lmcache``)."""
    lookup_iters: int = 300
    """Timed lookups of the 128-chunk prompt (median reported)."""
    lookup_tokens_per_chunk: int = 256
    """Tokens per chunk of the lookup prompt (LMCache's default chunk size)."""
    progress: bool = True
    """Show a tqdm progress bar on stderr."""
    quick: bool = False
    """Set by ``--quick``: tiny sizes and batches, for tests (numbers mean nothing)."""

    def __post_init__(self) -> None:
        if not self.sizes:
            raise ValueError("at least one object size is needed")
        for s in self.sizes:
            if s <= 0 or s % ALIGN:
                raise ValueError(f"object size {s} is not a positive multiple of {ALIGN}")
        if self.batch < 1 or self.repeat < 1 or self.lookup_iters < 1:
            raise ValueError("batch, repeat and lookup_iters must be >= 1")
        if self.lookup_tokens_per_chunk < 1:
            raise ValueError("lookup_tokens_per_chunk must be >= 1")
        if self.peer is not None and self.peer not in PEERS:
            raise ValueError(f"unknown peer {self.peer!r}; known: {', '.join(PEERS)}")

    @classmethod
    def quick_config(cls, **overrides: object) -> IOBenchConfig:
        """Tiny sizes and batches: seconds, for tests."""
        base = cls(sizes=QUICK_SIZES, batch=4, repeat=2, lookup_iters=20, quick=True)
        return replace(base, **overrides)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- helpers

_UNITS = {"": 1, "B": 1, "K": KiB, "KB": KiB, "KIB": KiB, "M": MiB, "MB": MiB, "MIB": MiB}
_UNITS |= {"G": GiB, "GB": GiB, "GIB": GiB}


def parse_size(text: str) -> int:
    """``"256KiB"``, ``"2MiB"``, ``"16M"`` or ``"4096"`` → bytes (binary units)."""
    t = text.strip().upper()
    i = len(t)
    while i and not t[i - 1].isdigit():
        i -= 1
    num, unit = t[:i], t[i:].strip()
    if not num.isdigit() or unit not in _UNITS:
        raise ValueError(f"cannot read size {text!r} (use e.g. 256KiB, 2MiB, 16MiB)")
    return int(num) * _UNITS[unit]


def size_label(n: int) -> str:
    """Bytes as the shortest exact binary-unit label: 262144 → ``"256KiB"``."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def _mount_of(path: Path) -> tuple[str, str, str]:
    """(mount point, filesystem type, source) of the mount holding ``path``."""
    real = os.path.realpath(path)
    best = ("/", "unknown", "unknown")
    try:
        with open("/proc/mounts", encoding="utf-8") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) < 3:
                    continue
                src, mnt, fstype = parts[0], parts[1].replace("\\040", " "), parts[2]
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best[0]):
                    best = (mnt, fstype, src)
    except OSError:
        pass
    return best


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read().strip()
    except OSError:
        return "unknown"


def _fresh_keys(n: int) -> list[ChunkKey]:
    return [ChunkKey(os.urandom(32)) for _ in range(n)]


def _unaligned_empty(nbytes: int) -> np.ndarray:
    """A uint8 array of ``nbytes`` whose data pointer is *not* 4096-aligned (64 past)."""
    raw = np.empty(nbytes + 2 * ALIGN, dtype=np.uint8)
    offset = (-raw.ctypes.data) % ALIGN + 64
    return raw[offset : offset + nbytes]


@dataclass(slots=True)
class _Batch:
    """The buffers of one object size: payloads (aligned and not) and output buffers."""

    size: int
    aligned: list[np.ndarray]
    unaligned: list[np.ndarray]
    outs: list[np.ndarray]

    @classmethod
    def make(cls, size: int, n: int, rng: np.random.Generator) -> _Batch:
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


# ---------------------------------------------------------------------------- limits


def raw_write(path: Path, payloads: Sequence[np.ndarray], direct: bool) -> float:
    """Seconds to write ``payloads`` back to back into a new file, then fdatasync it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    t0 = time.perf_counter()
    fd = os.open(path, flags, 0o644)
    try:
        off = 0
        for p in payloads:
            n = os.pwrite(fd, p.data, off)
            if n != p.nbytes:
                raise OSError(f"short raw write: {n} of {p.nbytes} bytes")
            off += n
        os.fdatasync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def raw_read(path: Path, outs: Sequence[np.ndarray], direct: bool) -> float:
    """Seconds to read the objects of ``path`` (laid out back to back) into ``outs``."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        t0 = time.perf_counter()
        off = 0
        for o in outs:
            n = os.preadv(fd, [o.data], off)
            if n != o.nbytes:
                raise OSError(f"short raw read: {n} of {o.nbytes} bytes")
            off += n
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def memcpy(dst: Sequence[np.ndarray], src: Sequence[np.ndarray]) -> float:
    """Seconds to ``np.copyto`` each source object into its (warm) destination."""
    t0 = time.perf_counter()
    for d, s in zip(dst, src, strict=True):
        np.copyto(d, s)
    return time.perf_counter() - t0


def alloc_copy(src: Sequence[np.ndarray]) -> float:
    """Seconds to copy each object into a newly allocated array (what a copying put
    that allocates per object pays: the copy plus first-touch page faults)."""
    held: list[np.ndarray] = []
    t0 = time.perf_counter()
    for s in src:
        a = np.empty(s.shape, s.dtype)
        np.copyto(a, s)
        held.append(a)
    elapsed = time.perf_counter() - t0
    held.clear()
    return elapsed


# ---------------------------------------------------------------------------- the run


@dataclass(slots=True)
class _Context:
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


def _bench_size(ctx: _Context, size: int) -> dict[str, list[float]]:
    """All repetitions for one object size; returns seconds per metric per repetition."""
    b = _Batch.make(size, ctx.config.batch, ctx.rng)
    mem = MemoryTier(b.nbytes, name="bench-dram")
    samples: dict[str, list[float]] = {}
    for rep in range(ctx.config.repeat):
        ctx.bar.set_description(f"bench io {size_label(size)} #{rep + 1}")
        _one_repetition(ctx, b, mem, rep, samples)
        ctx.bar.update(1)
    return samples


def _one_repetition(
    ctx: _Context, b: _Batch, mem: MemoryTier, rep: int, samples: dict[str, list[float]]
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

    def store(keys: list[ChunkKey], payloads: list[np.ndarray], metric: str) -> None:
        metas = _metas(keys, size)
        t0 = time.perf_counter()
        if not ctx.disk.store(metas, payloads):
            raise RuntimeError("disk tier refused a batch: capacity budget too small")
        add(metric, time.perf_counter() - t0)

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


def _bench_lookup(cfg: IOBenchConfig, workdir: Path) -> dict[str, float | int]:
    """Median time of ``KVStore.lookup`` for a 128-chunk prompt held in DRAM."""
    tpc = cfg.lookup_tokens_per_chunk
    layout = KVLayout(
        num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", tokens_per_chunk=tpc
    )
    identity = ModelIdentity("bench-model", "bench-weights", "bench-tokenizer", layout)
    ntok = LOOKUP_CHUNKS * tpc
    tokens = np.random.default_rng(7).integers(0, 128_000, size=ntok, dtype=np.int32)
    token_list = tokens.tolist()
    kv = np.zeros((2, 2, 2, ntok, 16), dtype=np.float16)
    dram = 2 * LOOKUP_CHUNKS * layout.chunk_nbytes + MiB
    with KVStore.open(workdir / "lookup-store", dram_bytes=dram, disk_bytes=0) as store:
        put = store.put_prompt(identity, PUBLIC, tokens, kv)
        if put.stored != LOOKUP_CHUNKS:
            raise RuntimeError(f"lookup store kept {put.stored} of {LOOKUP_CHUNKS} chunks")

        def timed(fn: Callable[[], object], iters: int) -> list[float]:
            for _ in range(min(10, iters)):
                fn()
            out = []
            for _ in range(iters):
                t0 = time.perf_counter_ns()
                fn()
                out.append((time.perf_counter_ns() - t0) / 1e3)
            return out

        hit = store.lookup(identity, PUBLIC, tokens)
        if len(hit.hits) != LOOKUP_CHUNKS:
            raise RuntimeError(f"lookup found {len(hit.hits)} of {LOOKUP_CHUNKS} chunks")
        iters = cfg.lookup_iters
        look = timed(lambda: store.lookup(identity, PUBLIC, tokens), iters)
        keys = timed(lambda: prompt_chunk_keys(identity, PUBLIC, tokens), iters)
        look_list = timed(lambda: store.lookup(identity, PUBLIC, token_list), max(iters // 3, 1))
    return {
        "chunks": LOOKUP_CHUNKS,
        "tokens_per_chunk": tpc,
        "iterations": iters,
        "median_us": _median(look),
        "p90_us": float(np.percentile(look, 90)),
        "min_us": min(look),
        "key_computation_median_us": _median(keys),
        "tokens_as_list_median_us": _median(look_list),
    }


@dataclass(slots=True)
class _SizeSummary:
    limits: dict[str, float | int]
    kvlife: dict[str, float]
    ratios: dict[str, float]
    diagnostics: dict[str, float]
    peer: dict[str, float]


def _summarise(size: int, n: int, s: dict[str, list[float]]) -> _SizeSummary:
    nbytes = size * n

    def rate(metric: str) -> float:
        return _median([_gbps(nbytes, t) for t in s[metric]])

    def ratio(metric: str, limit: str) -> float:
        # paired per repetition: limit time / kvlife time = kvlife GB/s / limit GB/s
        return _median([lim / t for t, lim in zip(s[metric], s[limit], strict=True)])

    peer: dict[str, float] = {}
    if "peer_store" in s:
        peer = {
            "store_gbps": rate("peer_store"),
            "load_gbps": rate("peer_load"),
            "store_vs_raw": ratio("peer_store", "raw_write"),
            "load_vs_raw": ratio("peer_load", "raw_read"),
        }
    return _SizeSummary(
        limits={
            "object_bytes": size,
            "batch": n,
            "memcpy_gbps": rate("memcpy"),
            "raw_write_gbps": rate("raw_write"),
            "raw_read_gbps": rate("raw_read"),
        },
        kvlife={
            "mem_put_gbps": rate("mem_put"),
            "mem_get_gbps": rate("mem_get"),
            "mem_get_zero_copy_us_per_object": _median(
                [t / n * 1e6 for t in s["mem_get_zero_copy"]]
            ),
            "disk_store_gbps": rate("disk_store"),
            "disk_store_unaligned_gbps": rate("disk_store_unaligned"),
            "disk_writeback_gbps": rate("disk_writeback"),
            "disk_load_gbps": rate("disk_load"),
            "disk_load_new_gbps": rate("disk_load_new"),
            "seal_gbps": rate("seal"),
            "mem_get_verified_gbps": rate("mem_get_verified"),
            "mem_get_verified_zero_copy_gbps": rate("mem_get_verified_zero_copy"),
            "disk_writeback_sealed_gbps": rate("disk_writeback_sealed"),
        },
        ratios={
            "disk_store_vs_raw": ratio("disk_store", "raw_write"),
            "disk_load_vs_raw": ratio("disk_load", "raw_read"),
            "mem_put_vs_memcpy": ratio("mem_put", "memcpy"),
            "mem_get_vs_memcpy": ratio("mem_get", "memcpy"),
            "disk_store_unaligned_vs_raw": ratio("disk_store_unaligned", "raw_write"),
            "disk_writeback_vs_raw": ratio("disk_writeback", "raw_write"),
            "disk_load_new_vs_raw": ratio("disk_load_new", "raw_read"),
            "mem_get_verified_vs_memcpy": ratio("mem_get_verified", "memcpy"),
            "disk_writeback_sealed_vs_raw": ratio("disk_writeback_sealed", "raw_write"),
        },
        diagnostics={
            "seal_vs_memcpy": ratio("seal", "memcpy"),
            # the fraction of a memory tier put spent on its seal (paired)
            "mem_put_seal_share": _median(
                [sl / t for sl, t in zip(s["seal"], s["mem_put"], strict=True)]
            ),
            "mem_get_verified_vs_get": ratio("mem_get_verified", "mem_get"),
            "alloc_copy_gbps": rate("alloc_copy"),
            "alloc_copy_vs_memcpy": ratio("alloc_copy", "memcpy"),
            # the very first load into new arrays finds no recycled memory
            "disk_load_new_first_vs_raw": s["raw_read"][0] / s["disk_load_new"][0],
        },
        peer=peer,
    )


def _targets(ratios: dict[str, dict[str, float]], lookup_us: float) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for label, r in ratios.items():
        if parse_size(label) < TARGET_MIN_BYTES:
            continue
        for metric, target in (
            ("disk_store_vs_raw", DISK_TARGET),
            ("disk_load_vs_raw", DISK_TARGET),
            ("mem_put_vs_memcpy", MEM_TARGET),
            ("mem_get_vs_memcpy", MEM_TARGET),
            ("disk_store_unaligned_vs_raw", USER_PATH_TARGET),
            ("disk_writeback_vs_raw", USER_PATH_TARGET),
            ("disk_load_new_vs_raw", USER_PATH_TARGET),
        ):
            out.append(
                {
                    "metric": metric,
                    "size": label,
                    "value": r[metric],
                    "target": f">= {target}",
                    "met": r[metric] >= target,
                }
            )
    out.append(
        {
            "metric": "lookup_128_chunks_us",
            "size": None,
            "value": lookup_us,
            "target": f"<= {LOOKUP_TARGET_US:g}",
            "met": lookup_us <= LOOKUP_TARGET_US,
        }
    )
    return out


def run_io_bench(config: IOBenchConfig) -> dict[str, object]:
    """Run the benchmark; returns the JSON document (see the module docstring).

    A scratch directory is made under ``config.directory`` (default: the current
    directory) and removed afterwards. A requested peer that cannot be imported is
    skipped and reported under ``peers``.
    """
    peer_error = ""
    if config.peer == "lmcache":
        try:
            check_available()
        except PeerUnavailable as exc:
            peer_error = str(exc)
    parent = config.directory if config.directory is not None else Path.cwd()
    parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=".kvlife-bench-io-", dir=parent))
    try:
        return _run(config, workdir, peer_error)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run(config: IOBenchConfig, workdir: Path, peer_error: str) -> dict[str, object]:
    n = config.batch
    biggest = max(config.sizes)
    mount, fstype, source = _mount_of(workdir)
    direct = probe_direct_io(workdir)
    use_peer = config.peer is not None and not peer_error
    need = (1 + 3 * 1.01 + (1 if use_peer else 0)) * n * biggest + 64 * MiB
    free = shutil.disk_usage(workdir).free
    if need > free:
        raise RuntimeError(
            f"{workdir} has {free / GiB:.1f} GiB free; the run needs about {need / GiB:.1f} "
            "GiB (choose another --dir, or smaller --sizes / --batch)"
        )
    store_dir = workdir / "kvlife-disk"
    disk = DiskTier(
        store_dir,
        DiskTierConfig(capacity_bytes=4 * n * frame_len(biggest) + GiB, direct_io=direct),
        name="bench-disk",
    )
    peers: dict[str, object] = {}
    bar = tqdm(
        total=len(config.sizes) * config.repeat + 1,
        desc="bench io",
        unit="step",
        file=sys.stderr,
        disable=not config.progress,
        leave=False,
    )
    ctx = _Context(config, store_dir, direct, disk, np.random.default_rng(20240611), bar)
    summaries: dict[str, _SizeSummary] = {}
    try:
        if use_peer:
            ctx.peer = LMCacheDiskPeer(
                workdir / "lmcache-disk",
                pool_bytes=n * biggest + 64 * MiB,
                # LMCache never gives back the budget of removed keys: cover the run
                disk_bytes=sum(config.sizes) * n * config.repeat + GiB,
                direct_io=direct,
            )
            peers["lmcache"] = {"available": True, **ctx.peer.describe()}
        elif config.peer is not None:
            peers[config.peer] = {"available": False, "reason": peer_error}
        for size in config.sizes:
            label = size_label(size)
            ctx.samples[label] = _bench_size(ctx, size)
            summaries[label] = _summarise(size, n, ctx.samples[label])
        bar.set_description("bench io lookup")
        lookup = _bench_lookup(config, workdir)
        bar.update(1)
    finally:
        bar.close()
        disk.close()
        if ctx.peer is not None:
            ctx.peer.close()
    ratios = {k: v.ratios for k, v in summaries.items()}
    lookup_us = float(lookup["median_us"])
    result: dict[str, object] = {
        "benchmark": "kvlife bench io",
        "schema_version": SCHEMA_VERSION,
        "units": {"gbps": "1e9 payload bytes per second", "us": "microseconds"},
        "config": {
            **{k: v for k, v in asdict(config).items() if k != "directory"},
            "directory": str(config.directory) if config.directory is not None else None,
            "size_labels": [size_label(s) for s in config.sizes],
        },
        "environment": {
            "scratch_directory": str(workdir),
            "mount_point": mount,
            "filesystem": fstype,
            "device": source,
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "transparent_hugepages": _read_text("/sys/kernel/mm/transparent_hugepage/enabled"),
        },
        "direct_io": direct,
        "limits": {k: v.limits for k, v in summaries.items()},
        "kvlife": {k: v.kvlife for k, v in summaries.items()},
        "ratios": ratios,
        "lookup_128_chunks_us": lookup_us,
        "lookup": lookup,
        "diagnostics": {k: v.diagnostics for k, v in summaries.items()},
        "targets": _targets(ratios, lookup_us),
        "samples_seconds": ctx.samples,
    }
    if not direct:
        result["notes"] = [
            f"{workdir} ({fstype}) does not accept O_DIRECT: raw limits and kvlife both "
            "use buffered I/O plus fdatasync, and reads may come from the page cache"
        ]
    if peers:
        for label, v in summaries.items():
            entry = peers.get("lmcache")
            if isinstance(entry, dict) and v.peer:
                entry.setdefault("sizes", {})[label] = v.peer
        result["peers"] = peers
    return result


# ---------------------------------------------------------------------------- report

_ROWS = (
    # (label, kvlife key, limit key, ratio key, target)
    ("mem put (copy)", "mem_put_gbps", "memcpy_gbps", "mem_put_vs_memcpy", MEM_TARGET),
    ("mem get into buffers", "mem_get_gbps", "memcpy_gbps", "mem_get_vs_memcpy", MEM_TARGET),
    (
        "mem get, seal verified",
        "mem_get_verified_gbps",
        "memcpy_gbps",
        "mem_get_verified_vs_memcpy",
        None,
    ),
    ("disk store (aligned)", "disk_store_gbps", "raw_write_gbps", "disk_store_vs_raw", DISK_TARGET),
    (
        "disk store (unaligned)",
        "disk_store_unaligned_gbps",
        "raw_write_gbps",
        "disk_store_unaligned_vs_raw",
        USER_PATH_TARGET,
    ),
    (
        "disk store (DRAM write-back)",
        "disk_writeback_gbps",
        "raw_write_gbps",
        "disk_writeback_vs_raw",
        USER_PATH_TARGET,
    ),
    (
        "demotion (seal verified)",
        "disk_writeback_sealed_gbps",
        "raw_write_gbps",
        "disk_writeback_sealed_vs_raw",
        None,
    ),
    ("disk load into buffers", "disk_load_gbps", "raw_read_gbps", "disk_load_vs_raw", DISK_TARGET),
    (
        "disk load new arrays",
        "disk_load_new_gbps",
        "raw_read_gbps",
        "disk_load_new_vs_raw",
        USER_PATH_TARGET,
    ),
)
_LIMIT_NAMES = {
    "memcpy_gbps": "memcpy",
    "raw_write_gbps": "raw write",
    "raw_read_gbps": "raw read",
}


def format_report(result: dict[str, object]) -> str:
    """The human-readable table of a :func:`run_io_bench` result."""
    limits = result["limits"]
    kv = result["kvlife"]
    ratios = result["ratios"]
    peers = result.get("peers", {})
    assert isinstance(limits, dict) and isinstance(kv, dict) and isinstance(ratios, dict)
    assert isinstance(peers, dict)
    lmc = peers.get("lmcache", {})
    peer_sizes = lmc.get("sizes", {}) if isinstance(lmc, dict) else {}
    direct = bool(result["direct_io"])
    raw = "raw O_DIRECT" if direct else "raw buffered"
    rows: list[list[str]] = []
    for label in limits:
        lim, k, r = limits[label], kv[label], ratios[label]
        big = parse_size(label) >= TARGET_MIN_BYTES
        for name, kkey, lkey, rkey, target in _ROWS:
            lname = _LIMIT_NAMES[lkey]
            if lkey != "memcpy_gbps":
                lname = lname.replace("raw", raw)
            has_target = target is not None and big
            rows.append(
                [
                    label,
                    name,
                    lname,
                    f"{lim[lkey]:.2f}",
                    f"{k[kkey]:.2f}",
                    f"{r[rkey]:.2f}",
                    f"≥{target:g}" if has_target else "-",
                    ("yes" if r[rkey] >= target else "NO") if has_target and target else "-",
                ]
            )
        p = peer_sizes.get(label)
        if p:
            for name, gkey, lkey, rkey in (
                ("lmcache disk store", "store_gbps", "raw_write_gbps", "store_vs_raw"),
                ("lmcache disk load", "load_gbps", "raw_read_gbps", "load_vs_raw"),
            ):
                rows.append(
                    [
                        label,
                        name,
                        _LIMIT_NAMES[lkey].replace("raw", raw),
                        f"{lim[lkey]:.2f}",
                        f"{p[gkey]:.2f}",
                        f"{p[rkey]:.2f}",
                        "-",
                        "-",
                    ]
                )
    headers = ["size", "kvlife operation", "limit", "limit GB/s", "GB/s", "ratio", "target", "met"]
    lines = [format_table(headers, rows), ""]
    lookup = result["lookup"]
    assert isinstance(lookup, dict)
    us = float(lookup["median_us"])
    lines.append(
        f"lookup of a {lookup['chunks']}-chunk prompt ({lookup['tokens_per_chunk']} tokens "
        f"per chunk): median {us:.0f} µs, p90 {lookup['p90_us']:.0f} µs, of which BLAKE3 "
        f"chunk keys {lookup['key_computation_median_us']:.0f} µs; tokens as a Python list "
        f"{lookup['tokens_as_list_median_us']:.0f} µs. Target ≤{LOOKUP_TARGET_US:.0f} µs: "
        + ("met" if us <= LOOKUP_TARGET_US else "NOT met")
    )
    zc = ", ".join(f"{label} {kv[label]['mem_get_zero_copy_us_per_object']:.2f}" for label in kv)
    lines.append(f"mem get zero-copy (read-only view), µs per object: {zc}")
    diag = result["diagnostics"]
    assert isinstance(diag, dict)
    ac = ", ".join(f"{label} {d['alloc_copy_vs_memcpy']:.2f}" for label, d in diag.items())
    lines.append(f"copy into freshly allocated arrays ÷ memcpy (page-fault cost): {ac}")
    seal = ", ".join(
        f"{label} {kv[label]['seal_gbps']:.1f} GB/s ({d['seal_vs_memcpy']:.2f}x memcpy, "
        f"{100 * d['mem_put_seal_share']:.0f}% of a put)"
        for label, d in diag.items()
    )
    lines.append(f"DRAM seal (xxh3-128): {seal}")
    first = ", ".join(f"{label} {d['disk_load_new_first_vs_raw']:.2f}" for label, d in diag.items())
    lines.append(
        "disk load new arrays, first repetition (no recycled memory yet) ÷ raw read: " + first
    )
    if isinstance(lmc, dict) and lmc:
        if lmc.get("available"):
            lines.append(
                f"lmcache {lmc['version']}: LocalDiskBackend, use_odirect={lmc['use_odirect']}, "
                f"{lmc['disk_io_threads']} I/O threads, no fsync on store, no checksum on load"
            )
        else:
            lines.append(f"lmcache peer skipped: {lmc.get('reason')}")
    env = result["environment"]
    assert isinstance(env, dict)
    cfg = result["config"]
    assert isinstance(cfg, dict)
    lines.append(
        f"{env['filesystem']} on {env['device']} ({env['mount_point']}), direct I/O "
        f"{'on' if direct else 'OFF'}; batch {cfg['batch']}, median of {cfg['repeat']} "
        "paired repetitions; GB/s = 1e9 B/s"
    )
    for note in result.get("notes", []) or []:  # type: ignore[attr-defined]
        lines.append(f"note: {note}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvlife bench io",
        description=(
            "Measure kvlife's memory and disk tiers against memcpy and raw O_DIRECT I/O "
            "in the same run, plus the time of a 128-chunk lookup."
        ),
    )
    p.add_argument("--json", metavar="FILE", type=Path, help="write the results as JSON")
    p.add_argument(
        "--dir",
        metavar="DIR",
        type=Path,
        help="make the scratch directory here (default: the current directory, whose "
        "filesystem is usually a real device; tmpfs has no O_DIRECT)",
    )
    p.add_argument(
        "--sizes",
        metavar="LIST",
        help="comma-separated object sizes (default 256KiB,2MiB,16MiB; --quick 16KiB,64KiB)",
    )
    p.add_argument("--batch", type=int, help="objects per batch (default 64; --quick 4)")
    p.add_argument("--repeat", type=int, help="repetitions per size (default 5; --quick 2)")
    p.add_argument("--peer", choices=PEERS, help="also run the workload through a peer")
    p.add_argument("--lookup-iters", type=int, help="timed lookups (default 300)")
    p.add_argument("--quick", action="store_true", help="tiny sizes and batches (for tests)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def config_from_args(args: argparse.Namespace) -> IOBenchConfig:
    base = IOBenchConfig.quick_config() if args.quick else IOBenchConfig()
    changes: dict[str, object] = {"progress": not args.no_progress}
    if args.sizes:
        changes["sizes"] = tuple(parse_size(t) for t in args.sizes.split(",") if t.strip())
    for name in ("batch", "repeat", "lookup_iters", "peer"):
        value = getattr(args, name)
        if value is not None:
            changes[name] = value
    if args.dir is not None:
        changes["directory"] = args.dir
    return replace(base, **changes)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    """``kvlife bench io``: print the table, optionally write the JSON; 0 on success."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        result = run_io_bench(config)
    except (OSError, RuntimeError) as exc:
        print(f"kvlife bench io: error: {exc}", file=sys.stderr)
        return 1
    peers = result.get("peers")
    if isinstance(peers, dict):
        for name, entry in peers.items():
            if isinstance(entry, dict) and not entry.get("available"):
                print(f"kvlife bench io: peer {name} skipped: {entry['reason']}", file=sys.stderr)
    print(format_report(result))
    if args.json is not None:
        text = json.dumps(result, indent=2, allow_nan=False)
        args.json.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``kvlife bench concurrency``: loads from many threads while one thread puts and
demotes, against raw aligned reads at the same queue depth, and lookup latency with I/O
in flight.

For each thread count T (1, 2, 4, 8 by default), T reader threads each look up and load
their own prompts from the disk tier into preallocated aligned buffers, while one writer
thread puts new prompts into a small DRAM tier, so that every put demotes older chunks
to disk (frame writes, fdatasync, SQLite commits). A probe thread looks up a prompt every
millisecond and records the latency. The limit is raw ``os.preadv`` of the same block
size from T threads (:mod:`kvlife.bench.concurrency_raw`), measured in the same
directory in the same run. Reported per T: aggregate load GB/s, its ratio to raw at
queue depth T, and lookup P50/P99 against the idle P50/P99 measured before any I/O.

Then a full audit (``store.check()``: every row's frame read and checksummed) runs again
and again for the same time while the probe looks up and one reader loads from disk:
lookup P50/P99 during the audit (against idle), the reader's load GB/s and the audit's
own read rate (issue 18: an audit must run beside serving, never stall it).

The machine's own figures (memcpy, raw O_DIRECT write and read, a Python loop's speed;
:func:`kvlife.bench.limits.machine_figures`) go beside the ratios, under ``"machine"``.

Each point also carries its CPU budget (``cpu``, issue 28): CPU per chunk of the loads
and of raw reads at the same queue depth, user and system apart, the checksum's CPU per
chunk, and the ceiling they imply: the ratio to raw that no verified load could pass on
this machine's CPUs (:func:`kvlife.bench.limits.cpu_ceiling`), so that a miss can be
told apart from a limit of the machine.

Paired rounds (issue 28). The point above measures the loads for ``seconds`` and raw
reads once, afterwards, apart from them; on a virtual disk whose read speed swings from
one second to the next that ratio follows the swings. So each thread count is also
measured in ``rounds`` rounds (:class:`PairedPoint`, ``points[].paired``), each four
slices of ``slice_seconds`` in alternating order (even rounds raw, loads, verified,
raw+writer; odd rounds loads, raw+writer, verified, raw), all reading the same prepared
file (raw) or the same store (loads, verified) with the same block size:

- ``raw``: raw reads at queue depth T alone (:class:`~kvlife.bench.concurrency_raw.RawFile`);
- ``loads``: the loads of the point above (T readers, the writer demoting, the probe);
- ``raw+writer``: raw reads at queue depth T beside a raw writer (O_DIRECT ``pwrite``
  of the same block size and ``fdatasync``, same directory) paced at the bytes/s the
  store's writer wrote to the disk tier in that round's loads slice: the device's read
  limit under the same write load.

- ``verified`` (issue 28, 2026-12-05): the readers' own disk frames read and verified
  by the extension alone from T threads (:mod:`kvlife.bench.concurrency_verified`), no
  store Python, no probe, beside the raw writer paced as for ``raw+writer``: the
  ceiling of any verified load at queue depth T here under the same write load.

``load_vs_raw_paired`` is the median of the rounds' loads ÷ raw: **the same ratio as
``load_vs_raw``, and the target's**, measured so that the device's swings hit both
sides alike. ``load_vs_raw_writer_paired`` (loads ÷ raw+writer) and
``raw_writer_vs_raw`` in ``paired`` (raw+writer ÷ raw) do not replace it: they say how
much of a miss the write load explains (what the device loses to it, against what the
loads lose). The raw writer reproduces the writer's frame bytes, not its SQLite
commits, nor its CPU (the put's).

The writer (issue 28, 2026-12-03). Its KV values are drawn before any point, a pool of
``WRITER_POOL`` prompts' worth that its puts take in turn, each put with tokens of its
own, so that every chunk it puts is new; and it puts at ``writer_mb_per_s`` (a setting,
64 MB/s of KV by default, 0: as fast as it can). Until then it drew each prompt's KV
while the readers ran: 55-70 ms of CPU for a prompt of 8 MiB, at the 5-8 puts/s it
reached a quarter to a half of one of the machine's two vCPUs, work of the bench, not
of the store, that the raw slices never had beside them; its pace was whatever that
left (38-83 MB/s on this machine, README).

Targets (issue 8): aggregate load >= 0.85x raw (alone) at the same queue depth; lookup
P99 with I/O in flight <= 2x its idle P99. A benchmark, not a test: it prints a table
and writes JSON; nothing here asserts speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kvlife.bench.concurrency_raw import RawFile, RawReadPoint, measure_raw_concurrency
from kvlife.bench.concurrency_verified import prompt_frames, verified_slice
from kvlife.bench.limits import (
    CpuTimes,
    cpu_ceiling,
    cpu_per_chunk,
    cpus_available,
    format_machine,
    hash_cpu_per_chunk,
    machine_figures,
    process_cpu,
    thread_cpu,
    usable_cpus,
)
from kvlife.core.identity import PUBLIC, KVLayout, ModelIdentity
from kvlife.report import format_table
from kvlife.store import KVStore
from kvlife.tiers.buffers import aligned_empty, prefault

MiB = 1 << 20
LOAD_TARGET = 0.85
LOOKUP_P99_TARGET = 2.0
WRITER_POOL = 4
"""Prompts' worth of KV values the writer's puts take in turn (drawn before any point)."""


@dataclass(frozen=True, slots=True)
class ConcurrencyConfig:
    """Settings of the benchmark."""

    threads: tuple[int, ...] = (1, 2, 4, 8)
    """Reader thread counts, one point each."""
    tokens_per_chunk: int = 128
    """Chunk size: 8 layers x 8 KV heads x 64 dims x fp16, so 128 tokens = 2 MiB."""
    chunks_per_prompt: int = 4
    prompts_per_thread: int = 4
    seconds: float = 2.0
    """Time each point runs."""
    raw_file_bytes: int = 1 << 30
    writer: bool = True
    """Run the writer thread (puts and demotions) beside the readers."""
    writer_mb_per_s: float = 64.0
    """The writer's pace: MB (1e6 bytes) of KV put per second (0: as fast as it can)."""
    directory: Path | None = None
    """Where the store and the raw file live (default: the current directory)."""
    quick: bool = False
    """Tiny sizes (tests): the machine figures move an eighth of their bytes too."""
    rounds: int = 4
    """Paired rounds per thread count: each a slice of raw reads, one of the loads (with
    the writer) and one of raw reads beside a raw writer, in alternating order."""
    slice_seconds: float = 0.4
    """Time of each paired slice."""


@dataclass(slots=True)
class ConcurrencyPoint:
    """One thread count."""

    threads: int
    seconds: float
    load_gbps: float
    """Aggregate verified load throughput of the reader threads (1e9 B/s)."""
    demotions: int
    """Chunks the writer's puts demoted to disk meanwhile."""
    lookup_p50_us: float
    lookup_p99_us: float
    lookups: int
    errors: list[str]
    raw_gbps_same_qd: float = float("nan")
    load_vs_raw: float = float("nan")
    lookup_p99_vs_idle: float = float("nan")
    disk_bytes_written: int = 0
    """Bytes the writer's demotions wrote to the disk tier (frames) meanwhile."""
    writer_puts: int = 0
    """Prompts the writer put meanwhile (at ``writer_mb_per_s``: at most one more than
    the pace allows in ``seconds``)."""
    load_vs_raw_paired: float = float("nan")
    """The same ratio as ``load_vs_raw``, measured paired: the median over the rounds of
    ``paired`` of each round's loads ÷ the raw reads of the same round."""
    load_vs_raw_writer_paired: float = float("nan")
    """Median over the rounds of the loads ÷ raw reads at the same queue depth with a
    raw writer beside them writing at the bytes/s the store's writer wrote in that
    round's slice of loads (the device's read limit under the same write load)."""
    paired: dict[str, object] = field(default_factory=dict)
    """The paired rounds (:class:`PairedPoint`)."""
    cpu: dict[str, float] = field(default_factory=dict)
    """The CPU budget of the point (:func:`_cpu_budget`; README "Concurrency"):
    ``loads_*`` and ``raw_*`` (``user_us_per_chunk``, ``system_us_per_chunk``,
    ``us_per_chunk``, ``busy_cpus``, ``chunks``), ``others_s`` (the writer's and the
    probe's own CPU seconds, left out of ``loads_*``), ``hash_us_per_chunk``, ``cpus``,
    ``ceiling``, ``ceiling_same_cpu``, ``ceiling_available``, ``raw_busy_cpus``,
    ``loads_allow`` and ``load_vs_ceiling``."""


@dataclass(slots=True)
class PairedPoint:
    """One thread count measured in rounds of three short slices, alternating: raw reads
    at queue depth T alone, the loads from T threads (with the writer and the probe, as
    in :class:`ConcurrencyPoint`), raw reads at queue depth T beside a raw writer paced
    at the bytes/s the store's writer wrote in the same round's loads slice. Each list
    has one value per round; the ratios are medians of the per-round ratios."""

    threads: int
    rounds: int
    slice_seconds: float
    order: list[str]
    """Each round's order of its slices (``raw``, ``loads``, ``raw+writer``)."""
    load_gbps: list[float]
    raw_gbps: list[float]
    raw_writer_gbps: list[float]
    """Raw reads beside the raw writer (the raw slice's figure again where the store's
    writer wrote nothing: no raw writer ran)."""
    writer_bps: list[float]
    """Bytes/s the store's writer wrote to the disk tier (frames) in the loads slice."""
    raw_writer_bps: list[float]
    """Bytes/s the raw writer achieved beside the raw reads (paced at ``writer_bps``)."""
    load_vs_raw: float
    load_vs_raw_writer: float
    raw_writer_vs_raw: float
    """What the write load costs the device's reads (median of the rounds)."""
    errors: list[str]
    verified_gbps: list[float] = field(default_factory=list)
    """The verified ceiling (:mod:`kvlife.bench.concurrency_verified`): the readers' own
    disk frames read and verified by the extension alone from T threads, no store
    Python, beside the raw writer at the round's pace (NaN: the extension is not built)."""
    verified_failed: int = 0
    """Frames of the verified slices that did not verify (moved since they were looked
    up; not counted in ``verified_gbps``)."""
    verified_vs_raw: float = float("nan")
    """The ceiling ÷ raw reads alone (median of the rounds): with ``raw_writer_vs_raw``,
    what verifying every byte costs at queue depth T here."""
    load_vs_verified: float = float("nan")
    """The loads under the verified ceiling: the store's own cost (median of the rounds)."""


def _layout(cfg: ConcurrencyConfig) -> KVLayout:
    return KVLayout(8, 8, 64, "float16", cfg.tokens_per_chunk)


def _prompt(seed: int, layout: KVLayout, chunks: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = _tokens(rng, layout, chunks)
    n = len(tokens)
    shape = (layout.num_layers, 2, layout.num_kv_heads, n, layout.head_dim)
    return tokens, rng.standard_normal(shape, dtype=np.float32).astype(np.float16)


def _tokens(rng: np.random.Generator, layout: KVLayout, chunks: int) -> np.ndarray:
    return rng.integers(0, 50_000, chunks * layout.tokens_per_chunk, dtype=np.int64)


class _WriterPace:
    """When the writer's ``n``-th put is due: ``n`` puts of ``bytes_per_put`` at
    ``mb_per_s`` from :meth:`start` (0: every put at once). The schedule is fixed from the
    start: a writer behind it puts without waiting until it is on it again, so that by
    any time it has put at most one put more than the pace allows."""

    def __init__(self, bytes_per_put: int, mb_per_s: float) -> None:
        self.interval = bytes_per_put / (mb_per_s * 1e6) if mb_per_s > 0 else 0.0
        self.t0 = 0.0

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def wait(self, n: int, stop: threading.Event) -> None:
        """Sleep until put ``n`` is due (or ``stop`` is set)."""
        if self.interval > 0:
            late = self.t0 + n * self.interval - time.perf_counter()
            if late > 0:
                stop.wait(late)


def _median(values: list[float]) -> float:
    return float(np.median(np.asarray(values))) if values else float("nan")


def _buffers(layout: KVLayout, threads: int, chunks: int) -> list[list[np.ndarray]]:
    """Each reader thread's output buffers, aligned and faulted in now, once for every
    point: as the raw reads' buffers are (:mod:`kvlife.bench.concurrency_raw`) and an
    engine's KV buffers would be. Fresh ones per point were faulted in by the first
    reads into them, inside the timed window, which the raw reads never pay (measured
    on 2026-12-03: within the noise of 0.4 s slices at T = 8, five pairs)."""
    outs = []
    for _ in range(threads):
        bufs = [aligned_empty(layout.chunk_nbytes) for _ in range(chunks)]
        for b in bufs:
            prefault(b)
        outs.append([b.view(np.float16).reshape(layout.chunk_shape) for b in bufs])
    return outs


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return float(np.percentile(np.asarray(values), q))


def run_concurrency_bench(cfg: ConcurrencyConfig) -> dict[str, object]:
    parent = cfg.directory if cfg.directory is not None else Path.cwd()
    parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".kvlife-bench-conc-", dir=parent))
    try:
        return _run(cfg, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(cfg: ConcurrencyConfig, work: Path) -> dict[str, object]:
    machine = machine_figures(work, quick=cfg.quick)
    layout = _layout(cfg)
    ident = ModelIdentity("bench", "w", "t", layout)
    chunk = layout.chunk_nbytes
    most = max(cfg.threads)
    readers = [
        [
            _prompt(1000 * t + p, layout, cfg.chunks_per_prompt)
            for p in range(cfg.prompts_per_thread)
        ]
        for t in range(most)
    ]
    store = KVStore.open(
        work / "store",
        dram_bytes=4 * cfg.chunks_per_prompt * chunk,
        disk_bytes=64 << 30,
        promote_on_hit=False,
    )
    try:
        for prompts in readers:
            for tokens, kv in prompts:
                store.put_prompt(ident, PUBLIC, tokens, kv)
        store.flush()
        store.evict("dram", 1 << 40)  # the readers' chunks now live on disk only
        probe_tokens = readers[0][0][0]
        idle = _lookups(store, ident, probe_tokens, cfg.seconds / 2, threading.Event())
        outs = _buffers(layout, most, cfg.chunks_per_prompt)
        writer_kv = [
            _prompt(5_000_000 + i, layout, cfg.chunks_per_prompt)[1] for i in range(WRITER_POOL)
        ]
        points = [
            _point(cfg, store, ident, readers, t, probe_tokens, outs, writer_kv)
            for t in cfg.threads
        ]
        if cfg.rounds > 0:
            with RawFile(work, file_bytes=cfg.raw_file_bytes, block_bytes=chunk) as rawfile:
                for p in points:
                    paired = _paired(
                        cfg,
                        store,
                        ident,
                        readers,
                        p.threads,
                        probe_tokens,
                        outs,
                        writer_kv,
                        rawfile,
                    )
                    p.paired = asdict(paired)
                    p.load_vs_raw_paired = paired.load_vs_raw
                    p.load_vs_raw_writer_paired = paired.load_vs_raw_writer
        audit = _audit_point(cfg, store, ident, readers[0], probe_tokens, outs)
        direct = bool(store.tier("disk").details().get("direct_io"))
    finally:
        store.close(flush=False)
    depths = sorted(set(cfg.threads) | {1, 4, 16})
    raw = measure_raw_concurrency(
        work, file_bytes=cfg.raw_file_bytes, block_bytes=chunk, queue_depths=depths
    )
    hash_s = hash_cpu_per_chunk(chunk, quick=cfg.quick)
    cpus = usable_cpus()
    available = cpus_available(0.05 if cfg.quick else 0.5)
    idle_p99 = _pct(idle, 99)
    audit.lookup_p99_vs_idle = audit.lookup_p99_us / idle_p99 if idle_p99 else float("nan")
    for p in points:
        limit = raw.point(p.threads).gbps
        p.raw_gbps_same_qd = limit
        p.load_vs_raw = p.load_gbps / limit if limit else float("nan")
        p.lookup_p99_vs_idle = p.lookup_p99_us / idle_p99 if idle_p99 else float("nan")
        p.cpu = _cpu_budget(p, raw.point(p.threads), hash_s, cpus, available)
    return {
        "benchmark": "concurrency",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "chunk_bytes": chunk,
        "direct_io": direct,
        "machine": machine,
        "targets": {"load_vs_raw_min": LOAD_TARGET, "lookup_p99_vs_idle_max": LOOKUP_P99_TARGET},
        "idle_lookup": {"p50_us": _pct(idle, 50), "p99_us": idle_p99, "n": len(idle)},
        "points": [asdict(p) for p in points],
        "audit": asdict(audit),
        "raw": raw.to_json(),
        "cpus": cpus,
        "cpus_available": available,
        "hash_us_per_chunk": hash_s * 1e6,
    }


def _cpu_budget(
    p: ConcurrencyPoint, raw: RawReadPoint, hash_s: float, cpus: int, available: float
) -> dict[str, float]:
    """The point's CPU budget: CPU per chunk of the loads (every thread of the process
    but the writer and the probe; ``loads_*``) and of raw reads at the same queue depth
    (``raw_*``), the checksum's CPU per chunk, and the ceilings they imply
    (:func:`~kvlife.bench.limits.cpu_ceiling`): ``ceiling`` is the ratio to raw that no
    design of a verified load could pass on this machine's CPUs, ``loads_allow`` the
    one kvlife's own measured CPU per chunk allows (the same formula with the loads'
    CPU per chunk in place of raw + hash), ``load_vs_ceiling`` the measured ratio
    against ``ceiling``."""
    rawcpu = cpu_per_chunk(CpuTimes(raw.cpu_user_s, raw.cpu_system_s), raw.reads, raw.seconds)
    ceiling = cpu_ceiling(rawcpu["us_per_chunk"], hash_s * 1e6, raw.iops, cpus, available)
    loads_us = p.cpu["loads_us_per_chunk"]
    allow = min(1.0, cpus / (loads_us * 1e-6 * raw.iops)) if loads_us > 0 and raw.iops else 1.0
    return (
        p.cpu
        | {f"raw_{k}": v for k, v in rawcpu.items()}
        | ceiling
        | {"loads_allow": allow, "load_vs_ceiling": p.load_vs_raw / ceiling["ceiling"]}
    )


def _lookups(
    store: KVStore, ident: ModelIdentity, tokens: np.ndarray, seconds: float, stop: threading.Event
) -> list[float]:
    """Lookup latencies (µs), one lookup a millisecond, for ``seconds`` or until ``stop``."""
    out: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end and not stop.is_set():
        t0 = time.perf_counter()
        store.lookup(ident, PUBLIC, tokens)
        out.append((time.perf_counter() - t0) * 1e6)
        time.sleep(0.001)
    return out


@dataclass(slots=True)
class AuditPoint:
    """Serving while full audits run back to back."""

    seconds: float
    audits: int
    """Full audits completed (each checks every row's frame)."""
    rows: int
    """Rows checked in all of them."""
    audit_gbps: float
    """Payload bytes the audits read and checksummed, per second (1e9 B/s)."""
    load_gbps: float
    """One reader thread's verified loads from disk meanwhile."""
    lookup_p50_us: float
    lookup_p99_us: float
    lookups: int
    errors: list[str]
    lookup_p99_vs_idle: float = float("nan")


def _audit_point(
    cfg: ConcurrencyConfig,
    store: KVStore,
    ident: ModelIdentity,
    prompts: list[tuple[np.ndarray, np.ndarray]],
    probe_tokens: np.ndarray,
    outs: list[list[np.ndarray]],
) -> AuditPoint:
    stop = threading.Event()
    errors: list[BaseException] = []
    done = [0, 0, 0]  # audits, rows, bytes
    loaded = [0]

    def count(nbytes: int) -> None:
        done[2] += nbytes

    def auditor() -> None:
        try:
            while not stop.is_set():
                done[1] += store.check(progress=count).rows
                done[0] += 1
        except BaseException as exc:  # reported in the result
            errors.append(exc)

    def reader() -> None:
        bufs = outs[0]
        i = 0
        try:
            while not stop.is_set():
                hit = store.lookup(ident, PUBLIC, prompts[i % len(prompts)][0])
                res = store.load(hit, bufs[: len(hit.hits)])
                loaded[0] += sum(a.nbytes for a in res.arrays)
                i += 1
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=auditor), threading.Thread(target=reader)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    lat = _lookups(store, ident, probe_tokens, cfg.seconds, stop)
    stop.set()
    for w in workers:
        w.join()
    wall = time.perf_counter() - t0
    return AuditPoint(
        seconds=wall,
        audits=done[0],
        rows=done[1],
        audit_gbps=done[2] / wall / 1e9,
        load_gbps=loaded[0] / wall / 1e9,
        lookup_p50_us=_pct(lat, 50),
        lookup_p99_us=_pct(lat, 99),
        lookups=len(lat),
        errors=[repr(e) for e in errors],
    )


def _point(
    cfg: ConcurrencyConfig,
    store: KVStore,
    ident: ModelIdentity,
    readers: list[list[tuple[np.ndarray, np.ndarray]]],
    threads: int,
    probe_tokens: np.ndarray,
    outs: list[list[np.ndarray]],
    writer_kv: list[np.ndarray],
    salt: int = 0,
) -> ConcurrencyPoint:
    """``writer_kv``: the KV values the writer's puts take in turn; ``salt``: makes this
    call's writer put prompts no earlier call put (a put of a prompt already stored
    would demote nothing)."""
    layout = ident.layout
    stop = threading.Event()
    loaded = [0] * threads
    errors: list[BaseException] = []
    others: list[CpuTimes] = []  # the writer's and the probe's own CPU time
    puts: list[int] = []  # the writer's
    start = threading.Barrier(threads + 1 + int(cfg.writer))

    def reader(t: int) -> None:
        bufs = outs[t]
        try:
            start.wait()
            i = 0
            while not stop.is_set():
                tokens, _ = readers[t][i % len(readers[t])]
                hit = store.lookup(ident, PUBLIC, tokens)
                res = store.load(hit, bufs[: len(hit.hits)])
                loaded[t] += sum(a.nbytes for a in res.arrays)
                i += 1
        except BaseException as exc:  # reported in the result
            errors.append(exc)

    def writer() -> None:
        n = 0
        # fresh tokens for every put (its chunks are new), the KV values from the pool
        rng = np.random.default_rng(10_000_000 + salt * 1_000_000 + threads * 100_000)
        pace = _WriterPace(writer_kv[0].nbytes, cfg.writer_mb_per_s)
        try:
            start.wait()
            cpu0 = thread_cpu()
            pace.start()
            while not stop.is_set():
                tokens = _tokens(rng, layout, cfg.chunks_per_prompt)
                store.put_prompt(ident, PUBLIC, tokens, writer_kv[n % len(writer_kv)])
                n += 1
                pace.wait(n, stop)
            others.append(thread_cpu() - cpu0)
            puts.append(n)
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=reader, args=(t,)) for t in range(threads)]
    if cfg.writer:
        workers.append(threading.Thread(target=writer))
    for w in workers:
        w.start()
    demotions0 = store.counters.demotions
    written0 = _disk_bytes_written(store)
    start.wait()
    cpu0, probe0 = process_cpu(), thread_cpu()
    t0 = time.perf_counter()
    lat = _lookups(store, ident, probe_tokens, cfg.seconds, stop)
    others.append(thread_cpu() - probe0)
    stop.set()
    for w in workers:
        w.join()
    wall = time.perf_counter() - t0
    spent = process_cpu() - cpu0
    other = sum(others, CpuTimes(0.0, 0.0))
    cpu = cpu_per_chunk(spent - other, sum(loaded) // layout.chunk_nbytes, wall)
    return ConcurrencyPoint(
        threads=threads,
        seconds=wall,
        load_gbps=sum(loaded) / wall / 1e9,
        demotions=store.counters.demotions - demotions0,
        disk_bytes_written=_disk_bytes_written(store) - written0,
        writer_puts=sum(puts),
        lookup_p50_us=_pct(lat, 50),
        lookup_p99_us=_pct(lat, 99),
        lookups=len(lat),
        errors=[repr(e) for e in errors],
        cpu={f"loads_{k}": v for k, v in cpu.items()} | {"others_s": other.total},
    )


def _disk_bytes_written(store: KVStore) -> int:
    written = store.tier("disk").details().get("bytes_written", 0)
    return written if isinstance(written, int) else 0


def _paired(
    cfg: ConcurrencyConfig,
    store: KVStore,
    ident: ModelIdentity,
    readers: list[list[tuple[np.ndarray, np.ndarray]]],
    threads: int,
    probe_tokens: np.ndarray,
    outs: list[list[np.ndarray]],
    writer_kv: list[np.ndarray],
    rawfile: RawFile,
) -> PairedPoint:
    """``cfg.rounds`` rounds of four slices of ``cfg.slice_seconds`` at ``threads``
    (:class:`PairedPoint`): even rounds raw, loads, verified, raw+writer; odd rounds
    loads, raw+writer, verified, raw (the raw writers' pace is always the one of the
    same round's loads)."""
    rng = np.random.default_rng(threads)
    sliced = dataclasses.replace(cfg, seconds=cfg.slice_seconds)
    frames = [prompt_frames(store, ident, [t for t, _ in readers[i]]) for i in range(threads)]
    verified: list[float] = []
    unverified = 0
    loads: list[float] = []
    raws: list[float] = []
    raw_ws: list[float] = []
    writer_bps: list[float] = []
    raw_writer_bps: list[float] = []
    errors: list[str] = []
    orders: list[str] = []
    for r in range(cfg.rounds):
        steps = (
            ["raw", "loads", "verified", "raw+writer"]
            if r % 2 == 0
            else ["loads", "raw+writer", "verified", "raw"]
        )
        orders.append(",".join(steps))
        raw = raw_w = float("nan")
        for step in steps:
            if step == "verified":  # beside the raw writer at this round's pace
                with rawfile.writing(writer_bps[-1], cfg.chunks_per_prompt):
                    gbps, failed = verified_slice(frames, outs, cfg.slice_seconds)
                verified.append(gbps)
                unverified += failed
            elif step == "loads":
                p = _point(
                    sliced, store, ident, readers, threads, probe_tokens, outs, writer_kv, 1 + r
                )
                loads.append(p.load_gbps)
                writer_bps.append(p.disk_bytes_written / p.seconds)
                errors += p.errors
            elif step == "raw":
                raw = rawfile.read_slice(threads, cfg.slice_seconds, rng).gbps
            elif writer_bps[-1] > 0:
                got = rawfile.read_slice(
                    threads,
                    cfg.slice_seconds,
                    rng,
                    write_bps=writer_bps[-1],
                    batch_blocks=cfg.chunks_per_prompt,
                )
                raw_w = got.gbps
                raw_writer_bps.append(got.write_bps)
            else:  # the store's writer wrote nothing: raw reads alone are the limit
                raw_writer_bps.append(0.0)
        raws.append(raw)
        raw_ws.append(raw_w)
    raw_ws = [r if np.isnan(w) else w for w, r in zip(raw_ws, raws, strict=True)]  # none ran
    return PairedPoint(
        threads=threads,
        rounds=cfg.rounds,
        slice_seconds=cfg.slice_seconds,
        order=orders,
        load_gbps=loads,
        raw_gbps=raws,
        raw_writer_gbps=raw_ws,
        writer_bps=writer_bps,
        raw_writer_bps=raw_writer_bps,
        load_vs_raw=_median([a / b for a, b in zip(loads, raws, strict=True)]),
        load_vs_raw_writer=_median([a / b for a, b in zip(loads, raw_ws, strict=True)]),
        raw_writer_vs_raw=_median([a / b for a, b in zip(raw_ws, raws, strict=True)]),
        errors=errors,
        verified_gbps=verified,
        verified_failed=unverified,
        verified_vs_raw=_median([a / b for a, b in zip(verified, raws, strict=True)]),
        load_vs_verified=_median([a / b for a, b in zip(loads, verified, strict=True)]),
    )


def format_report(result: dict[str, object]) -> str:
    idle = result["idle_lookup"]
    assert isinstance(idle, dict)
    rows = []
    for p in result["points"]:  # type: ignore[attr-defined]
        rows.append(
            [
                str(p["threads"]),
                f"{p['load_gbps']:.2f}",
                f"{p['raw_gbps_same_qd']:.2f}",
                f"{p['load_vs_raw']:.2f}",
                f"{p['load_vs_raw_paired']:.2f} / {p['load_vs_raw_writer_paired']:.2f}",
                str(p["demotions"]),
                f"{p['lookup_p50_us']:.0f} / {p['lookup_p99_us']:.0f}",
                f"{p['lookup_p99_vs_idle']:.2f}",
                _cpu_cell(p["cpu"], "loads"),
                _cpu_cell(p["cpu"], "raw"),
                f"{p['cpu'].get('ceiling', float('nan')):.2f}",
            ]
        )
    head = ["threads", "load GB/s", "raw GB/s (QD=T)", "ratio",
            "paired: vs raw / vs raw+writer", "demotions",
            "lookup P50/P99 µs", "P99 / idle", "loads CPU µs/chunk (user+sys)",
            "raw CPU µs/chunk", "CPU ceiling"]  # fmt: skip
    text = format_table(head, rows)
    text += (
        "\npaired: the median over rounds of alternating slices of the loads and of raw "
        "reads at QD T alone / beside a raw writer at the store writer's bytes/s "
        f"(the target, >= {LOAD_TARGET}, is the ratio to raw alone)"
    )
    for p in result["points"]:  # type: ignore[attr-defined]
        pp = p.get("paired")
        if pp:
            text += (
                f"\n  T={p['threads']}: loads {_gbps_list(pp['load_gbps'])}, raw "
                f"{_gbps_list(pp['raw_gbps'])}, raw+writer {_gbps_list(pp['raw_writer_gbps'])}"
                f" GB/s; writer {_gbps_list([b / 1e6 for b in pp['writer_bps']], 0)} MB/s "
                f"(raw writer {_gbps_list([b / 1e6 for b in pp['raw_writer_bps']], 0)}); "
                f"raw+writer / raw {pp['raw_writer_vs_raw']:.2f}"
            )
            if pp.get("verified_gbps"):
                text += (
                    f"\n        verified ceiling (beside the raw writer) "
                    f"{_gbps_list(pp['verified_gbps'])} GB/s: "
                    f"÷ raw {pp['verified_vs_raw']:.2f}, the loads ÷ it "
                    f"{pp['load_vs_verified']:.2f}"
                    + (f" ({pp['verified_failed']} frames moved)" if pp["verified_failed"] else "")
                )
    text += (
        f"\nCPU ceiling: the ratio no verified load could pass on {result['cpus']} CPUs "
        f"(raw read + xxh3-128 at {result['hash_us_per_chunk']:.0f} µs/chunk, all CPUs); "
        f"CPUs available to this process now: {result['cpus_available']:.2f}"
    )
    text += f"\nidle lookup P50/P99: {idle['p50_us']:.0f} / {idle['p99_us']:.0f} µs"
    text += f"; direct I/O: {result['direct_io']}; chunk bytes {result['chunk_bytes']}"
    machine = result.get("machine")
    if isinstance(machine, dict):
        text += "\n" + format_machine(machine)
    audit = result.get("audit")
    if isinstance(audit, dict):
        text += (
            f"\nduring full audits ({audit['audits']} in {audit['seconds']:.1f} s, "
            f"{audit['audit_gbps']:.2f} GB/s checked): lookup P50/P99 "
            f"{audit['lookup_p50_us']:.0f} / {audit['lookup_p99_us']:.0f} µs "
            f"({audit['lookup_p99_vs_idle']:.2f}x idle P99), one reader "
            f"{audit['load_gbps']:.2f} GB/s"
        )
    return text


def _gbps_list(values: list[float], digits: int = 2) -> str:
    return " ".join(f"{v:.{digits}f}" for v in values)


def _cpu_cell(cpu: dict[str, float], who: str) -> str:
    if f"{who}_us_per_chunk" not in cpu:
        return "-"
    return (
        f"{cpu[f'{who}_us_per_chunk']:.0f} ({cpu[f'{who}_user_us_per_chunk']:.0f}+"
        f"{cpu[f'{who}_system_us_per_chunk']:.0f}), {cpu[f'{who}_busy_cpus']:.2f} CPUs"
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvlife bench concurrency", description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path, help="write the JSON result here")
    p.add_argument("--dir", type=Path, help="where the store and the raw file go")
    p.add_argument("--seconds", type=float, default=2.0, help="time per point (default 2)")
    p.add_argument("--threads", default="1,2,4,8", help="reader thread counts (default 1,2,4,8)")
    p.add_argument("--no-writer", action="store_true", help="readers only (no puts meanwhile)")
    p.add_argument(
        "--writer-mbps",
        type=float,
        default=64.0,
        help="the writer's pace, MB of KV put per second (default 64; 0: as fast as it can)",
    )
    p.add_argument(
        "--rounds", type=int, default=4, help="paired rounds per thread count (default 4; 0: none)"
    )
    p.add_argument(
        "--slice", type=float, default=0.4, help="seconds per paired slice (default 0.4)"
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes (for tests)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        threads = tuple(int(x) for x in args.threads.split(","))
    except ValueError:
        print(f"kvlife bench concurrency: error: bad --threads {args.threads!r}", file=sys.stderr)
        return 2
    if args.rounds < 0 or not args.slice > 0 or not args.writer_mbps >= 0:
        print(
            "kvlife bench concurrency: error: --rounds >= 0, --slice > 0 and --writer-mbps >= 0",
            file=sys.stderr,
        )
        return 2
    cfg = ConcurrencyConfig(
        threads=threads, seconds=args.seconds, directory=args.dir, writer=not args.no_writer,
        rounds=args.rounds, slice_seconds=args.slice, writer_mb_per_s=args.writer_mbps,
    )  # fmt: skip
    if args.quick:
        cfg = ConcurrencyConfig(
            threads=threads, tokens_per_chunk=8, chunks_per_prompt=2, prompts_per_thread=2,
            seconds=min(args.seconds, 0.3), raw_file_bytes=8 * MiB, directory=args.dir,
            writer=not args.no_writer, quick=True, rounds=min(args.rounds, 2),
            slice_seconds=min(args.slice, 0.1), writer_mb_per_s=args.writer_mbps,
        )  # fmt: skip
    result = run_concurrency_bench(cfg)
    print(format_report(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

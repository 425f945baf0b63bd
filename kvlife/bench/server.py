"""``kvlife bench server``: the store served by ``kvlife serve`` against the in-process
store and the machine's limits, measured in the same run.

- lookup of a 128-chunk prompt through the server vs in-process (median, P99);
- load of 2 MiB and 16 MiB chunks from the server's DRAM tier into a client buffer vs
  ``memcpy`` of the same bytes, and from its disk tier vs raw O_DIRECT reads: into
  ordinary buffers (the grant path: one copy from the arena) and into shared buffers
  from ``RemoteStore.alloc_buffer`` (the data lands there, no copy by the client);
- put through the server vs ``memcpy`` into DRAM, and with write-through vs a raw
  O_DIRECT write plus ``fdatasync``;
- 1, 2 and 4 client processes loading concurrently from DRAM: aggregate throughput and
  each client's P99;
- the DRAM load again from a server run with ``--verify-dram-on-load`` (every chunk
  checked against its replica's xxh3-128 seal): what that setting costs. Puts seal every
  chunk they adopt (one xxh3-128 each), which the put points include.

Targets (issue 10): lookup <= 2x in-process (median and P99); DRAM load >= 0.8x memcpy,
disk load >= 0.85x raw; put >= 0.8x memcpy, write-through put >= 0.85x raw. A benchmark,
not a test: it prints a table and writes JSON; nothing here asserts speed.
LMCache's multi-process mode runs beside on the same chunks when a peer venv is found
(kvlife/bench/peer_lmcache_mp.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvlife.bench.limits import memcpy, raw_read, raw_write
from kvlife.client import RemoteStore
from kvlife.core.identity import KVLayout, ModelIdentity, Namespace, NamespaceKind
from kvlife.report import format_table
from kvlife.store import KVStore
from kvlife.tiers.buffers import aligned_empty, prefault
from kvlife.tiers.shm import SHM_DIR, huge_pages

MiB = 1 << 20
_ALL_CPUS = sorted(os.sched_getaffinity(0))
TARGETS = {
    "lookup_median": 2.0,
    "lookup_p99": 2.0,
    "load_dram": 0.8,
    "load_disk": 0.85,
    "put_dram": 0.8,
    "put_write_through": 0.85,
}


@dataclass(frozen=True, slots=True)
class ServerBenchConfig:
    """Settings of the benchmark."""

    quick: bool = False
    """A small run that only shows the benchmark works (tests)."""
    sizes: tuple[int, ...] = (2 * MiB, 16 * MiB)
    """Chunk sizes of the load and put points."""
    chunks_per_call: int = 4
    """Chunks per load or put call."""
    reps: int = 10
    """Repetitions per point (the median is reported)."""
    lookup_chunks: int = 128
    lookup_reps: int = 400
    clients: tuple[int, ...] = (1, 2, 4)
    client_seconds: float = 2.0
    directory: Path | None = None
    """Where stores and raw files live (default: the current directory)."""
    shm_dir: Path | None = None
    """The servers' ``--shm-dir`` (None: a tmpfs mounted ``huge=always`` for the run
    when this process may mount one, as docs/server.md recommends, else /dev/shm)."""
    huge: bool = True
    """Mount that huge-page tmpfs when ``shm_dir`` is None (False: /dev/shm as it is)."""
    pin: bool = True
    """With two CPUs or more: the servers on the last one (``--cpus``), this process on
    the others, as docs/server.md recommends; the scaling clients run anywhere."""
    peer: bool = True
    """Run LMCache's multi-process mode on the same loads and puts when a peer venv is
    found (``peer_python``, ``$KVLIFE_LMCACHE_PYTHON``, ``../peer-venv``); quick runs
    only with ``peer_python`` given."""
    peer_python: Path | None = None

    @classmethod
    def small(cls, directory: Path | None) -> ServerBenchConfig:
        return cls(
            quick=True, sizes=(256 << 10, MiB), chunks_per_call=2, reps=2, lookup_chunks=16,
            lookup_reps=20, clients=(1, 2), client_seconds=0.3, directory=directory,
        )  # fmt: skip


def _layout(chunk_bytes: int) -> KVLayout:
    """8 layers x 8 KV heads x 64 dims x fp16: 16 KiB per token."""
    return KVLayout(8, 8, 64, "float16", max(1, chunk_bytes // (16 << 10)))


def _identity(layout: KVLayout, tag: str = "") -> ModelIdentity:
    return ModelIdentity(f"bench{tag}", "w", "t", layout)


NS = Namespace(NamespaceKind.USER, "bench")


def _prompt(layout: KVLayout, n: int, seed: int) -> tuple[list[int], np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50_000, n * layout.tokens_per_chunk).tolist()
    shape = (
        layout.num_layers,
        2,
        layout.num_kv_heads,
        n * layout.tokens_per_chunk,
        layout.head_dim,
    )
    kv = rng.integers(0, 1 << 15, shape, dtype=np.uint16).view(np.float16)
    return tokens, kv


def _chunks(kv: np.ndarray, layout: KVLayout, n: int) -> list[np.ndarray]:
    t = layout.tokens_per_chunk
    return [np.ascontiguousarray(kv[:, :, :, i * t : (i + 1) * t]) for i in range(n)]


def _outs(layout: KVLayout, n: int) -> list[np.ndarray]:
    outs = []
    for _ in range(n):
        buf = aligned_empty(layout.chunk_nbytes)
        prefault(buf)
        outs.append(buf.view(np.float16).reshape(layout.chunk_shape))
    return outs


def _aligned(a: np.ndarray) -> np.ndarray:
    """``a``'s bytes in 4096-aligned, prefaulted memory (what O_DIRECT needs)."""
    buf = aligned_empty(a.nbytes)
    buf[:] = a.reshape(-1).view(np.uint8)
    return buf


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-equal (random fp16 bits include NaNs)."""
    return bool(np.array_equal(a.view(np.uint16), b.view(np.uint16)))


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


class _Server:
    """A ``kvlife serve`` child process, stopped by PID."""

    def __init__(self, path: Path, dram: int, disk: int, shm: Path, *flags: str) -> None:
        self.socket = path.parent / f"{path.name}.sock"
        pid_file = path.parent / f"{path.name}.pid"
        cmd = [
            sys.executable, "-m", "kvlife.cli", "serve", str(path), "--socket", str(self.socket),
            "--pid-file", str(pid_file), "--dram-bytes", str(dram), "--disk-bytes", str(disk),
            "--staging-bytes", str(max(128 * MiB, dram // 2)), "--shm-dir", str(shm), *flags,
        ]  # fmt: skip
        log = path.parent / f"{path.name}.log"
        with log.open("wb") as err:
            self.proc = subprocess.Popen(cmd, stderr=err, env=_env())
        deadline = time.monotonic() + 120
        while not pid_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvlife serve did not start: {log.read_text()[-2000:]}")
            time.sleep(0.05)

    def client(self) -> RemoteStore:
        return RemoteStore(self.socket, timeout=300)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _env() -> dict[str, str]:
    """This kvlife first on the children's path (a checkout run without installing)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # kvlife/bench/server.py -> checkout
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


@contextlib.contextmanager
def _shm_dir(cfg: ServerBenchConfig, work: Path) -> Iterator[Path]:
    """The tmpfs the servers put their arenas in: the configured one, or a private one
    mounted ``huge=always`` (root only; unmounted after the run), else /dev/shm."""
    if cfg.shm_dir is not None or not cfg.huge or os.geteuid() != 0:
        yield cfg.shm_dir if cfg.shm_dir is not None else SHM_DIR
        return
    mnt = work / "shm"
    mnt.mkdir()
    cmd = ["mount", "-t", "tmpfs", "-o", "huge=always,size=4g,mode=0700", "kvlife-bench"]
    done = subprocess.run([*cmd, str(mnt)], capture_output=True, check=False)
    if done.returncode != 0:
        yield SHM_DIR
        return
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)


def _direct_ok(directory: Path) -> bool:
    probe = directory / "direct-probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
        os.close(fd)
        return True
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


# ---------------------------------------------------------------------------- points


def _bench_lookup(cfg: ServerBenchConfig, work: Path, remote: RemoteStore) -> dict[str, Any]:
    layout = KVLayout(1, 1, 8, "float16", 256)
    ident = _identity(layout, "-lookup")
    tokens, kv = _prompt(layout, cfg.lookup_chunks, 1)
    emb = KVStore.open(work / "embedded", dram_bytes=256 * MiB, disk_bytes=0)
    try:
        emb.put_prompt(ident, NS, tokens, kv)
        remote.put_prompt(ident, NS, tokens, kv)
        times: dict[str, list[float]] = {"inproc": [], "server": []}
        for _ in range(cfg.lookup_reps):
            for name, store in (("inproc", emb), ("server", remote)):
                t0 = time.perf_counter()
                hits = len(store.lookup(ident, NS, tokens).hits)
                times[name].append(time.perf_counter() - t0)
                if hits != cfg.lookup_chunks:
                    raise RuntimeError(f"{name} lookup found {hits} of {cfg.lookup_chunks}")
    finally:
        emb.close(flush=False)
    out: dict[str, Any] = {"chunks": cfg.lookup_chunks, "tokens": len(tokens)}
    for name, xs in times.items():
        out[f"{name}_p50_us"] = _pct(xs, 50) * 1e6
        out[f"{name}_p99_us"] = _pct(xs, 99) * 1e6
    out["ratio_p50"] = out["server_p50_us"] / out["inproc_p50_us"]
    out["ratio_p99"] = out["server_p99_us"] / out["inproc_p99_us"]
    return out


def _point(
    layout: KVLayout,
    n: int,
    served: list[float],
    limit: list[float],
    *,
    raw: bool,
    **others: list[float],
) -> dict[str, Any]:
    """A load or put point: medians of the served calls and of the limit, their ratio,
    and ``<name>_gbps`` and ``ratio_<name>`` of each other series of the same bytes."""
    total = n * layout.chunk_nbytes
    s_gbps = _gbps(total, float(np.median(served)))
    l_gbps = _gbps(total, float(np.median(limit)))
    out: dict[str, Any] = {
        "chunk_bytes": layout.chunk_nbytes,
        "chunks_per_call": n,
        "server_gbps": s_gbps,
        ("raw_gbps" if raw else "memcpy_gbps"): l_gbps,
        "ratio": s_gbps / l_gbps,
    }
    for name, xs in others.items():
        out[f"{name}_gbps"] = _gbps(total, float(np.median(xs)))
        out[f"ratio_{name}"] = out[f"{name}_gbps"] / l_gbps
    return out


def _bench_load(
    cfg: ServerBenchConfig, remote: RemoteStore, size: int, seed: int, raw_dir: Path | None
) -> dict[str, Any]:
    """Load ``chunks_per_call`` chunks into preallocated buffers; the limit is memcpy of
    the same bytes from warm memory (DRAM) or raw reads of a file of them (disk:
    ``raw_dir`` given, the chunks flushed and evicted from DRAM first)."""
    layout = _layout(size)
    ident = _identity(layout)
    n = cfg.chunks_per_call
    tokens, kv = _prompt(layout, n, seed)
    remote.put_prompt(ident, NS, tokens, kv)
    chunks = _chunks(kv, layout, n)
    if raw_dir is not None:
        remote.flush()
        remote.evict("dram", 1 << 62)
    outs = _outs(layout, n)
    lk = remote.lookup(ident, NS, tokens)
    want = "disk" if raw_dir is not None else "dram"
    if lk.tiers() != {want: n}:
        raise RuntimeError(f"expected {n} hits in {want}, got {lk.tiers()}")
    total = n * layout.chunk_nbytes
    served, limit = [], []
    raw_file = raw_dir / f"raw-{size}" if raw_dir is not None else None
    direct = raw_dir is not None and _direct_ok(raw_dir)
    if raw_file is not None:
        raw_write(raw_file, [_aligned(c) for c in chunks], direct)
    flat = [o.view(np.uint8).reshape(-1) for o in outs]
    shared_raw = remote.alloc_buffer(total)
    shared = [
        shared_raw[i * layout.chunk_nbytes : (i + 1) * layout.chunk_nbytes]
        .view(np.float16)
        .reshape(layout.chunk_shape)
        for i in range(n)
    ]
    served_shared: list[float] = []
    for rep in range(cfg.reps + 1):
        t0 = time.perf_counter()
        res = remote.load(lk, outs)
        t = time.perf_counter() - t0
        t0 = time.perf_counter()
        res_shared = remote.load(lk, shared)
        t_shared = time.perf_counter() - t0
        for got, bufs in ((res, outs), (res_shared, shared)):
            same = rep > 0 or all(_same(o, c) for o, c in zip(bufs, chunks, strict=True))
            if got.loaded != n or not same:
                raise RuntimeError(f"load served {got.loaded} of {n} chunks, or wrong bytes")
        t_lim = raw_read(raw_file, flat, direct) if raw_file is not None else memcpy(outs, chunks)
        if rep:  # the first is a warm-up
            served.append(t)
            served_shared.append(t_shared)
            limit.append(t_lim)
    del shared, shared_raw
    if raw_file is not None:
        raw_file.unlink(missing_ok=True)
    remote.invalidate(namespace=NS)
    out = _point(layout, n, served, limit, raw=raw_file is not None, shared=served_shared)
    out["server_p99_ms"] = _pct(served, 99) * 1e3
    if raw_file is not None:
        out["direct_io"] = direct
    return out


def _bench_put(
    cfg: ServerBenchConfig,
    remote: RemoteStore,
    size: int,
    seed: int,
    raw_dir: Path | None,
    embedded: KVStore | None = None,
) -> dict[str, Any]:
    """Put fresh prompts (invalidated after each, outside the timing); the limit is
    memcpy into warm DRAM, or (write-through server: ``raw_dir``) a raw write of the
    same bytes plus fdatasync. ``embedded``: the same puts into an in-process store too
    (what the store core costs without the server)."""
    layout = _layout(size)
    ident = _identity(layout)
    n = cfg.chunks_per_call
    dsts = _outs(layout, n)
    direct = raw_dir is not None and _direct_ok(raw_dir)
    served, limit, inproc = [], [], []
    for rep in range(cfg.reps + 1):
        tokens, kv = _prompt(layout, n, seed * 1000 + rep)
        chunks = _chunks(kv, layout, n)
        src = [_aligned(c) for c in chunks] if raw_dir is not None else chunks

        def limit_once(src: list[np.ndarray] = src, chunks: list[np.ndarray] = chunks) -> float:
            if raw_dir is not None:  # O_DIRECT needs aligned memory
                return raw_write(raw_dir / "raw-put", src, direct)
            return memcpy(dsts, chunks)

        # the order alternates, so that neither side always finds the source in cache
        t_lim = limit_once() if rep % 2 else 0.0
        t0 = time.perf_counter()
        res = remote.put_prompt(ident, NS, tokens, chunks)
        t = time.perf_counter() - t0
        if res.stored != n:
            raise RuntimeError(f"put stored {res.stored} of {n} chunks")
        if not rep % 2:
            t_lim = limit_once()
        if embedded is not None:
            t0 = time.perf_counter()
            mine = embedded.put_prompt(ident, NS, tokens, chunks)
            inproc.append(time.perf_counter() - t0)
            if mine.stored != n:
                raise RuntimeError(f"in-process put stored {mine.stored} of {n} chunks")
            embedded.invalidate(namespace=NS)
        remote.invalidate(namespace=NS)
        if rep:
            served.append(t)
            limit.append(t_lim)
    if raw_dir is not None:
        (raw_dir / "raw-put").unlink(missing_ok=True)
    others = {"inproc": inproc[1:]} if inproc else {}  # the first is a warm-up
    out = _point(layout, n, served, limit, raw=raw_dir is not None, **others)
    if raw_dir is not None:
        out["direct_io"] = direct
    return out


def _bench_scaling(cfg: ServerBenchConfig, srv: _Server) -> list[dict[str, Any]]:
    layout = _layout(cfg.sizes[0])
    remote = srv.client()
    n = cfg.chunks_per_call
    tokens, kv = _prompt(layout, n, 77)
    remote.put_prompt(_identity(layout), NS, tokens, kv)
    remote.close()
    points = []
    for clients in cfg.clients:
        start_at = time.time() + 1.5 + 0.2 * clients
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kvlife.bench.server",
                    "--worker",
                    str(srv.socket),
                    str(cfg.sizes[0]),
                    str(n),
                    str(cfg.client_seconds),
                    str(start_at),
                ],
                stdout=subprocess.PIPE,
                env={**_env(), "KVLIFE_BENCH_CPUS": ",".join(map(str, _ALL_CPUS))},
            )
            for _ in range(clients)
        ]
        results = []
        for p in procs:
            out, _ = p.communicate(timeout=120 + cfg.client_seconds)
            if p.returncode != 0:
                raise RuntimeError("a scaling client failed")
            results.append(json.loads(out))
        points.append(
            {
                "clients": clients,
                "aggregate_gbps": sum(r["bytes"] for r in results) / cfg.client_seconds / 1e9,
                "per_client_gbps": [r["bytes"] / cfg.client_seconds / 1e9 for r in results],
                "per_client_p99_ms": [r["p99_ms"] for r in results],
                "loads": sum(r["loads"] for r in results),
            }
        )
    return points


def _worker(sock: str, size: int, n: int, seconds: float, start_at: float) -> int:
    """One scaling client: loads the shared prompt into its buffers for ``seconds``."""
    anywhere = os.environ.get("KVLIFE_BENCH_CPUS", "")
    if anywhere:  # not the parent's pinning: scaling clients run on every CPU
        os.sched_setaffinity(0, {int(c) for c in anywhere.split(",")})
    layout = _layout(size)
    remote = RemoteStore(sock, timeout=300)
    tokens, _ = _prompt(layout, n, 77)
    lk = remote.lookup(_identity(layout), NS, tokens)
    outs = _outs(layout, n)
    remote.load(lk, outs)
    time.sleep(max(0.0, start_at - time.time()))
    lat: list[float] = []
    nbytes = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        res = remote.load(lk, outs)
        lat.append(time.perf_counter() - t0)
        nbytes += sum(a.nbytes for a in res.arrays)
    remote.close()
    print(json.dumps({"bytes": nbytes, "loads": len(lat), "p99_ms": _pct(lat, 99) * 1e3}))
    return 0


# ---------------------------------------------------------------------------- run


def run_server_bench(cfg: ServerBenchConfig) -> dict[str, Any]:
    base = cfg.directory if cfg.directory is not None else Path.cwd()
    # short names: a Unix socket path has at most 107 bytes
    work = Path(tempfile.mkdtemp(prefix="kvsrv-", dir=base))
    biggest = max(cfg.sizes) * cfg.chunks_per_call
    dram = max(256 * MiB, 3 * biggest)
    servers: list[_Server] = []
    with contextlib.ExitStack() as stack:
        shm = stack.enter_context(_shm_dir(cfg, work))
        try:
            return _run(cfg, work, base, dram, shm, servers)
        finally:
            for s in servers:
                s.stop()
            stack.close()
            shutil.rmtree(work, ignore_errors=True)


def _peer(cfg: ServerBenchConfig, server_cpus: str, work: Path) -> dict[str, Any]:
    """LMCache's MP server and client on the same chunks (kvlife/bench/peer_lmcache_mp),
    its server on the CPU kvlife's servers ran on; a dict saying why when not run."""
    from kvlife.bench import peer_lmcache_mp as mp

    python = mp.find_peer_python(cfg.peer_python)
    if not cfg.peer or python is None or (cfg.quick and cfg.peer_python is None):
        why = "not asked" if not cfg.peer else "no peer venv found"
        if cfg.peer and python is not None:
            why = "quick run (pass --peer-python to run it)"
        return {"peer": "lmcache-mp", "skipped": why}
    peer_cfg = mp.MPPeerConfig(
        sizes=cfg.sizes,
        chunks_per_call=cfg.chunks_per_call,
        reps=cfg.reps,
        server_cpus=tuple(int(c) for c in server_cpus.split(",")) if server_cpus else (),
    )
    if cfg.quick:
        peer_cfg = replace(mp.MPPeerConfig.small(), server_cpus=peer_cfg.server_cpus)
    (work / "lmc").mkdir(exist_ok=True)
    try:
        return mp.run_lmcache_mp(python, peer_cfg, work / "lmc")
    except (mp.PeerUnavailable, RuntimeError, ValueError, OSError) as exc:
        return {"peer": "lmcache-mp", "skipped": f"failed: {exc}"[:2000]}


@contextlib.contextmanager
def _pinned(cfg: ServerBenchConfig) -> Iterator[tuple[str, str]]:
    """(server CPUs, client CPUs) as --cpus lists, this process pinned to the client
    ones for the run; ("", "") when not pinning."""
    have = sorted(os.sched_getaffinity(0))
    if not cfg.pin or len(have) < 2:
        yield "", ""
        return
    os.sched_setaffinity(0, have[:-1])
    try:
        yield str(have[-1]), ",".join(map(str, have[:-1]))
    finally:
        os.sched_setaffinity(0, have)


def _run(
    cfg: ServerBenchConfig, work: Path, base: Path, dram: int, shm: Path, servers: list[_Server]
) -> dict[str, Any]:
    with _pinned(cfg) as (server_cpus, client_cpus):
        result = _points(cfg, work, base, dram, shm, servers, server_cpus)
        result["peer_lmcache"] = _peer(cfg, server_cpus, work)
    result["config"]["server_cpus"] = server_cpus
    result["config"]["client_cpus"] = client_cpus
    result["targets"] = _targets(result)
    return result


def _points(
    cfg: ServerBenchConfig,
    work: Path,
    base: Path,
    dram: int,
    shm: Path,
    servers: list[_Server],
    cpus: str,
) -> dict[str, Any]:
    pin = ("--cpus", cpus) if cpus else ()
    main = _Server(work / "m", dram, 4 * dram, shm, *pin)
    servers.append(main)
    remote = main.client()
    result: dict[str, Any] = {"config": asdict(cfg), "note": ""}
    result["config"]["directory"] = str(base)
    result["config"]["shm_dir"] = str(shm)
    result["shm_huge_pages"] = huge_pages(shm)
    result["lookup"] = _bench_lookup(cfg, work, remote)
    result["load_dram"] = [
        _bench_load(cfg, remote, s, 10 + i, None) for i, s in enumerate(cfg.sizes)
    ]
    embedded = KVStore.open(work / "inproc", dram_bytes=dram, disk_bytes=0)
    try:
        result["put_dram"] = [
            _bench_put(cfg, remote, s, 20 + i, None, embedded) for i, s in enumerate(cfg.sizes)
        ]
    finally:
        embedded.close(flush=False)
    remote.close()
    result["scaling"] = _bench_scaling(cfg, main)
    main.stop()
    servers.remove(main)
    result["load_dram_verified"] = _bench_verified(cfg, work, dram, shm, servers, pin)
    disk = _Server(work / "d", dram, 4 * dram, shm, *pin, "--no-promote", "--write-through")
    servers.append(disk)
    remote = disk.client()
    result["load_disk"] = [
        _bench_load(cfg, remote, s, 30 + i, work) for i, s in enumerate(cfg.sizes)
    ]
    result["put_write_through"] = [
        _bench_put(cfg, remote, s, 40 + i, work) for i, s in enumerate(cfg.sizes)
    ]
    remote.close()
    return result


def _bench_verified(
    cfg: ServerBenchConfig,
    work: Path,
    dram: int,
    shm: Path,
    servers: list[_Server],
    pin: tuple[str, ...],
) -> list[dict[str, Any]]:
    """The DRAM load points on a server that verifies every load against the seal."""
    srv = _Server(work / "v", dram, 4 * dram, shm, *pin, "--verify-dram-on-load")
    servers.append(srv)
    remote = srv.client()
    try:
        return [_bench_load(cfg, remote, s, 50 + i, None) for i, s in enumerate(cfg.sizes)]
    finally:
        remote.close()
        srv.stop()
        servers.remove(srv)


def _targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    out = [
        {"name": "lookup_median", "value": r["lookup"]["ratio_p50"], "target": "<= 2.0"},
        {"name": "lookup_p99", "value": r["lookup"]["ratio_p99"], "target": "<= 2.0"},
    ]
    for key in ("load_dram", "load_disk", "put_dram", "put_write_through"):
        for p in r[key]:
            for ratio, suffix in (("ratio", ""), ("ratio_shared", "_shared")):
                if ratio in p:
                    out.append(
                        {
                            "name": f"{key}_{p['chunk_bytes'] >> 10}KiB{suffix}",
                            "value": p[ratio],
                            "target": f">= {TARGETS[key]}",
                        }
                    )
    for t in out:
        bound = float(str(t["target"]).split()[1])
        t["met"] = t["value"] <= bound if str(t["target"]).startswith("<=") else t["value"] >= bound
    return out


def format_report(r: dict[str, Any]) -> str:
    lk = r["lookup"]
    lines = [
        f"lookup of a {lk['chunks']}-chunk prompt ({lk['tokens']} tokens)",
        format_table(
            ["path", "median us", "p99 us"],
            [
                ["in-process", f"{lk['inproc_p50_us']:.0f}", f"{lk['inproc_p99_us']:.0f}"],
                ["server", f"{lk['server_p50_us']:.0f}", f"{lk['server_p99_us']:.0f}"],
                ["ratio", f"{lk['ratio_p50']:.2f}", f"{lk['ratio_p99']:.2f}"],
            ],
        ),
        "",
    ]
    rows = []
    for key, limit in (
        ("load_dram", "memcpy"),
        ("load_dram_verified", "memcpy"),
        ("load_disk", "raw"),
        ("put_dram", "memcpy"),
        ("put_write_through", "raw"),
    ):
        for p in r.get(key, []):
            rows.append(
                [
                    key,
                    f"{p['chunk_bytes'] >> 10} KiB",
                    f"{p['server_gbps']:.2f}",
                    f"{p[f'{limit}_gbps']:.2f}",
                    limit,
                    f"{p['ratio']:.2f}",
                ]
            )
            if "inproc_gbps" in p:
                rows.append(
                    [
                        f"{key} (in-process store)",
                        f"{p['chunk_bytes'] >> 10} KiB",
                        f"{p['inproc_gbps']:.2f}",
                        f"{p[f'{limit}_gbps']:.2f}",
                        limit,
                        f"{p['ratio_inproc']:.2f}",
                    ]
                )
            if "shared_gbps" in p:
                rows.append(
                    [
                        f"{key} (shared buffers)",
                        f"{p['chunk_bytes'] >> 10} KiB",
                        f"{p['shared_gbps']:.2f}",
                        f"{p[f'{limit}_gbps']:.2f}",
                        limit,
                        f"{p['ratio_shared']:.2f}",
                    ]
                )
    lines.append(
        format_table(["point", "chunk", "server GB/s", "limit GB/s", "limit", "ratio"], rows)
    )
    lines.append("")
    lines.append(
        format_table(
            ["clients", "aggregate GB/s", "max client p99 ms"],
            [
                [
                    str(p["clients"]),
                    f"{p['aggregate_gbps']:.2f}",
                    f"{max(p['per_client_p99_ms']):.2f}",
                ]
                for p in r["scaling"]
            ],
        )
    )
    lines.append("")
    lines.append(
        format_table(
            ["target", "value", "wanted", "met"],
            [
                [t["name"], f"{t['value']:.2f}", t["target"], "yes" if t["met"] else "NO"]
                for t in r["targets"]
            ],
        )
    )
    lines.append("")
    huge = "huge pages" if r["shm_huge_pages"] else "4 KiB pages"
    lines.append(f"arenas in {r['config']['shm_dir']} ({huge})")
    cpus = r["config"]["server_cpus"]
    where = f"server on CPU {cpus}, client on {r['config']['client_cpus']}" if cpus else "no"
    lines.append(f"pinning: {where}")
    lines.append(_peer_report(r))
    return "\n".join(lines)


def _peer_report(r: dict[str, Any]) -> str:
    peer = r["peer_lmcache"]
    if "points" not in peer:
        return f"LMCache multi-process mode: not run ({peer.get('skipped', '?')})"
    ours = {p["chunk_bytes"]: p for p in r["put_dram"]}
    loads = {p["chunk_bytes"]: p for p in r["load_dram"]}
    rows = []
    for p in peer["points"]:
        size = p["chunk_bytes"]
        put, load = ours.get(size), loads.get(size)
        rows.append(
            [
                p["mode"],
                f"{size >> 10} KiB",
                f"{p['store_gbps']:.2f}",
                f"{put['server_gbps']:.2f}" if put else "-",
                f"{p['retrieve_gbps']:.2f}",
                f"{load['server_gbps']:.2f}" if load else "-",
            ]
        )
    versions = peer.get("versions", {})
    head = ["lmcache mode", "chunk", "lmcache store", "kvlife put", "lmcache get", "kvlife load"]
    title = f"LMCache {versions.get('lmcache', '?')} multi-process mode, same chunks (DRAM):"
    return title + "\n" + format_table(head, rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvlife bench server", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--quick", action="store_true", help="a small run (shape only)")
    p.add_argument("--dir", type=Path, default=None, help="work directory (default: cwd)")
    p.add_argument(
        "--shm-dir", type=Path, default=None, help="the servers' --shm-dir (default: see --no-huge)"
    )
    p.add_argument(
        "--no-huge",
        action="store_true",
        help="arenas in /dev/shm as it is, not in a huge=always tmpfs mounted for the run",
    )
    p.add_argument(
        "--no-pin", action="store_true", help="leave the servers and this process unpinned"
    )
    p.add_argument(
        "--peer-python",
        type=Path,
        default=None,
        help="python of an LMCache peer venv (kvlife/bench/peer_lmcache_mp.py)",
    )
    p.add_argument("--no-peer", action="store_true", help="do not run LMCache's MP mode beside")
    p.add_argument("--worker", nargs=5, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker is not None:
        sock, size, n, seconds, start_at = args.worker
        return _worker(sock, int(size), int(n), float(seconds), float(start_at))
    cfg = ServerBenchConfig.small(args.dir) if args.quick else ServerBenchConfig(directory=args.dir)
    cfg = replace(
        cfg,
        shm_dir=args.shm_dir,
        huge=not args.no_huge,
        pin=not args.no_pin,
        peer=not args.no_peer,
        peer_python=args.peer_python,
    )
    result = run_server_bench(cfg)
    print(format_report(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

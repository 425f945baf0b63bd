"""LMCache's multi-process mode (its MP cache server and an MP client) on the workload of
``kvlife bench server``: store, then retrieve, 4 chunks per call of 2 MiB and 16 MiB.

``kvlife bench lmcache-mp --python PEER_PYTHON --json F`` (or ``python -m
kvlife.bench.peer_lmcache_mp``); :func:`run_lmcache_mp` is what ``kvlife bench server`` can
call. LMCache is never a dependency of kvlife and never imported into kvlife's own
process: everything LMCache runs in children started with the peer venv's python.

Install the peer venv beside the checkout (``../peer-venv``; any other place is passed
with ``--python`` or ``KVLIFE_LMCACHE_PYTHON``), with the CPU build of torch::

    python -m venv peer-venv
    peer-venv/bin/pip install torch==2.13.0   # the +cpu wheel (e.g. from a local --find-links)
    peer-venv/bin/pip install --no-deps lmcache==0.5.6
    peer-venv/bin/pip install numpy pyyaml requests cachetools sortedcontainers numba \\
        prometheus_client py-cpuinfo psutil aiohttp aiofile aiofiles msgspec pyzmq \\
        transformers cryptography blake3 xxhash msgpack tqdm httpx fastapi uvicorn redis \\
        grpcio "protobuf<7,>=6.31.1" "opentelemetry-api<=1.40.0,>=1.20.0" \\
        "opentelemetry-sdk>=1.20.0" "opentelemetry-exporter-prometheus<=0.61b0,>=0.50b0" \\
        "prometheus_client<=0.24.1,>=0.18.0" "setuptools<81,>=77.0.3"

(lmcache 0.5.6 also lists cupy-cuda13x, cuda-python, nvtx, cufile-python: none is needed
for what runs here.)

What LMCache's MP mode does, read from its source (lmcache 0.5.6) and seen running here:

* the server is ``python -m lmcache.v1.multiprocess.server`` (``MPCacheServer``): a ZMQ
  request server (``--host``/``--port``, TCP) in front of a ``StorageManager`` whose L1 is
  host DRAM (``--l1-size-gb``, ``--eviction-policy``); on a machine without a GPU torch
  reports no CUDA and LMCache selects its CPU platform (``StubCPUDevice``,
  ``lmcache/v1/platform/devices/cpu``), so nothing of its CUDA extension (``cuda_ops``) is
  loaded;
* a worker (vLLM's, through ``LMCacheMPWorkerAdapter``) registers its paged KV cache, one
  ``(2, num_blocks, block_size, heads, head_dim)`` tensor per layer, and stores or
  retrieves token ranges by block ids; a chunk is ``--chunk-size`` tokens of all layers;
* transfer mode ``lmcache_driven`` (REGISTER_KV_CACHE + STORE/RETRIEVE): on CPU the worker's
  KV tensors are moved into POSIX shared memory (``CpuShmTensorWrapper``,
  ``migrate_to_shm_and_wrap``) and the server gathers the blocks into L1 and scatters them
  back itself, the CPU form of its CUDA-IPC path;
* transfer mode ``engine_driven`` (PREPARE/COMMIT): the worker gathers the blocks into
  slots of the server's L1 pool, mapped as shared memory (``--shm-name``), and commits;
  on retrieve it scatters from the slots (``index_select``/``index_copy_`` on CPU tensors);
* a retrieve needs a LOOKUP first (it takes the read locks the retrieve releases); the
  lookup is asynchronous (LOOKUP, then QUERY_PREFETCH_STATUS polls).

The client here is LMCache's own ``lmcache bench server`` client
(``lmcache.cli.commands.bench.server_bench.client.ServerBenchClient``, CPU mode), which
drives the same transfer contexts as the vLLM adapter. The KV geometry is kvlife's bench
geometry (8 layers x 8 KV heads x 64 dims x fp16, 16 KiB per token; 16-token blocks), so a
2 MiB chunk is 128 tokens and a 16 MiB chunk 1024 tokens (the server's ``--chunk-size``).
Each point gets its own server (one chunk size per server). Stores: fresh random bytes in
the request's blocks before each timed store, each under a new prompt. Retrieves: of the
first stored prompt, after an untimed LOOKUP that must hit every chunk, into blocks zeroed
beforehand; every retrieve is compared bit for bit with what was stored. Median of
``reps`` after one warm-up.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MiB = 1 << 20
GiB = 1 << 30
TOKEN_BYTES = 8 * 2 * 8 * 64 * 2
"""Bytes of one token of kvlife's bench geometry (layers x K/V x heads x dims x fp16)."""
BLOCK_TOKENS = 16
MODES = ("lmcache_driven", "engine_driven")
PEER_PYTHON_ENV = "KVLIFE_LMCACHE_PYTHON"
_READY_LINE = "LMCache cache server is running..."
_QUIET_ENV = {
    "LMCACHE_TRACK_USAGE": "false",  # no usage telemetry (it posts to lmcache.ai)
    "DO_NOT_TRACK": "1",
    "LMCACHE_DISABLE_BANNER": "1",
}

NOTES = {
    "peer": "LMCache multi-process mode: lmcache.v1.multiprocess.server + ServerBenchClient",
    "device": "CPU (torch +cpu build; LMCache's StubCPUDevice platform, no CUDA)",
    "layout": "paged KV per layer (2, blocks, 16, 8, 64) fp16; chunk = all layers of "
    "--chunk-size tokens",
    "lmcache_driven": "worker KV in POSIX shm; the server gathers/scatters blocks itself",
    "engine_driven": "the worker gathers/scatters blocks into/from the server's L1 shm slots",
    "retrieve_needs_lookup": True,
    "timed": "store: the STORE round trip; retrieve: the RETRIEVE round trip (its LOOKUP "
    "is untimed and reported apart)",
    "durability": "L1 only (host DRAM); no disk tier configured",
}
"""What the peer does, recorded in the JSON."""


class PeerUnavailable(RuntimeError):
    """The peer cannot run; the message says why and how to install it."""


@dataclass(frozen=True, slots=True)
class MPPeerConfig:
    """Settings of the side-by-side run."""

    sizes: tuple[int, ...] = (2 * MiB, 16 * MiB)
    """Chunk sizes: whole 16-token blocks (256 KiB each), at least two: with a chunk of
    one block, lmcache 0.5.6's LOOKUP found none of the stored chunks here."""
    chunks_per_call: int = 4
    reps: int = 10
    """Timed repetitions per point (one warm-up more); the median is reported."""
    modes: tuple[str, ...] = MODES
    timeout_s: float = 600.0
    """Per point (server start + client run)."""
    quick: bool = False
    server_cpus: tuple[int, ...] = ()
    """CPUs for LMCache's server (empty: as this process); ``kvlife bench server`` gives
    it the CPU its own server runs on, and runs the client where its client runs."""

    @classmethod
    def small(cls) -> MPPeerConfig:
        return cls(sizes=(512 << 10,), chunks_per_call=2, reps=2, timeout_s=300.0, quick=True)

    def l1_gb(self, size: int) -> float:
        """L1 for every prompt a point stores, with room to spare (nothing is evicted)."""
        need = (self.reps + 2) * self.chunks_per_call * size * 2
        return float(max(1, math.ceil(need / GiB)))


def find_peer_python(explicit: Path | None = None) -> Path | None:
    """The peer venv's python: ``explicit``, else ``$KVLIFE_LMCACHE_PYTHON``, else
    ``peer-venv/bin/python`` beside this checkout; None when none of them exists."""
    root = Path(__file__).resolve().parents[2]
    for cand in (explicit, os.environ.get(PEER_PYTHON_ENV), root.parent / "peer-venv/bin/python"):
        if cand and Path(cand).exists():
            return Path(cand)
    return None


def _kvlife_root() -> str:
    return str(Path(__file__).resolve().parents[2])


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(_QUIET_ENV)
    env.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    env["PYTHONPATH"] = _kvlife_root() + os.pathsep + env.get("PYTHONPATH", "")
    return env


def check_python(python: Path) -> dict[str, str]:
    """Versions of lmcache, torch and pyzmq in the peer venv; raises PeerUnavailable."""
    code = (
        "import json, importlib.metadata as m, torch, zmq, lmcache.v1.multiprocess.server;"
        "print(json.dumps({'lmcache': m.version('lmcache'), 'torch': torch.__version__,"
        "'pyzmq': zmq.__version__, 'cuda_available': str(torch.cuda.is_available())}))"
    )
    try:
        proc = subprocess.run(
            [str(python), "-c", code], env=_env(), capture_output=True, text=True, timeout=300
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PeerUnavailable(f"cannot run {python}: {exc}") from exc
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise PeerUnavailable(
            f"{python} cannot import torch, zmq and lmcache's MP server ({tail[0]}); "
            "see kvlife/bench/peer_lmcache_mp.py for the peer venv"
        )
    versions: dict[str, str] = json.loads(proc.stdout.strip().splitlines()[-1])
    return versions


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class _MPServer:
    """``python -m lmcache.v1.multiprocess.server`` in a child, on 127.0.0.1, stopped by
    PID; its L1 shared-memory segment is unlinked by name afterwards."""

    def __init__(
        self, python: Path, chunk_tokens: int, l1_gb: float, log: Path, cpus: tuple[int, ...]
    ) -> None:
        self.port = _free_port()
        self.shm_name = f"kvlife_bench_{uuid.uuid4().hex[:12]}"
        cmd = [
            str(python), "-m", "lmcache.v1.multiprocess.server",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--chunk-size", str(chunk_tokens),
            "--l1-size-gb", str(l1_gb), "--eviction-policy", "LRU",
            "--supported-transfer-mode", "auto", "--shm-name", self.shm_name,
            "--disable-observability",
        ]  # fmt: skip
        env = _env()
        env["LMCACHE_LOG_LEVEL"] = "INFO"  # the ready line is logged at INFO
        self.log = log
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=pin,
            )

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def wait_ready(self, deadline: float) -> None:
        while True:
            text = self.log.read_text(errors="replace")
            if _READY_LINE in text:
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"LMCache MP server did not start: {text[-3000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)  # its __main__ turns it into a shutdown
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/lmcache_l1_pool_{self.shm_name}")


@contextlib.contextmanager
def _server(
    python: Path, chunk_tokens: int, l1_gb: float, work: Path, cpus: tuple[int, ...]
) -> Iterator[_MPServer]:
    srv = _MPServer(python, chunk_tokens, l1_gb, work / f"lmcache-mp-{chunk_tokens}.log", cpus)
    try:
        yield srv
    finally:
        srv.stop()


def _run_client(
    python: Path, url: str, mode: str, chunk_tokens: int, cfg: MPPeerConfig, deadline: float
) -> dict[str, Any]:
    cmd = [
        str(python), "-m", "kvlife.bench.peer_lmcache_mp", "--client", url, mode,
        str(chunk_tokens), str(cfg.chunks_per_call), str(cfg.reps),
    ]  # fmt: skip
    proc = subprocess.run(
        cmd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=max(1.0, deadline - time.monotonic()),
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"LMCache MP client ({mode}) failed: {proc.stderr[-3000:]}")
    point: dict[str, Any] = json.loads(lines[-1])
    return point


def run_lmcache_mp(
    python: Path, cfg: MPPeerConfig | None = None, work: Path | None = None
) -> dict[str, Any]:
    """Run every (size, mode) point against its own LMCache MP server; a JSON-able dict
    with GB/s per point. Raises PeerUnavailable when ``python`` lacks LMCache."""
    cfg = cfg or MPPeerConfig()
    for mode in cfg.modes:
        if mode not in MODES:
            raise ValueError(f"unknown LMCache transfer mode {mode!r} (known: {MODES})")
    for size in cfg.sizes:
        block = BLOCK_TOKENS * TOKEN_BYTES
        if size < 2 * block or size % block:
            raise ValueError(f"chunk size {size} is not 2 or more blocks of 256 KiB")
    versions = check_python(python)
    points: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        if work is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvlife-lmc-")))
        for size in cfg.sizes:
            tokens = size // TOKEN_BYTES
            for mode in cfg.modes:
                deadline = time.monotonic() + cfg.timeout_s
                with _server(python, tokens, cfg.l1_gb(size), work, cfg.server_cpus) as srv:
                    srv.wait_ready(deadline)
                    point = _run_client(python, srv.url, mode, tokens, cfg, deadline)
                point["l1_gb"] = cfg.l1_gb(size)
                points.append(point)
    return {
        "peer": "lmcache-mp",
        "versions": versions,
        "python": str(python),
        "config": asdict(cfg),
        "notes": NOTES,
        "points": points,
    }


# --- the client: runs in the peer venv (torch, lmcache), never in kvlife's process -------


@dataclass
class _Timings:
    store: list[float] = field(default_factory=list)
    retrieve: list[float] = field(default_factory=list)
    lookup: list[float] = field(default_factory=list)


def _client(url: str, mode: str, chunk_tokens: int, n: int, reps: int) -> dict[str, Any]:
    import torch
    from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
    from lmcache.cli.commands.bench.server_bench.config import BenchConfig

    blocks = n * chunk_tokens // BLOCK_TOKENS
    cfg = BenchConfig(
        rpc_url=url, http_url="", mode="cpu", transfer_mode=mode, tp_size=1, use_mla=False,
        num_tokens=n * chunk_tokens, kvcache_shape_spec=f"(2,{2 * blocks},16,8,64):float16:8",
        num_blocks=2 * blocks, block_size=BLOCK_TOKENS,
    )  # fmt: skip
    client = ServerBenchClient(cfg, log=lambda _msg: None)
    client.start()
    try:
        worker = client._workers[0]
        layers = list(worker.kv_caches.values())
        total = n * chunk_tokens * TOKEN_BYTES
        gen = torch.Generator().manual_seed(chunk_tokens * 7 + len(mode))
        t = _Timings()
        expected: list[Any] = []
        first = None
        for rep in range(reps + 1):
            req = client.create_request(1 + rep, f"kvlife-store-{rep}", "store")
            if req is None or req.total_chunks != n:
                raise RuntimeError(f"request has {req and req.total_chunks} chunks, not {n}")
            views = [x.narrow(1, req.block_offset, req.num_blocks) for x in layers]
            for v in views:  # fresh bytes for every prompt
                v.view(torch.int16).copy_(
                    torch.randint(-(1 << 15), 1 << 15, v.shape, dtype=torch.int16, generator=gen)
                )
            if rep == 0:
                first = req
                expected = [v.clone() for v in views]
            t0 = time.perf_counter()
            res = client.store(req, 0, req.num_full_tokens)
            dt = time.perf_counter() - t0
            if res is None or not res.succeeded:
                raise RuntimeError(f"STORE failed ({mode}, rep {rep})")
            if rep:
                t.store.append(dt)
        assert first is not None
        wrong = 0
        for rep in range(reps + 1):
            t0 = time.perf_counter()
            lk = client.lookup(first)
            dt_lookup = time.perf_counter() - t0
            if lk.hit_chunks != n:
                raise RuntimeError(f"LOOKUP hit {lk.hit_chunks} of {n} chunks ({mode})")
            for x in layers:  # what the retrieve must overwrite
                x.narrow(1, first.block_offset, first.num_blocks).zero_()
            t0 = time.perf_counter()
            res = client.retrieve(first, 0, first.num_full_tokens)
            dt = time.perf_counter() - t0
            if res is None or not res.succeeded:
                raise RuntimeError(f"RETRIEVE failed ({mode}, rep {rep})")
            got = [x.narrow(1, first.block_offset, first.num_blocks) for x in layers]
            if not all(
                torch.equal(g.view(torch.int16), e.view(torch.int16))
                for g, e in zip(got, expected, strict=True)
            ):
                wrong += 1
            if rep:
                t.retrieve.append(dt)
                t.lookup.append(dt_lookup)
        client.end_session(first)
        if wrong:
            raise RuntimeError(f"{wrong} of {reps + 1} retrieves returned wrong bytes ({mode})")
        inner = getattr(worker.transfer_context, "_engine_driven_context", None)
        context = type(worker.transfer_context).__name__
        if inner is not None:  # SHM slots, or the pickle fallback when the pool is not found
            context += f"/{type(inner).__name__}"
    finally:
        client.close()
    return _summary(mode, chunk_tokens, n, total, t, context)


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    m = len(s) // 2
    return s[m] if len(s) % 2 else (s[m - 1] + s[m]) / 2


def _p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)]


def _summary(
    mode: str, chunk_tokens: int, n: int, total: int, t: _Timings, context: str
) -> dict[str, Any]:
    return {
        "mode": mode,
        "transfer_context": context,
        "chunk_bytes": chunk_tokens * TOKEN_BYTES,
        "chunk_tokens": chunk_tokens,
        "chunks_per_call": n,
        "reps": len(t.store),
        "store_gbps": total / _median(t.store) / 1e9,
        "retrieve_gbps": total / _median(t.retrieve) / 1e9,
        "store_p99_ms": _p99(t.store) * 1e3,
        "retrieve_p99_ms": _p99(t.retrieve) * 1e3,
        "lookup_median_ms": _median(t.lookup) * 1e3,
        "verified": True,
    }


# --- command line ------------------------------------------------------------------------


def format_report(r: dict[str, Any]) -> str:
    from kvlife.report import format_table

    v = r["versions"]
    rows = [
        [
            p["mode"],
            f"{p['chunk_bytes'] >> 10} KiB",
            f"{p['store_gbps']:.2f}",
            f"{p['retrieve_gbps']:.2f}",
            f"{p['store_p99_ms']:.1f}",
            f"{p['retrieve_p99_ms']:.1f}",
            f"{p['lookup_median_ms']:.2f}",
        ]
        for p in r["points"]
    ]
    head = ["mode", "chunk", "store GB/s", "retrieve GB/s", "store p99 ms", "retr. p99 ms"]
    return "\n".join(
        [
            f"LMCache {v['lmcache']} multi-process mode (torch {v['torch']}, CPU), "
            f"{r['config']['chunks_per_call']} chunks per call, bytes verified",
            format_table([*head, "lookup ms"], rows),
        ]
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvlife bench lmcache-mp", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--python", type=Path, default=None, help="the peer venv's python")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--quick", action="store_true", help="a small run (shape only)")
    p.add_argument("--mode", choices=MODES, action="append", default=None)
    p.add_argument("--client", nargs=5, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.client is not None:
        url, mode, tokens, n, reps = args.client
        print(json.dumps(_client(url, mode, int(tokens), int(n), int(reps))))
        return 0
    python = find_peer_python(args.python)
    if python is None:
        print(
            f"kvlife: error: no peer venv python (--python, ${PEER_PYTHON_ENV} or "
            "../peer-venv/bin/python); see kvlife/bench/peer_lmcache_mp.py",
            file=sys.stderr,
        )
        return 2
    cfg = MPPeerConfig.small() if args.quick else MPPeerConfig()
    if args.mode:
        cfg = MPPeerConfig(**{**asdict(cfg), "modes": tuple(args.mode)})
    try:
        result = run_lmcache_mp(python, cfg)
    except PeerUnavailable as exc:
        print(f"kvlife: error: {exc}", file=sys.stderr)
        return 2
    print(format_report(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""One run of ``kvlife bench io``: a scratch directory, the data path for every object
size, the lookup, and the JSON document of it all."""

from __future__ import annotations

import os
import platform
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import numpy as np
from tqdm import tqdm

from kvlife.bench.io.config import SCHEMA_VERSION, GiB, IOBenchConfig, MiB, size_label
from kvlife.bench.io.datapath import DataPathRun, bench_size
from kvlife.bench.io.device_time import DeviceTimedIO
from kvlife.bench.io.lookup import bench_lookup
from kvlife.bench.io.summary import SizeSummary, summarise, targets
from kvlife.bench.limits import machine_figures
from kvlife.bench.peer_lmcache import LMCacheDiskPeer, PeerUnavailable, check_available
from kvlife.tiers.disk import DiskTier, DiskTierConfig
from kvlife.tiers.disk.fileio import probe_direct_io
from kvlife.tiers.registry import footprint


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
        DiskTierConfig(capacity_bytes=4 * n * footprint("disk", biggest) + GiB, direct_io=direct),
        name="bench-disk",
        fileio=DeviceTimedIO(direct),
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
    ctx = DataPathRun(config, store_dir, direct, disk, np.random.default_rng(20240611), bar)
    summaries: dict[str, SizeSummary] = {}
    machine = machine_figures(store_dir.parent, quick=config.quick)
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
            ctx.samples[label] = bench_size(ctx, size)
            summaries[label] = summarise(size, n, ctx.samples[label])
        bar.set_description("bench io lookup")
        lookup = bench_lookup(config, workdir)
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
        "machine": machine,
        "limits": {k: v.limits for k, v in summaries.items()},
        "kvlife": {k: v.kvlife for k, v in summaries.items()},
        "ratios": ratios,
        "lookup_128_chunks_us": lookup_us,
        "lookup": lookup,
        "diagnostics": {k: v.diagnostics for k, v in summaries.items()},
        "targets": targets(ratios, lookup_us, float(lookup["vs_keys"])),
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

"""What one run of ``kvlife bench server`` measures, and the targets it is held to."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MiB = 1 << 20
ROUND_TRIP_POINTS = (
    ("put_dram", "memcpy_gbps"),
    ("load_disk", "raw_gbps"),
    ("put_write_through", "raw_gbps"),
)
"""The points given a round-trip bound, each with the limit its time is taken from
(:func:`kvlife.bench.server.run.add_round_trip_bounds`, printed by the report)."""

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
    reps: int = 40
    """Timed rounds per load and put point (the median is reported). Forty since
    2026-12-06: medians of ten moved by 0.1-0.15 between runs minutes apart; of forty,
    two runs a minute apart agreed within 0.035 on every disk load and put point (a
    third, minutes later, moved the 2 MiB loads by 0.1 again: the device's pace moves
    too). A run takes about a minute instead of half."""
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

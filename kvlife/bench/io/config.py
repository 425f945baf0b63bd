"""What one run of ``kvlife bench io`` measures: object sizes, batch, repetitions, the
targets its ratios are held to, and object sizes read and printed in binary units."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from kvlife.tiers.buffers import ALIGN

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
LOOKUP_VS_KEYS_TARGET = 1.5
"""Maximum time of that lookup over the time of its BLAKE3 chunk keys alone (issue 28:
what a lookup adds to the keys is at most half of them, on any machine)."""

SCHEMA_VERSION = 1


@dataclass(frozen=True, slots=True)
class IOBenchConfig:
    """What one run of the I/O benchmark measures."""

    sizes: tuple[int, ...] = DEFAULT_SIZES
    """Object sizes in bytes (positive multiples of 4096, as O_DIRECT needs)."""
    batch: int = 64
    """Objects per batch (one store or load call)."""
    repeat: int = 15
    """Repetitions per size; medians are reported. Fifteen since 2026-12-06: medians of
    five moved a lot between runs minutes apart (the 2 MiB store 0.67, 1.22 and 0.87 of
    raw writes, its loads 0.88, 1.05 and 0.97 of raw reads); two runs of fifteen met
    every target, each within 0.04 of the other on the disk points. A run takes about
    2.5x as long."""
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

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
    prompt, BLAKE3 chunk keys included, and its ratio to the keys alone (timed in
    turn, paired per iteration; target <= 1.5: a lookup adds at most half its keys);
machine
    the machine's own figures, measured the same way by every benchmark
    (:func:`kvlife.bench.limits.machine_figures`: memcpy, raw O_DIRECT write and read of
    64 MiB in 4 MiB calls, a Python loop's speed), so that two machines' ratios can
    be compared;
diagnostics
    copy into freshly allocated arrays vs memcpy: the first-touch page-fault cost that
    any path allocating per object pays; the seal alone (xxh3-128 of the batch) against
    memcpy and its share of a memory tier put.

Ratios are throughput ratios, kvlife ÷ limit, taken per repetition (paired) and
reported as their median; above 1 means faster than the limit, which noise allows.
GB/s are 10**9 bytes per second of payload (kvlife's frame headers are its own cost).
With ``--peer lmcache`` the same workload also runs through LMCache's LocalDiskBackend
(see :mod:`kvlife.bench.peer_lmcache`).

:func:`run_io_bench` returns the JSON document; :func:`main` is the command line. One
module per part: :mod:`.config` (what a run measures, sizes), :mod:`.datapath` (the
memory and disk tiers against the limits of :mod:`kvlife.bench.limits`, paired per
repetition), :mod:`.lookup` (a 128-chunk lookup), :mod:`.summary` (medians, ratios,
targets), :mod:`.run` (the run and its JSON document), :mod:`.report` (the table) and
:mod:`.cli`.
"""

from kvlife.bench.io.cli import build_parser, config_from_args, main
from kvlife.bench.io.config import IOBenchConfig, parse_size, size_label
from kvlife.bench.io.report import format_report
from kvlife.bench.io.run import run_io_bench
from kvlife.bench.limits import alloc_copy, memcpy, raw_read, raw_write

__all__ = [
    "IOBenchConfig",
    "alloc_copy",
    "build_parser",
    "config_from_args",
    "format_report",
    "main",
    "memcpy",
    "parse_size",
    "raw_read",
    "raw_write",
    "run_io_bench",
    "size_label",
]

"""The table ``kvlife bench io`` prints: each kvlife operation beside its limit, the
ratio and its target; then the lookup, seal and page-fault diagnostics."""

from __future__ import annotations

from kvlife.bench.io.config import (
    DISK_TARGET,
    LOOKUP_TARGET_US,
    LOOKUP_VS_KEYS_TARGET,
    MEM_TARGET,
    TARGET_MIN_BYTES,
    USER_PATH_TARGET,
    parse_size,
)
from kvlife.bench.limits import format_machine
from kvlife.report import format_table

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
    vs_keys = float(lookup["vs_keys"])
    lines.append(
        f"lookup ÷ its chunk keys alone (paired per iteration): {vs_keys:.2f}. Target "
        f"≤{LOOKUP_VS_KEYS_TARGET:g}: " + ("met" if vs_keys <= LOOKUP_VS_KEYS_TARGET else "NOT met")
    )
    if "vs_keys_cpu" in lookup:  # documents written before CPU times were measured lack it
        lines.append(
            f"in CPU time: lookup {float(lookup['cpu_median_us']):.0f} µs, keys "
            f"{float(lookup['key_computation_cpu_median_us']):.0f} µs, paired ratio "
            f"{float(lookup['vs_keys_cpu']):.2f}"
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
    split = ", ".join(
        f"{label} {100 * d['disk_store_device_share']:.0f}% (raw ÷ those calls "
        f"{d['disk_store_device_vs_raw']:.2f})"
        for label, d in diag.items()
        if "disk_store_device_share" in d
    )
    if split:
        lines.append(f"disk store time inside the device's write calls: {split}")
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
    machine = result.get("machine")
    if isinstance(machine, dict):
        lines.append(format_machine(machine))
    for note in result.get("notes", []) or []:  # type: ignore[attr-defined]
        lines.append(f"note: {note}")
    return "\n".join(lines)

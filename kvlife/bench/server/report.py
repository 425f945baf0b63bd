"""The tables ``kvlife bench server`` prints."""

from __future__ import annotations

from typing import Any

from kvlife.bench.limits import format_machine
from kvlife.bench.server.config import ROUND_TRIP_POINTS
from kvlife.report import format_table

_SERIES = (
    ("inproc", "in-process store"),
    ("sealed", "ceiling: copy + seal, one thread"),
    ("split", "copy, seal on a 2nd thread MiB by MiB (a reference)"),
    ("stream", "the same bytes copied alone, streaming stores"),
    ("server_hashed", "seals hashed by the server (put_written)"),
    ("unnoticed", "hashed by the server at the commit (no put_written)"),
    ("shared", "shared buffers"),
    ("new", "no buffers: new arrays"),
    ("no_landed", "the caller's buffers, no landed parts"),
    ("direct", "direct reads: the client reads the frames"),
    ("direct_new", "direct reads into new arrays (the vLLM worker's loads)"),
    ("verified", "ceiling: the same reads verified, native only"),
    ("copied", "ceiling: raw reads, each piece copied out + hashed beside"),
    ("frames_raw", "raw reads of the frames' own bytes, nothing verified"),
    ("floor", "floor: a bare server, no store"),
    ("floor_sealed", "floor: a bare server, seals by the client"),
)
"""The other series of a point, each a row of its own: (key, label)."""


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
    ]
    if "client_cpu_p50_us" in lk:  # documents written before CPU times were measured lack it
        lines.append(
            f"CPU time: in-process {lk['inproc_cpu_p50_us']:.0f} µs; served, the client's "
            f"{lk['client_cpu_p50_us']:.0f} µs + the server's "
            f"{lk['server_cpu_us_per_lookup']:.0f} µs per lookup"
        )
    lines.append("")
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
            for extra, label in _SERIES:
                if f"{extra}_gbps" in p:
                    rows.append(
                        [
                            f"{key} ({label})",
                            f"{p['chunk_bytes'] >> 10} KiB",
                            f"{p[f'{extra}_gbps']:.2f}",
                            f"{p[f'{limit}_gbps']:.2f}",
                            limit,
                            f"{p[f'ratio_{extra}']:.2f}",
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
    lines.append(f"rounds per load and put point: {r['config']['reps']} (medians reported)")
    if "machine" in r:
        lines.append(format_machine(r["machine"]))
    for p in r.get("load_disk", []):
        c = p.get("cpu")
        if c:
            lines.append(
                f"disk loads of {p['chunk_bytes'] >> 10} KiB, CPU µs per chunk: ordinary "
                f"buffers client {c['client_ordinary_us_per_chunk']:.0f} + server "
                f"{c['server_ordinary_us_per_chunk']:.0f}, shared buffers client "
                f"{c['client_shared_us_per_chunk']:.0f} + server "
                f"{c['server_shared_us_per_chunk']:.0f}; raw read "
                f"{c['client_raw_us_per_chunk']:.0f}, xxh3-128 {c['hash_us_per_chunk']:.0f}"
                f"; chunks the server read from frames without pins: "
                f"{p.get('frame_loaded_chunks', 0)}"
            )
    for p in r.get("load_disk", []):
        if "ordinary_of_copied" in p and "shared_of_verified" in p:
            lines.append(
                f"disk loads of {p['chunk_bytes'] >> 10} KiB against their ceilings: into "
                f"the caller's buffers {p['ordinary_of_copied']:.2f} of raw reads with the "
                f"copy out beside them, into shared buffers {p['shared_of_verified']:.2f} "
                "of the same reads verified natively"
                + (
                    f"; landed parts took {p['landed_time_ratio']:.3f} of the time without"
                    if "landed_time_ratio" in p
                    else ""
                )
            )
        if "server_of_frames_raw" in p:
            lines.append(
                f"disk loads of {p['chunk_bytes'] >> 10} KiB against raw reads of the frames' "
                f"own bytes (those at {p['ratio_frames_raw']:.2f} of the raw file's): into "
                f"the caller's buffers {p['server_of_frames_raw']:.2f}, into shared buffers "
                f"{p['shared_of_frames_raw']:.2f}"
                + (
                    f", read directly {p['direct_of_frames_raw']:.2f}, the same reads "
                    f"verified natively {p['verified_of_frames_raw']:.2f}"
                    if "direct_of_frames_raw" in p and "verified_of_frames_raw" in p
                    else ""
                )
            )
        if "shared_bound" in p and "ordinary_bound" in p:
            lines.append(
                f"disk loads of {p['chunk_bytes'] >> 10} KiB, the most a served load reaches "
                "(its ceiling's time plus one round trip after idleness): into the "
                f"caller's buffers {p['ordinary_bound']:.2f}, into shared buffers "
                f"{p['shared_bound']:.2f} of raw reads"
            )
    for p in r.get("load_dram", []):
        if "of_stream" in p:
            lines.append(
                f"DRAM loads of {p['chunk_bytes'] >> 10} KiB: {p['of_stream']:.2f} into the "
                f"caller's buffers, {p['shared_of_stream']:.2f} into shared buffers, "
                f"{p.get('new_of_stream', float('nan')):.2f} into new arrays, of a "
                "streaming copy of the same bytes alone"
            )
    for p in r.get("put_dram", []):
        if "of_stream" in p:
            lines.append(
                f"DRAM puts of {p['chunk_bytes'] >> 10} KiB: {p['of_stream']:.2f} of the "
                "client's streaming copy of the same bytes alone"
            )
        c = p.get("server_cpu")
        if c:
            floor = c.get("floor_ms_per_put")
            lines.append(
                f"DRAM puts of {p['chunk_bytes'] >> 10} KiB: the server's CPU per put "
                f"{c['ms_per_put']:.2f} ms, busy {c['busy']:.2f} of the put's time"
                + (f" (the floor's server {floor:.2f} ms)" if floor is not None else "")
            )
        h = p.get("server_halves")
        if h:
            lines.append(
                f"DRAM puts of {p['chunk_bytes'] >> 10} KiB: the server's time per put in "
                f"the put verb (the store's prepare, while the client copies) "
                f"{h['prepare_ms']:.2f} ms, in put_commit (the last hash and the store's "
                f"commit, after the copy) {h['commit_ms']:.2f} ms"
            )
    lines += _round_trip_report(r)
    lines.append(_peer_report(r))
    return "\n".join(lines)


def _round_trip_report(r: dict[str, Any]) -> list[str]:
    """The round trip to the bare server and, per point, the ratio a served call could
    reach with nothing but its limit's time and one round trip (idle, back to back)."""
    rt = r.get("round_trip")
    if not rt:
        return []
    out = [
        f"one round trip to a bare server on the server's CPU: {rt['idle_us']:.0f} µs "
        f"after {rt['gap_ms']:g} ms idle (p90 {rt['idle_p90_us']:.0f}), "
        f"{rt['hot_us']:.0f} µs back to back"
    ]
    bounds = [
        f"{key.replace('_', ' ')} {p['chunk_bytes'] >> 10} KiB "
        f"{p['round_trip_bound']:.2f} / {p['round_trip_bound_hot']:.2f}"
        for key, _ in ROUND_TRIP_POINTS
        for p in r.get(key, [])
        if "round_trip_bound" in p and "round_trip_bound_hot" in p
    ]
    if bounds:
        out.append(
            "the limit's time plus one round trip, idle / back to back, as a ratio (a call "
            "that sleeps while it waits cannot pass the first): " + ", ".join(bounds)
        )
    return out


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

"""Per object size: medians of each metric, kvlife ÷ limit ratios paired per
repetition, diagnostics, and the targets the ratios are held to."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from kvlife.bench.io.config import (
    DISK_TARGET,
    LOOKUP_TARGET_US,
    LOOKUP_VS_KEYS_TARGET,
    MEM_TARGET,
    TARGET_MIN_BYTES,
    USER_PATH_TARGET,
    parse_size,
)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


@dataclass(slots=True)
class SizeSummary:
    limits: dict[str, float | int]
    kvlife: dict[str, float]
    ratios: dict[str, float]
    diagnostics: dict[str, float]
    peer: dict[str, float]


def summarise(size: int, n: int, s: dict[str, list[float]]) -> SizeSummary:
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
    return SizeSummary(
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
            # a disk store's time inside the device's write calls (pwritev, fdatasync),
            # and the raw write against those calls alone (paired): where the store's
            # ratio is lost, around the device or in it
            **_device_split(s),
        },
        peer=peer,
    )


def targets(
    ratios: dict[str, dict[str, float]], lookup_us: float, lookup_vs_keys: float
) -> list[dict[str, object]]:
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
    out.append(
        {
            "metric": "lookup_vs_keys",
            "size": None,
            "value": lookup_vs_keys,
            "target": f"<= {LOOKUP_VS_KEYS_TARGET:g}",
            "met": lookup_vs_keys <= LOOKUP_VS_KEYS_TARGET,
        }
    )
    return out


def _device_split(s: dict[str, list[float]]) -> dict[str, float]:
    """``disk_store_device_share`` and ``disk_store_device_vs_raw`` where the run timed
    the device's write calls (empty otherwise)."""
    device = s.get("disk_store_device")
    if not device:
        return {}
    store, raw = s["disk_store"], s["raw_write"]
    return {
        "disk_store_device_share": _median([d / t for d, t in zip(device, store, strict=True)]),
        "disk_store_device_vs_raw": _median([r / d for r, d in zip(raw, device, strict=True)]),
    }

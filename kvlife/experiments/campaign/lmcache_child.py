"""The LMCache side of the campaign, run in LMCache's own virtual environment.

``PEER_PYTHON -m kvlife.experiments.campaign.lmcache_child --dir D --n N --seed S --json OUT``
drives LMCache's LocalDiskBackend (through :class:`~kvlife.bench.peer_lmcache.LMCacheDiskPeer`)
with campaign payloads and injects, ``N`` times each, the faults that apply to a disk
backend: a stored file truncated to half (``file-truncated``), one byte of a stored file
flipped (``file-bitflip``), and the backend restarted on the same directory
(``restart``). Every load is held against the oracle. Only numpy and LMCache are
imported here (kvlife's own modules need packages the peer environment lacks).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvlife.experiments.campaign.oracle import wrong_bytes
from kvlife.experiments.campaign.payload import CHUNK_BYTES, payload

MiB = 1 << 20
KINDS = ("file-truncated", "file-bitflip", "restart")
_IDS = itertools.count(1)


def _peer(d: Path) -> Any:
    from kvlife.bench.peer_lmcache import LMCacheDiskPeer

    peer = LMCacheDiskPeer(d, pool_bytes=64 * MiB, disk_bytes=1 << 30, direct_io=False)
    # the peer numbers its keys from 1: a restarted one would reuse its files' names
    peer._ids = _IDS
    return peer


def _load(peer: Any, key: Any) -> bytes | None:
    """What LMCache serves for ``key`` (None: a miss)."""
    disk = peer._disk
    if not disk.contains(key):
        return None
    objs = disk.batched_get_blocking([key])
    obj = objs[0] if objs else None
    if obj is None:
        return None
    try:
        return bytes(obj.tensor.numpy().view(np.uint8)[:CHUNK_BYTES])
    finally:
        obj.ref_count_down()


def run(d: Path, n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    fields = ("injections", "detections", "served_chunks", "wrong_chunks", "wrong_bytes")
    tallies: dict[str, dict[str, Any]] = {
        k: {"kind": k, **dict.fromkeys(fields, 0), "acked_lost": 0, "recovery": []} for k in KINDS
    }
    peer = _peer(d)
    counter = 0
    try:
        for _ in range(n):
            for kind in KINDS:
                t = tallies[kind]
                counter += 1
                ck = hashlib.blake2b(f"{seed}/{counter}".encode(), digest_size=32).digest()
                before = set(os.listdir(d))
                keys, _ = peer.store([payload(ck)])
                new = [f for f in set(os.listdir(d)) - before if not f.startswith(".")]
                t["injections"] += 1
                if kind == "restart":
                    peer.close()
                    started = time.perf_counter()
                    peer = _peer(d)
                    t["recovery"].append(time.perf_counter() - started)
                elif new:
                    f = d / new[0]
                    size = f.stat().st_size
                    t["file_bytes"] = size
                    if kind == "file-truncated":
                        os.truncate(f, size // 2)
                    else:
                        with f.open("r+b") as fh:
                            at = rng.randrange(size)
                            fh.seek(at)
                            b = fh.read(1)
                            fh.seek(at)
                            fh.write(bytes([b[0] ^ 0xFF]))
                # an engine keeps working between store and load: LMCache's host pool
                # hands the victim's load a buffer that held other KV since
                fk = hashlib.blake2b(f"{seed}/{counter}/filler".encode(), digest_size=32)
                fkeys, _ = peer.store([payload(fk.digest())])
                _load(peer, fkeys[0])
                got = _load(peer, keys[0])
                if got is None:
                    if kind == "restart":
                        t["acked_lost"] += 1
                    else:
                        t["detections"] += 1
                    continue
                t["served_chunks"] += 1
                bad = wrong_bytes(ck, got)
                if bad:
                    t["wrong_chunks"] += 1
                    t["wrong_bytes"] += bad
    finally:
        peer.close()
    return list(tallies.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(run(args.dir, args.n, args.seed)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

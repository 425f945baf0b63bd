"""LMCache's multi-process server with a client killed mid-store, run in LMCache's own
virtual environment (torch and LMCache; nothing of kvlife's store is imported).

``PEER_PYTHON -m kvlife.experiments.campaign.lmcache_mp_child URL MODE N SEED OUT``: against a
running LMCache MP server at ``URL``, ``N`` times: fork a client (LMCache's own
``ServerBenchClient``, as :mod:`kvlife.bench.peer_lmcache_mp` drives it), fill its
request's blocks with bytes that are a pure function of (seed, request), start the STORE
and SIGKILL the client a random 0-30 ms into it. Then one checker client looks every
request up, retrieves what the server reports as hits and compares every byte with what
the killed client was storing. Writes the counts as JSON to ``OUT``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sys
import time
from typing import Any

BLOCK_TOKENS = 16
CHUNK_TOKENS = 32
CHUNKS = 2


def _config(url: str, mode: str) -> Any:
    from lmcache.cli.commands.bench.server_bench.config import BenchConfig

    blocks = CHUNKS * CHUNK_TOKENS // BLOCK_TOKENS
    return BenchConfig(
        rpc_url=url, http_url="", mode="cpu", transfer_mode=mode, tp_size=1, use_mla=False,
        num_tokens=CHUNKS * CHUNK_TOKENS, kvcache_shape_spec=f"(2,{8 * blocks},16,8,64):float16:8",
        num_blocks=8 * blocks, block_size=BLOCK_TOKENS,
    )  # fmt: skip


def _views(client: Any, req: Any) -> list[Any]:
    layers = list(client._workers[0].kv_caches.values())
    return [x.narrow(1, req.block_offset, req.num_blocks) for x in layers]


def _fill(views: list[Any], seed: int, i: int) -> list[Any]:
    import torch

    gen = torch.Generator().manual_seed(seed * 1_000_003 + i)
    out = []
    for v in views:
        data = torch.randint(-(1 << 15), 1 << 15, v.shape, dtype=torch.int16, generator=gen)
        v.view(torch.int16).copy_(data)
        out.append(data)
    return out


def _victim(url: str, mode: str, seed: int, i: int, w: int) -> None:
    from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient

    client = ServerBenchClient(_config(url, mode), log=lambda _m: None)
    client.start()
    req = client.create_request(100 + i, f"kvf-{seed}-{i}", "store")
    _fill(_views(client, req), seed, i)
    os.write(w, b"s")
    client.store(req, 0, req.num_full_tokens)
    os.write(w, b"d")
    time.sleep(120)


def run(url: str, mode: str, n: int, seed: int, mid_store: bool = True) -> dict[str, Any]:
    """``mid_store=False`` is the control: each client is killed only once its STORE
    returned, so every hit must be right (else the check itself is wrong)."""
    import torch
    from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient

    rng = random.Random(seed)
    completed = 0
    kills = 0
    for i in range(n):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                _victim(url, mode, seed, i, w)
            finally:
                os._exit(0)
        os.close(w)
        first = os.read(r, 1)
        if first == b"s" and mid_store:
            time.sleep(rng.uniform(0.0, 0.03))
        elif first == b"s":
            os.read(r, 1)  # the STORE returned
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        kills += 1
        os.set_blocking(r, False)
        with contextlib.suppress(BlockingIOError):
            completed += os.read(r, 8).count(b"d")
        os.close(r)
    checker = ServerBenchClient(_config(url, mode), log=lambda _m: None)
    checker.start()
    served = wrong_chunks = wrong_bytes = 0
    try:
        for i in range(n):
            req = checker.create_request(100 + i, f"kvf-check-{seed}-{i}", "retrieve")
            lk = checker.lookup(req)
            hits = int(lk.hit_chunks)
            if not hits:
                continue
            views = _views(checker, req)
            for v in views:
                v.zero_()
            res = checker.retrieve(req, 0, hits * CHUNK_TOKENS)
            if res is None or not res.succeeded:
                continue
            want = _fill([v.clone() for v in views], seed, i)
            blocks = hits * CHUNK_TOKENS // BLOCK_TOKENS
            for chunk in range(hits):
                lo, hi = chunk * (blocks // hits), (chunk + 1) * (blocks // hits)
                bad = 0
                for v, e in zip(views, want, strict=True):
                    got = v.view(torch.int16).narrow(1, lo, hi - lo)
                    exp = e.narrow(1, lo, hi - lo)
                    bad += int((got.view(torch.uint8) != exp.view(torch.uint8)).sum())
                served += 1
                if bad:
                    wrong_chunks += 1
                    wrong_bytes += bad
            checker.end_session(req)
    finally:
        checker.close()
    return {
        "kills": kills,
        "stores_completed_before_kill": completed,
        "served_chunks": served,
        "wrong_chunks": wrong_chunks,
        "wrong_bytes": wrong_bytes,
    }


def main() -> int:
    url, mode, n, seed, out = sys.argv[1:6]
    control = len(sys.argv) > 6 and sys.argv[6] == "control"
    with open(out, "w") as fh:
        json.dump(run(url, mode, int(n), int(seed), mid_store=not control), fh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

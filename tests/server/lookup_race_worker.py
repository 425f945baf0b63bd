"""Client processes of the lookup race test (:mod:`tests.server.test_lookup_race`):
``python -m tests.server.lookup_race_worker ROLE SOCKET SECONDS SEED``.

- ``writer``: puts, evicts from DRAM and invalidates the prompts of seeds 0-7 (each
  prompt's chunks hold bytes of their own) until SECONDS passed.
- ``reader``: looks each prompt up (int32 token arrays: keys hashed from a view) and
  loads its hits into buffers of the chunk layout (the hinted path when every hit was in
  DRAM) or as fresh arrays, and compares every loaded chunk with the prompt's bytes.

Each prints a JSON summary; a reader that was served another chunk's bytes prints
``wrong`` and exits 1.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from kvlife.client import RemoteStore
from kvlife.core.identity import PUBLIC
from tests.conftest import TINY, prompt_kv, tiny_identity

N = TINY.tokens_per_chunk
CHUNKS = 6
PROMPTS = 8
MODEL = "lookup-race"


def writer(path: str, seconds: float, seed: int) -> int:
    rng = np.random.default_rng(seed)
    ident = tiny_identity(model_id=MODEL)
    ops = {"put": 0, "evict": 0, "invalidate": 0}
    with RemoteStore(path) as store:
        dram = store.tier_names[0]
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            r = rng.random()
            if r < 0.55:
                tokens, kv = prompt_kv(int(rng.integers(PROMPTS)), CHUNKS * N)
                store.put_prompt(ident, PUBLIC, tokens, kv)
                ops["put"] += 1
            elif r < 0.75:
                store.evict(dram, int(rng.integers(1, 8)) * TINY.chunk_nbytes)
                ops["evict"] += 1
            else:
                store.invalidate(model=MODEL)
                ops["invalidate"] += 1
    print(json.dumps(ops))
    return 0


def reader(path: str, seconds: float, seed: int) -> int:
    rng = np.random.default_rng(seed)
    ident = tiny_identity(model_id=MODEL)
    prompts = [prompt_kv(p, CHUNKS * N) for p in range(PROMPTS)]
    seen = {"lookups": 0, "all_dram": 0, "loaded": 0}
    with RemoteStore(path) as store:
        dram = store.tier_names[0]
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            p = int(rng.integers(PROMPTS))
            tokens, kv = prompts[p]
            res = store.lookup(ident, PUBLIC, tokens.astype(np.int32))
            seen["lookups"] += 1
            if not res.hits:
                continue
            seen["all_dram"] += all(h.tier == dram for h in res.hits)
            if rng.random() < 0.5:  # a window for the writer between lookup and load
                time.sleep(float(rng.random()) * 0.005)
            outs = None
            if rng.random() < 0.8:  # buffers of the layout: hinted when all in DRAM
                outs = [np.full(TINY.chunk_shape, np.nan, np.float16) for _ in res.hits]
            got = store.load(res, outs)
            seen["loaded"] += got.loaded
            for i, arr in enumerate(got.arrays):
                want = kv[:, :, :, i * N : (i + 1) * N]
                if not np.array_equal(arr, want) or (
                    outs is not None and not np.array_equal(outs[i], want)
                ):
                    print(json.dumps({"wrong": [p, i], **seen}))
                    return 1
    print(json.dumps(seen))
    return 0


def main(argv: list[str]) -> int:
    role, path, seconds, seed = argv
    run = {"writer": writer, "reader": reader}[role]
    return run(path, float(seconds), int(seed))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

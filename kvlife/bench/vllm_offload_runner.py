"""Replay block sequences through vLLM's own CPU offloading manager; write hits as JSON.

Run with the interpreter that has vLLM (``.venv-vllm``), by
:func:`kvlife.bench.vllm_offload.vllm_offload_curves`:
``python -m kvlife.bench.vllm_offload_runner SPEC.json OUT.json``. It imports vLLM's
installed ``CPUOffloadingManager`` (``vllm/v1/kv_offload/cpu/manager.py``) with its
cache policies ("lru", "arc") and its ``store_threshold`` admission (a block is stored
only once it was offered that many times), and drives it as the offloading connector's
scheduler side does, one request at a time:

1. ``on_new_request``; ``lookup`` of every block in prompt order (a block found ``HIT``
   is counted present; the leading run of hits is the usable prefix);
2. the prefix is loaded: ``prepare_load`` then ``complete_load``;
3. the request's blocks are offered for storing: ``prepare_store`` (vLLM evicts, never
   a block of the offer) then ``complete_store`` of what it chose to store;
4. ``on_request_finished`` (the policies update recency there, head of the prompt last).

Nothing here re-implements a policy: the counts are what vLLM's code decides. Spec:
``{"requests": [[block ids]], "block_tokens": n, "runs": [{"name", "policy",
"store_threshold", "capacity"}]}``; each run gets ``hits``, ``prefix_hits``,
``touches``, ``stores_skipped`` (blocks not stored: threshold not reached or no room)
and ``seconds``.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def replay(
    requests: list[list[int]], block_tokens: int, policy: str, threshold: int, capacity: int
) -> dict[str, Any]:
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    mgr = CPUOffloadingManager(capacity, cache_policy=policy, store_threshold=threshold)
    keys_of: dict[int, Any] = {}

    def key(b: int) -> Any:
        k = keys_of.get(b)
        if k is None:
            k = keys_of[b] = make_offload_key(b.to_bytes(16, "big", signed=True), 0)
        return k

    hits = prefix = touches = skipped = 0
    t0 = time.perf_counter()
    for r, blocks in enumerate(requests):
        ctx = ReqContext(req_id=str(r))
        keys = [key(b) for b in blocks]
        for i, k in enumerate(keys):
            ctx.set_offload_key_position(k, (i + 1) * block_tokens)
        mgr.on_new_request(ctx)
        found = [mgr.lookup(k, ctx) == LookupResult.HIT for k in keys]
        touches += len(keys)
        hits += sum(found)
        p = found.index(False) if False in found else len(found)
        prefix += p
        if p:
            mgr.prepare_load(keys[:p], ctx)
            mgr.complete_load(keys[:p], ctx)
        missing = [k for k, f in zip(keys, found, strict=True) if not f]
        out = mgr.prepare_store(keys, ctx)
        if out is None:
            skipped += len(missing)
        else:
            skipped += len(missing) - len(out.keys_to_store)
            if out.keys_to_store:
                mgr.complete_store(out.keys_to_store, ctx)
        mgr.on_request_finished(ctx)
    return {
        "hits": hits,
        "prefix_hits": prefix,
        "touches": touches,
        "stores_skipped": skipped,
        "seconds": time.perf_counter() - t0,
    }


def main(argv: list[str]) -> int:
    with open(argv[0], encoding="utf-8") as f:
        spec = json.load(f)
    import vllm

    runs = []
    for run in spec["runs"]:
        got = replay(
            spec["requests"],
            int(spec["block_tokens"]),
            run["policy"],
            int(run["store_threshold"]),
            int(run["capacity"]),
        )
        runs.append(dict(run, **got))
    with open(argv[1], "w", encoding="utf-8") as f:
        json.dump({"vllm_version": vllm.__version__, "runs": runs}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

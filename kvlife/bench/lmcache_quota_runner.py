"""Replay per-tenant requests through LMCache's own per-``cache_salt`` quota eviction;
write each request's prefix hits as JSON.

Run as a script (not ``-m``: kvlife is neither imported here nor put on the path) with
the interpreter that has LMCache, by :func:`kvlife.experiments.sharing_scope.lmcache_quota_hits`:
``python kvlife/bench/lmcache_quota_runner.py SPEC.json OUT.json``.

**LMCache's code** (0.5.6, ``lmcache/v1/distributed/``), used as installed:

- ``IsolatedLRUEvictionPolicy``, made by ``CreateEvictionPolicy(EvictionConfig("IsolatedLRU",
  trigger_watermark, eviction_ratio))`` (``eviction_policy/``);
- ``L2EvictionPolicy`` (``eviction.py``), the listener that feeds the policy the
  adapter's stored / accessed / deleted events;
- ``L2AdapterInterface``'s byte accounting per salt and listener notification
  (``l2_adapters/base.py``: ``_notify_keys_stored``, ``_notify_keys_accessed``,
  ``_notify_keys_deleted``, ``get_usage``);
- ``QuotaManager`` (``quota_manager.py``), one ``set_quota`` per tenant;
- ``L2AdapterEvictionState`` and ``L2EvictionController`` (``storage_controllers/
  eviction_controller.py``): each cycle is the controller's own ``_check_and_evict``
  (which goes to ``_check_and_evict_by_cache_salt``: salts at or over ``watermark *
  limit`` lose ``eviction_ratio`` of their LRU list through the adapter's ``delete``).

**This driver's part**: the controller's thread is never started (its loop is
``sleep(1)`` then ``_check_and_evict`` per adapter); the driver calls ``_check_and_evict``
once after every request instead (the most favourable schedule, the same as the
re-implementation's). The adapter is :class:`DictL2Adapter`, an in-process dictionary
written after ``MockL2Adapter``'s rules (a key already present is skipped; a key that
does not fit is skipped; a delete notifies the deleted keys; a load notifies the keys
it read) without its event loop, memory objects and simulated bandwidth; each block is
one byte, so bytes count blocks. Per request: lookup of the prompt's keys (the leading
run present is the prefix hit), load of the prefix, store of the whole prompt, one
eviction cycle.

Spec: ``{"requests": [[salt, [block ids]]], "capacity_blocks": n, "quotas": {salt:
blocks}, "trigger_watermark": w, "eviction_ratio": r}``. Out: ``{"lmcache_version",
"prefix_hits": [per request], "evicted": {salt: n}}``.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any


def replay(spec: dict[str, Any]) -> dict[str, Any]:
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.distributed.config import EvictionConfig
    from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
    from lmcache.v1.distributed.quota_manager import QuotaManager
    from lmcache.v1.distributed.storage_controllers.eviction_controller import (
        L2AdapterEvictionState,
        L2EvictionController,
    )

    evicted: dict[str, int] = {}

    class DictL2Adapter(L2AdapterInterface):  # type: ignore[misc]
        """MockL2Adapter's store / load / delete rules on a dictionary, synchronously."""

        def __init__(self, capacity: int) -> None:
            super().__init__(max_capacity_bytes=capacity)
            self.objects: dict[Any, int] = {}
            self.used = 0

        def store(self, keys: list[Any]) -> None:
            stored = []
            for key in keys:
                if key in self.objects or self.used + 1 > self._max_capacity_bytes:
                    continue
                self.objects[key] = 1
                self.used += 1
                stored.append(key)
            if stored:
                self._notify_keys_stored(stored, [1] * len(stored))

        def lookup_prefix(self, keys: list[Any]) -> int:
            p = 0
            while p < len(keys) and keys[p] in self.objects:
                p += 1
            return p

        def load(self, keys: list[Any]) -> None:
            if keys:
                self._notify_keys_accessed(keys)

        def delete(self, keys: list[Any]) -> None:
            gone = [k for k in keys if self.objects.pop(k, None) is not None]
            self.used -= len(gone)
            for k in gone:
                evicted[k.cache_salt] = evicted.get(k.cache_salt, 0) + 1
            if gone:
                self._notify_keys_deleted(gone, [1] * len(gone))

        # The asynchronous I/O interface is not used by this driver.
        def _unused(self, *a: Any, **k: Any) -> Any:
            raise NotImplementedError("DictL2Adapter is driven synchronously")

        get_store_event_fd = get_lookup_and_lock_event_fd = get_load_event_fd = _unused
        submit_store_task = pop_completed_store_tasks = _unused
        submit_lookup_and_lock_task = query_lookup_and_lock_result = _unused
        submit_unlock = submit_load_task = query_load_result = _unused

        def close(self) -> None:
            pass

    adapter = DictL2Adapter(int(spec["capacity_blocks"]))
    config = EvictionConfig(
        eviction_policy="IsolatedLRU",
        trigger_watermark=float(spec["trigger_watermark"]),
        eviction_ratio=float(spec["eviction_ratio"]),
    )
    state = L2AdapterEvictionState(0, adapter, config)
    quotas = QuotaManager()
    for salt, blocks in spec["quotas"].items():
        quotas.set_quota(salt, int(blocks))
    controller = L2EvictionController([state], quota_manager=quotas)
    policy = type(state.eviction_policy).__name__

    hits = []
    for salt, blocks in spec["requests"]:
        keys = [
            ObjectKey(chunk_hash=int(b).to_bytes(8, "big"), model_name="m", kv_rank=0,
                      cache_salt=salt)
            for b in blocks
        ]  # fmt: skip
        p = adapter.lookup_prefix(keys)
        adapter.load(keys[:p])
        adapter.store(keys)
        controller._check_and_evict(state)
        hits.append(p)
    import lmcache

    return {
        "lmcache_version": getattr(lmcache, "__version__", "unknown"),
        "policy": policy,
        "prefix_hits": hits,
        "evicted": evicted,
    }


def main(argv: list[str]) -> int:
    with open(argv[0], encoding="utf-8") as f:
        spec = json.load(f)
    # The controller logs every over-quota cycle at INFO: one line per request here.
    logging.disable(logging.INFO)
    out = replay(spec)
    with open(argv[1], "w", encoding="utf-8") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

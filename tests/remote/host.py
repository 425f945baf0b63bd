"""One "host" of the multi-host tests: a separate process with its own local store
(DRAM in front of the shared Redis tier), driven by JSON lines on stdin, answering JSON
lines on stdout. Run as ``python -m tests.remote.host STORE_DIR TIER_OPTIONS_JSON``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import blake3
import numpy as np

from kvlife.core.identity import Namespace, NamespaceKind
from kvlife.core.objects import TierName
from kvlife.globalindex import GlobalIndex
from kvlife.store import KVStore, TierSpec
from kvlife.tiers.redis.published import PublishedTier
from tests.conftest import prompt_kv, tiny_identity


def digest(a: np.ndarray) -> str:
    return blake3.blake3(np.ascontiguousarray(a).tobytes()).hexdigest()


def main() -> None:
    path, kind, options = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    chain = (
        TierSpec("memory", "dram", 8 << 20),
        TierSpec(kind, "shared", 64 << 20, options=tuple((k, v) for k, v in options.items())),
    )
    store = KVStore.open(path, tiers=chain)
    shared = store._core.tiers[TierName("shared")]
    assert isinstance(shared, PublishedTier)
    index: GlobalIndex = shared.index
    print(json.dumps({"ready": True, "host": index.host}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        out: dict[str, object] = {"op": op}
        try:
            adapter = str(cmd.get("adapter", ""))
            ident = (
                tiny_identity(adapter_id=adapter, adapter_digest="d-" + adapter)
                if adapter
                else tiny_identity()
            )
            ns = Namespace(NamespaceKind.ORGANISATION, cmd.get("ns", "acme"))
            if op == "put":
                tokens, kv = prompt_kv(cmd["seed"], cmd.get("ntokens", 64))
                res = store.put_prompt(ident, ns, tokens, kv)
                out["stored"] = res.stored
            elif op == "flush":
                out["flushed"] = store.flush()
            elif op == "lookup":
                tokens, _ = prompt_kv(cmd["seed"], cmd.get("ntokens", 64))
                hit = store.lookup(ident, ns, tokens)
                out["hits"] = len(hit.hits)
                out["tiers"] = [h.tier for h in hit.hits]
                loaded = store.load(hit)
                out["loaded"] = loaded.loaded
                out["digests"] = [digest(a) for a in loaded.arrays]
                store.drain()
            elif op == "invalidate":
                crit = {k: v for k, v in cmd["criteria"].items()}
                if "namespace" in crit:
                    crit["namespace"] = str(
                        Namespace(NamespaceKind.ORGANISATION, crit["namespace"])
                    )
                if "prefix" in crit:
                    crit["prefix"] = bytes.fromhex(crit["prefix"])
                out["epoch"] = index.invalidate(**crit).epoch
            elif op == "revoke":
                out["token"] = index.revoke(cmd["host"], cmd.get("ban_ms", 0))
            elif op == "details":
                out["details"] = shared.details()
            elif op == "quit":
                break
        except Exception as exc:  # reported to the test, which asserts on it
            out["error"] = f"{type(exc).__name__}: {exc}"
        print(json.dumps(out), flush=True)
    store.close()


if __name__ == "__main__":
    main()

"""kvlife under vLLM: a V1 KV connector (:mod:`.connector`), the engine identity it keys
chunks by (:mod:`.identity`), the store it shares between vLLM's processes
(:mod:`.stores`). Importing this package does not import vLLM; :mod:`.connector` does.
The driver that runs requests through one engine and writes JSON, for benchmarks and
tests, is :mod:`kvlife.bench.vllm_runner` (a benchmark driver, above the engines)."""

from __future__ import annotations

from typing import Any

CONNECTOR = "KVLifeConnector"
CONNECTOR_MODULE = "kvlife.engines.vllm.connector"


def extra_config(
    *,
    path: str = "",
    socket: str = "",
    chunk_tokens: int = 64,
    dram_mib: int = 256,
    disk_mib: int = 4096,
    namespace: str = "public",
) -> dict[str, Any]:
    """``kv_connector_extra_config`` naming a kvlife store (exactly one of ``path`` and
    ``socket``; see :mod:`.stores`)."""
    out: dict[str, Any] = {"kvlife.chunk_tokens": chunk_tokens, "kvlife.namespace": namespace}
    if path:
        out |= {"kvlife.path": path, "kvlife.dram_mib": dram_mib, "kvlife.disk_mib": disk_mib}
    if socket:
        out["kvlife.socket"] = socket
    return out


def transfer_config(**kwargs: Any) -> Any:
    """A ``vllm.config.KVTransferConfig`` loading the kvlife connector (arguments as for
    :func:`extra_config`), with failed loads recomputed."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector=CONNECTOR,
        kv_connector_module_path=CONNECTOR_MODULE,
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=extra_config(**kwargs),
    )

"""kvlife as an SGLang HiCache storage backend (``HiCacheStorage``, sglang 0.5.23).

Register it with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvlife",
        "module_path": "kvlife.engines.sglang", "class_name": "KVLifeHiCacheStorage",
        "kvlife.path": "/var/kvlife", "kvlife.model_dir": "/models/m"}'

(``"kvlife.socket"`` instead of ``"kvlife.path"`` for a store served by ``kvlife
serve``; ``"interface_v1": 1`` makes the cache controller use the host-index variants
``batch_get_v1`` / ``batch_set_v1``.)

SGLang names a page by its own prefix-chained hash of the page's token ids and hands the
backend pages of its host pool, not tokens. So a page is one kvlife chunk of
``page_size`` tokens whose key is the SGLang page hash as the chunk's extra key (token
ids zero), under the full model identity: weights and tokenizer digests of the model
directory (a model name alone is never trusted), the host pool's geometry and dtype, the
tensor-parallel shard, and an engine digest naming SGLang's host layout; the namespace is
``kvlife.namespace`` (default public).

SGLang 0.5.23 does not hand a storage backend the request: it folds the request's
``extra_key`` (its LoRA id among it) and ``cache_salt`` into the seed of its page-hash
chain (``storage_namespace_seed``), so tenants and adapters already get distinct page
hashes, but kvlife cannot name them. Where SGLang passes a per-call dict
(``HiCacheStorageExtraInfo.extra_info`` of ``batch_exists``, ``batch_get_v1`` and
``batch_set_v1``), the backend carries what it finds there into the kvlife key and
index: ``cache_salt`` (a namespace of kind ``kvlife.salt_kind``, default organisation),
``kvlife.namespace`` (an explicit one, ``user:alice``), ``lora_id`` with ``lora_path``
(an adapter digested from its files; an id alone is digested as a name). Pages so
tagged can be invalidated by namespace and adapter. The legacy ``get``/``set`` calls
have no such dict and use the backend's namespace. A tenant per request cannot be carried
(:data:`NO_TENANT`): ``kvlife.tenancy = per_request`` is refused at start, and so is a
``kvlife serve --tenants`` store unless ``kvlife.tenancy = engine`` declares the engine
one tenant (every request its principal's, in ``kvlife.namespace``). Pages are stored
in kvlife's canonical layout ``(layers, 2, heads, page_size, head_dim)`` whatever the
host pool's layout, verified on every load: a corrupt or missing page is a miss
(``False`` / ``None``), never data.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import blake3
import msgpack
import numpy as np

from kvlife.core.errors import InvalidArgument, KVLifeError
from kvlife.core.identity import KVLayout, ModelIdentity, Namespace, NamespaceKind
from kvlife.core.payload import numpy_dtype, to_torch
from kvlife.engines.errors import UnsupportedModel
from kvlife.engines.identity import AdapterSpec
from kvlife.engines.vllm.identity import (
    files_digest,
    tokenizer_digest_of_dir,
    weights_digest_of_dir,
    with_adapter,
)
from kvlife.engines.vllm.stores import StoreAddress, StoreLease, open_store
from kvlife.results import LookupResult

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
except ImportError as exc:  # pragma: no cover - only without sglang
    raise ImportError("kvlife.engines.sglang needs sglang (pip install sglang)") from exc

log = logging.getLogger("kvlife.sglang")

# flat page shape of each MHA host-pool layout, and the permutation to kvlife's canonical
# (layers, 2, heads, tokens, head_dim); a size-1 page axis is squeezed first
_PAGE_LAYOUTS: dict[str, tuple[str, tuple[int, ...]]] = {
    "layer_first": ("2 L T H D", (1, 0, 3, 2, 4)),
    "page_first": ("2 T L H D", (2, 0, 3, 1, 4)),
    "page_first_direct": ("2 1 L T H D", (1, 0, 3, 2, 4)),
    "page_head": ("2 1 H T L D", (3, 0, 1, 2, 4)),
}
PAGE_TAG = b"kvlife.sglang.page.v1"


TENANCY_MODES = ("", "engine", "per_request")
"""``kvlife.tenancy``: unset (a store without principals), ``engine`` (the engine is one
tenant: every request in its principal's scopes), ``per_request`` (refused: see
:data:`NO_TENANT`)."""

NO_TENANT = (
    "SGLang's cache controller hands a storage backend no request and no tenant: every "
    "HiCacheStorageExtraInfo it makes holds prefix_keys only (sglang/srt/managers/"
    "cache_controller.py: the prefetch's batch_get in _page_transfer, its batch_exists "
    "in _storage_hit_query, the backup's batch_set in _page_backup), and a backup "
    "(write_storage's StorageOperation) names no request at all; a request's cache_salt "
    "reaches only SGLang's page hashes (storage_namespace_seed, sglang/srt/mem_cache/"
    "utils.py), which kvlife cannot tell apart"
)
"""Why the backend cannot carry a per-request tenant (SGLang as installed here)."""


def served_principal(store: Any) -> str:
    """The principal a served store's session is (its ``info``: a tenant's names it, an
    admin's lists every principal); "" for an embedded store or a server without
    principals."""
    if not hasattr(store, "server_info"):
        return ""
    info = store.server_info()
    if "principal" in info:
        return str(info["principal"].get("name", ""))
    if "principals" in info:
        return "(an admin)"
    return ""


def _torch_dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


class KVLifeHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """HiCache L3 storage on a kvlife store (embedded or served)."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.config = storage_config
        if storage_config.is_mla_model:
            raise UnsupportedModel("kvlife's SGLang backend stores MHA pages; MLA is not supported")
        model_dir = str(extra.get("kvlife.model_dir", "") or "")
        if model_dir:
            self.weights_digest = weights_digest_of_dir(Path(model_dir))
            self.tokenizer_digest = tokenizer_digest_of_dir(Path(model_dir), 0)
        else:
            self.weights_digest = str(extra.get("kvlife.weights_digest", "") or "")
            self.tokenizer_digest = str(extra.get("kvlife.tokenizer_digest", "") or "")
        if not self.weights_digest or not self.tokenizer_digest:
            raise InvalidArgument(
                "kvlife's SGLang backend needs kvlife.model_dir (weights and tokenizer are "
                "digested from its files) or both kvlife.weights_digest and "
                "kvlife.tokenizer_digest in the extra config: a model name is not trusted"
            )
        self.namespace = Namespace.parse(str(extra.get("kvlife.namespace", "public")))
        salt_kind = str(extra.get("kvlife.salt_kind", "organisation"))
        try:
            self.salt_kind = NamespaceKind(salt_kind)
        except ValueError as exc:
            raise InvalidArgument(
                f"kvlife.salt_kind {salt_kind!r} is not a namespace kind"
            ) from exc
        self._adapters: dict[tuple[str, str], AdapterSpec] = {}
        tenancy = str(extra.get("kvlife.tenancy", "") or "")
        if tenancy not in TENANCY_MODES:
            raise InvalidArgument(
                f"kvlife.tenancy {tenancy!r} is not one of {sorted(TENANCY_MODES)}"
            )
        if tenancy == "per_request":
            raise InvalidArgument(f"kvlife.tenancy per_request cannot be served: {NO_TENANT}")
        # without direct reads: each page loads into a buffer of its own that O_DIRECT
        # cannot fill (then copied into the host pool's layout), so a direct load would
        # only go through the server after a refused start, and every existence check's
        # lookup would name frames for nothing (docs/vllm.md, "SGLang")
        address = StoreAddress.from_extra_config(extra).without_direct_reads()
        self.lease: StoreLease = open_store(address)
        self.store = self.lease.store
        self.principal = served_principal(self.store)
        """The principal this engine is to a ``kvlife serve --tenants`` ("": none)."""
        if self.principal and tenancy != "engine":
            self.lease.release()
            raise InvalidArgument(
                f"the kvlife store has principals (kvlife serve --tenants) and this engine "
                f"is principal {self.principal!r}, but SGLang cannot carry a tenant per "
                f"request: {NO_TENANT}. Every request of this engine would share "
                f"{self.principal}'s namespace; set kvlife.tenancy to 'engine' to declare "
                "that the engine serves one tenant (run one engine per tenant)"
            )
        self.identity: ModelIdentity | None = None
        self.pool: Any = None
        self._page_shape: tuple[int, ...] = ()
        self._perm: tuple[int, ...] = ()
        self._np_dtype: np.dtype[Any] = np.dtype("float16")

    # ------------------------------------------------------------------ setup

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        pool = mem_pool_host
        layout_name = str(pool.layout)
        if layout_name not in _PAGE_LAYOUTS:
            raise UnsupportedModel(
                f"host pool layout {layout_name!r} is not one kvlife maps ({sorted(_PAGE_LAYOUTS)})"
            )
        dims, self._perm = _PAGE_LAYOUTS[layout_name]
        sizes = {
            "2": 2,
            "1": 1,
            "L": int(pool.layer_num),
            "T": int(pool.page_size),
            "H": int(pool.head_num),
            "D": int(pool.head_dim),
        }
        self._page_shape = tuple(sizes[d] for d in dims.split())
        dtype = _torch_dtype_name(pool.dtype)
        cfg = self.config
        lay = KVLayout(
            sizes["L"],
            sizes["H"],
            sizes["D"],
            dtype,
            sizes["T"],
            tp_rank=int(cfg.tp_rank),
            tp_size=int(cfg.tp_size),
            kv_head_start=int(cfg.tp_rank) * sizes["H"] if cfg.tp_size > 1 else 0,
        )
        numel = int(pool.get_dummy_flat_data_page().numel())
        if numel * lay.itemsize != lay.chunk_nbytes:
            raise UnsupportedModel(
                f"host pool pages hold {numel} elements; kvlife's layout {lay.chunk_shape} "
                f"holds {lay.chunk_nbytes // lay.itemsize}"
            )
        engine = blake3.blake3(
            msgpack.packb(
                [
                    "sglang-hicache",
                    type(pool).__name__,
                    str(getattr(pool, "storage_format_tag", "") or ""),
                    int(cfg.pp_rank),
                    int(cfg.pp_size),
                ]
            )
        ).hexdigest()
        self.identity = ModelIdentity(
            model_id=str(cfg.model_name or "sglang-model"),
            weights_digest=self.weights_digest,
            tokenizer_digest=self.tokenizer_digest,
            layout=lay,
            engine_digest=engine,
        )
        self._np_dtype = numpy_dtype(dtype)
        self.pool = pool

    def _ident(self) -> ModelIdentity:
        if self.identity is None:
            raise InvalidArgument("register_mem_pool_host must be called before I/O")
        return self.identity

    # ------------------------------------------------------------------ pages

    def _scope(self, extra_info: Any = None) -> tuple[ModelIdentity, Namespace]:
        """The identity and namespace of a call: the backend's, with the namespace and
        adapter SGLang passed in ``extra_info.extra_info`` if it passed any."""
        ident = self._ident()
        info = getattr(extra_info, "extra_info", None)
        if not isinstance(info, dict):
            return ident, self.namespace
        namespace = self.namespace
        if info.get("cache_salt"):
            namespace = Namespace(self.salt_kind, str(info["cache_salt"]))
        if info.get("kvlife.namespace"):
            namespace = Namespace.parse(str(info["kvlife.namespace"]))
        lora_id = str(info.get("lora_id") or "")
        if lora_id:
            ident = with_adapter(ident, self._adapter(lora_id, str(info.get("lora_path") or "")))
        return ident, namespace

    def _adapter(self, lora_id: str, lora_path: str) -> AdapterSpec:
        got = self._adapters.get((lora_id, lora_path))
        if got is None:
            root = Path(lora_path) if lora_path else None
            files = [p for p in root.iterdir() if p.is_file()] if root and root.is_dir() else []
            if lora_path and not files:
                raise UnsupportedModel(f"LoRA {lora_id!r}: {lora_path!r} is not a directory")
            digest = (
                files_digest(files)
                if files
                else blake3.blake3(f"sglang-lora-id:{lora_id}".encode()).hexdigest()
            )
            got = self._adapters[(lora_id, lora_path)] = AdapterSpec(f"sglang:{lora_id}", digest)
        return got

    def _ref(self, key: str) -> dict[str, Any]:
        ident = self._ident()
        tokens = [0] * ident.layout.tokens_per_chunk
        return {"tokens": tokens, "extra_keys": [PAGE_TAG, key.encode()]}

    def _lookup(self, key: str, scope: tuple[ModelIdentity, Namespace]) -> LookupResult:
        ref = self._ref(key)
        ident, namespace = scope
        return self.store.lookup(ident, namespace, ref["tokens"], extra_keys=ref["extra_keys"])

    def _canonical(self, flat: Any) -> np.ndarray:
        """A flat host page (torch) as a kvlife chunk array (a copy)."""
        page = flat.reshape(self._page_shape)
        if len(self._page_shape) == 6:
            page = page.squeeze(1)
        chunk = page.permute(*self._perm).contiguous().cpu()
        out = np.empty(self._ident().layout.chunk_shape, self._np_dtype)
        to_torch(out, self._ident().layout.dtype).copy_(chunk)
        return out

    def _into_flat(self, chunk: np.ndarray, flat: Any) -> None:
        """Write a kvlife chunk into a flat host page (torch) in the pool's order."""
        src = to_torch(chunk, self._ident().layout.dtype)
        inverse = tuple(int(i) for i in np.argsort(self._perm))
        page = src.permute(*inverse)
        if len(self._page_shape) == 6:
            page = page.unsqueeze(1)
        flat.view(self._page_shape).copy_(page)

    def _put(self, key: str, flat: Any, scope: tuple[ModelIdentity, Namespace]) -> bool:
        ref = self._ref(key)
        try:
            res = self.store.put_prompt(
                scope[0],
                scope[1],
                ref["tokens"],
                [self._canonical(flat)],
                extra_keys=ref["extra_keys"],
            )
        except KVLifeError as exc:
            log.warning("kvlife: page %s not stored: %s", key, exc)
            return False
        return bool(res.stored + res.already_present + res.in_flight == 1)

    def _get_into(self, key: str, flat: Any, scope: tuple[ModelIdentity, Namespace]) -> bool:
        try:
            hit = self._lookup(key, scope)
            if not hit.hits:
                return False
            buf = np.empty(self._ident().layout.chunk_shape, self._np_dtype)
            res = self.store.load(hit, [buf])
        except KVLifeError as exc:
            log.warning("kvlife: page %s not loaded: %s", key, exc)
            return False
        if res.loaded != 1:
            return False
        self._into_flat(buf, flat)
        return True

    # ------------------------------------------------------------------ HiCacheStorage

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any | None:
        flat = target_location
        if flat is None:
            flat = self.pool.get_dummy_flat_data_page()
        return flat if self._get_into(key, flat, self._scope()) else None

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[Any | None]:
        targets = target_locations or [None] * len(keys)
        out: list[Any | None] = []
        for key, target in zip(keys, targets, strict=True):
            got = self.get(key, target)
            out.append(got)
            if got is None:  # the controller stops at the first miss
                out += [None] * (len(keys) - len(out))
                break
        return out

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        if value is None:
            raise InvalidArgument(f"set({key!r}) without a value")
        return self._put(key, value, self._scope())

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        if values is None or len(values) != len(keys):
            raise InvalidArgument("batch_set needs one value per key")
        scope = self._scope()
        return all([self._put(k, v, scope) for k, v in zip(keys, values, strict=True)])

    def _exists(self, key: str, scope: tuple[ModelIdentity, Namespace]) -> bool:
        try:
            return bool(self._lookup(key, scope).hits)
        except KVLifeError:
            return False

    def exists(self, key: str) -> bool:
        return self._exists(key, self._scope())

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        scope = self._scope(extra_info)
        for i, key in enumerate(keys):
            if not self._exists(key, scope):
                return i
        return len(keys)

    def _page_index(self, host_indices: Any, i: int) -> int:
        return int(host_indices[i * self._ident().layout.tokens_per_chunk])

    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        scope = self._scope(extra_info)
        out: list[bool] = []
        for i, key in enumerate(keys):
            flat = self.pool.get_dummy_flat_data_page()
            ok = bool(out[-1]) if out else True
            ok = ok and self._get_into(key, flat, scope)
            if ok:
                self.pool.set_from_flat_data_page(self._page_index(host_indices, i), flat)
            out.append(ok)
        return out

    def batch_set_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        scope = self._scope(extra_info)
        return [
            self._put(key, self.pool.get_data_page(self._page_index(host_indices, i), True), scope)
            for i, key in enumerate(keys)
        ]

    def clear(self) -> None:
        """Drop every chunk of this model (weights digest) in this backend's namespace
        (chunks another engine stored for the same weights and namespace go too)."""
        self.store.invalidate(weights_digest=self.weights_digest, namespace=self.namespace)

    def get_stats(self) -> dict[str, int]:
        return dict(self.store.counters.as_dict())

    def close(self) -> None:
        self.lease.release()

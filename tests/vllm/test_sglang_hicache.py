"""kvlife's SGLang HiCache backend through SGLang's real ``HiCacheStorage`` class and its
real backend factory (``--hicache-storage-backend dynamic``), driven with the call
sequences of SGLang's cache controller (``_generic_page_set`` / ``_page_set_zero_copy``
for backups, ``batch_exists`` then ``_generic_page_get`` / ``_page_get_zero_copy`` for
prefetches). SGLang's server needs CUDA, so the host memory pool is a small stand-in
with the flat-page contract of ``MHATokenToKVPoolHost`` (same buffer shapes per layout).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvlife.faults.damage import flip, scan_frames
from kvlife.store import KVStore

hicache = pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
factory = pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory")

LAYERS, HEADS, DIM, PAGE = 3, 2, 16, 4


class HostPool:
    """The flat-page contract of SGLang's MHATokenToKVPoolHost (layer_first and
    page_first buffers as it allocates them)."""

    def __init__(self, layout: str, pages: int = 8, dtype: torch.dtype = torch.float16) -> None:
        self.layout, self.page_size, self.dtype = layout, PAGE, dtype
        self.layer_num, self.head_num, self.head_dim = LAYERS, HEADS, DIM
        self.size = pages * PAGE
        dims = (
            (2, LAYERS, self.size, HEADS, DIM)
            if layout == "layer_first"
            else (2, self.size, LAYERS, HEADS, DIM)
        )
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def _page(self, index: int) -> torch.Tensor:
        if self.layout == "layer_first":
            return self.kv_buffer[:, :, index : index + PAGE]
        return self.kv_buffer[:, index : index + PAGE]

    def first_pages(self, n: int) -> torch.Tensor:
        return (
            self._page(0)
            if n == 1
            else (
                self.kv_buffer[:, :, : n * PAGE]
                if self.layout == "layer_first"
                else self.kv_buffer[:, : n * PAGE]
            )
        )

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self._page(index)
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((2, LAYERS, PAGE, HEADS, DIM), dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self._page(index)[...] = data_page.reshape(self._page(index).shape)


def _config(extra: dict[str, Any], tp_rank: int = 0, tp_size: int = 1) -> Any:
    return hicache.HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name="tiny/model",
        extra_config=extra,
    )


def _extra(store: Path, **kw: Any) -> dict[str, Any]:
    return {
        "backend_name": "kvlife",
        "module_path": "kvlife.engines.sglang",
        "class_name": "KVLifeHiCacheStorage",
        "kvlife.path": str(store),
        "kvlife.weights_digest": "w-digest",
        "kvlife.tokenizer_digest": "t-digest",
        "kvlife.dram_mib": 8,
        "kvlife.disk_mib": 64,
    } | kw


def _backend(pool: HostPool, extra: dict[str, Any], **cfg: int) -> Any:
    backend = factory.StorageBackendFactory.create_backend("dynamic", _config(extra, **cfg), pool)
    backend.register_mem_pool_host(pool)  # as HiCacheController does after creating it
    return backend


def _fill(pool: HostPool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=gen).to(pool.dtype))


HASHES = [f"{i:064x}" for i in range(1, 5)]


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_backup_then_prefetch_round_trips_pages_generic_and_v1(tmp_path: Path, layout: str) -> None:
    pool = HostPool(layout)
    _fill(pool, 1)
    original = pool.first_pages(4).clone()
    backend = _backend(pool, _extra(tmp_path / "s"))
    assert isinstance(backend, hicache.HiCacheStorage)
    host_indices = torch.arange(0, 4 * PAGE)
    # backup, generic path: data pages taken from the host pool, then batch_set
    data = [pool.get_data_page(int(host_indices[i * PAGE])) for i in range(2)]
    assert backend.batch_set(HASHES[:2], data) is True
    # backup, zero-copy path for the next two pages
    assert all(backend.batch_set_v1(HASHES[2:], host_indices[2 * PAGE :]))
    # prefetch: hit query, then the generic get into dummy pages, then into the pool
    extra_info = hicache.HiCacheStorageExtraInfo(prefix_keys=[])
    assert backend.batch_exists([*HASHES, "f" * 64], extra_info) == 4
    pool.kv_buffer.zero_()
    pages = backend.batch_get(HASHES[:2], [pool.get_dummy_flat_data_page() for _ in range(2)])
    for i, page in enumerate(pages):
        assert page is not None
        pool.set_from_flat_data_page(int(host_indices[i * PAGE]), page)
    assert backend.batch_get_v1(HASHES[2:], host_indices[2 * PAGE :]) == [True, True]
    assert torch.equal(pool.first_pages(4), original)
    backend.close()


def test_pages_survive_a_restart_and_a_flipped_byte_is_a_miss(tmp_path: Path) -> None:
    store = tmp_path / "s"
    pool = HostPool("layer_first")
    _fill(pool, 2)
    host_indices = torch.arange(0, 4 * PAGE)
    backend = _backend(pool, _extra(store))
    assert all(backend.batch_set_v1(HASHES, host_indices))
    backend.close()  # flushed to the disk tier
    with KVStore.open(store, dram_bytes=0, disk_bytes=1 << 30) as s:
        keys = sorted(s.indexed_keys())
    assert len(keys) == 4
    frame = scan_frames(store)[2]
    flip(frame.segment, frame.payload_offset + 7, 1)
    original = pool.kv_buffer.clone()
    pool.kv_buffer.zero_()
    backend = _backend(pool, _extra(store))
    got = backend.batch_get_v1(HASHES, host_indices)
    bad = got.index(False)
    assert got == [True] * bad + [False] * (4 - bad)  # stops at the corrupt page
    for i in range(4):
        page = pool.kv_buffer[:, :, i * PAGE : (i + 1) * PAGE]
        want = original[:, :, i * PAGE : (i + 1) * PAGE] if i < bad else torch.zeros_like(page)
        assert torch.equal(page, want), f"page {i}: a miss must not write garbage"
    assert backend.get_stats()["corrupt"] == 1
    assert not backend.exists(HASHES[bad])  # invalidated, a future miss
    backend.close()


def test_other_shard_dtype_or_namespace_gets_no_hits(tmp_path: Path) -> None:
    store = tmp_path / "s"
    pool = HostPool("layer_first")
    _fill(pool, 3)
    backend = _backend(pool, _extra(store))
    assert all(backend.batch_set_v1(HASHES, torch.arange(0, 4 * PAGE)))
    backend.close()
    others = [
        (_backend(HostPool("layer_first"), _extra(store), tp_rank=1, tp_size=2), "tp shard"),
        (_backend(HostPool("layer_first", dtype=torch.bfloat16), _extra(store)), "dtype"),
        (_backend(HostPool("layer_first"), _extra(store, **{"kvlife.namespace": "user:b"})), "ns"),
        (_backend(HostPool("layer_first"), _extra(store, **{"kvlife.weights_digest": "w2"})), "w"),
    ]
    for other, what in others:
        assert other.batch_exists(HASHES) == 0, what
        other.close()
    # pages are stored in kvlife's canonical layout: a page_first host pool reuses them
    pf = HostPool("page_first")
    same = _backend(pf, _extra(store))
    assert same.batch_exists(HASHES) == 4
    assert all(same.batch_get_v1(HASHES, torch.arange(0, 4 * PAGE)))
    want = pool.kv_buffer[:, :, : 4 * PAGE].permute(0, 2, 1, 3, 4)
    assert torch.equal(pf.kv_buffer[:, : 4 * PAGE], want)
    same.close()


def test_a_name_alone_is_not_trusted(tmp_path: Path) -> None:
    extra = _extra(tmp_path / "s")
    del extra["kvlife.weights_digest"]
    with pytest.raises(Exception, match="model name is not trusted"):
        factory.StorageBackendFactory.create_backend(
            "dynamic", _config(extra), HostPool("layer_first")
        )


def test_the_namespace_and_adapter_sglang_passes_are_carried(tmp_path: Path) -> None:
    """Where SGLang hands the backend a per-call dict (HiCacheStorageExtraInfo.extra_info
    of batch_exists / batch_get_v1 / batch_set_v1), its cache_salt and LoRA become the
    page's kvlife namespace and adapter: another tenant or adapter gets no hit even for
    the same page hash, and kvlife can invalidate one tenant's or one adapter's pages."""
    from kvlife.core.identity import Namespace, NamespaceKind

    pool = HostPool("layer_first")
    _fill(pool, 4)
    original = pool.first_pages(4).clone()
    backend = _backend(pool, _extra(tmp_path / "s"))
    idx = torch.arange(0, 4 * PAGE)
    lora = tmp_path / "lora-sql"
    lora.mkdir()
    (lora / "adapter_model.safetensors").write_bytes(b"lora weights")

    def info(**kw: str) -> Any:
        return hicache.HiCacheStorageExtraInfo(prefix_keys=[], extra_info=kw)

    alice, bob = info(cache_salt="alice"), info(cache_salt="bob")
    sql = info(cache_salt="alice", lora_id="sql", lora_path=str(lora))
    assert all(backend.batch_set_v1(HASHES, idx, alice))
    assert all(backend.batch_set_v1(HASHES[:2], idx[: 2 * PAGE], sql))
    assert backend.batch_exists(HASHES, alice) == 4
    assert backend.batch_exists(HASHES, bob) == 0
    assert backend.batch_exists(HASHES) == 0  # no dict: the backend's own namespace
    assert backend.batch_exists(HASHES, info(cache_salt="alice", lora_id="sql")) == 0
    assert backend.batch_exists(HASHES, sql) == 2
    pool.kv_buffer.zero_()
    assert backend.batch_get_v1(HASHES, idx, bob) == [False] * 4
    assert torch.count_nonzero(pool.kv_buffer) == 0
    assert backend.batch_get_v1(HASHES, idx, alice) == [True] * 4
    assert torch.equal(pool.first_pages(4), original)
    # kvlife names them: one adapter's pages, then one tenant's
    assert backend.store.invalidate(adapter_id="sglang:sql") == 2
    assert backend.batch_exists(HASHES, sql) == 0
    assert backend.batch_exists(HASHES, alice) == 4
    assert backend.store.invalidate(namespace=Namespace(NamespaceKind.ORGANISATION, "alice")) == 4
    assert backend.batch_exists(HASHES, alice) == 0
    backend.close()


def test_a_multi_tenant_configuration_it_cannot_carry_is_refused(tmp_path: Path) -> None:
    """SGLang hands a backend no per-request tenant (kvlife.engines.sglang.NO_TENANT):
    against a ``kvlife serve --tenants`` the backend refuses to start unless its config
    declares the engine one tenant (``kvlife.tenancy = engine``), and ``per_request`` is
    refused outright; declared, the engine's pages are its principal's, and another
    principal finds none of them."""
    import os

    from kvlife.core.errors import InvalidArgument
    from kvlife.core.identity import Namespace, NamespaceKind
    from tests.server.tenants import as_, tenant_server, write_config

    # bob is this Unix user: the engine's connection (no token) is bob's
    srv = tenant_server(tmp_path / "store", write_config(tmp_path / "t.toml", bob_uid=os.geteuid()))
    srv.start()
    try:
        served = _extra(tmp_path / "unused", **{"kvlife.namespace": "user:bob"})
        del served["kvlife.path"]
        served["kvlife.socket"] = str(srv.socket)
        pool = HostPool("layer_first")
        _fill(pool, 5)
        original = pool.first_pages(4).clone()
        for tenancy in (None, "per_request", "nonsense"):
            extra = dict(served) if tenancy is None else served | {"kvlife.tenancy": tenancy}
            with pytest.raises(InvalidArgument) as err:
                factory.StorageBackendFactory.create_backend("dynamic", _config(extra), pool)
            if tenancy is not None and tenancy != "nonsense":
                assert "cache_controller.py" in str(err.value)
        backend = _backend(pool, served | {"kvlife.tenancy": "engine"})
        assert backend.principal == "bob"
        idx = torch.arange(0, 4 * PAGE)
        assert all(backend.batch_set_v1(HASHES, idx))
        assert backend.batch_exists(HASHES) == 4
        pool.kv_buffer.zero_()
        assert backend.batch_get_v1(HASHES, idx) == [True] * 4
        assert torch.equal(pool.first_pages(4), original)
        # a per-call namespace the principal may not use is a miss, never another's
        salted = hicache.HiCacheStorageExtraInfo(prefix_keys=[], extra_info={"cache_salt": "x"})
        assert backend.batch_exists(HASHES, salted) == 0
        backend.close()
        with as_(srv, "alice") as alice:
            ident = backend.identity
            assert ident is not None
            ns = Namespace(NamespaceKind.USER, "alice")
            hit = alice.lookup(
                ident, ns, [0] * PAGE, extra_keys=backend._ref(HASHES[0])["extra_keys"]
            )
            assert hit.hits == []
    finally:
        srv.stop()


def test_a_served_backend_asks_for_no_frames_even_with_direct_reads_on(tmp_path: Path) -> None:
    """With ``kvlife.socket`` and ``kvlife.direct_reads`` true the backend's store still
    reads no disk frame itself: each page loads into a buffer of its own that O_DIRECT
    cannot fill, so its lookups (every ``exists``) name no frames; the pages, put,
    flushed and evicted to the server's disk, come back exact through the server."""
    from kvlife.client.handles import RemoteLookup
    from tests.server.direct_rig import disk_server

    srv = disk_server(tmp_path / "store")
    try:
        served = _extra(tmp_path / "unused", **{"kvlife.direct_reads": True})
        del served["kvlife.path"]
        served["kvlife.socket"] = str(srv.socket)
        pool = HostPool("layer_first")
        _fill(pool, 11)
        original = pool.first_pages(4).clone()
        backend = _backend(pool, served)
        idx = torch.arange(0, 4 * PAGE)
        assert all(backend.batch_set_v1(HASHES, idx))
        backend.store.flush()
        backend.store.evict("dram", 1 << 40)
        lk = backend._lookup(HASHES[0], backend._scope())
        assert isinstance(lk, RemoteLookup) and lk.tiers() == {"disk": 1}
        assert lk.frames == ()
        assert backend.batch_exists(HASHES) == 4
        pool.kv_buffer.zero_()
        assert backend.batch_get_v1(HASHES, idx) == [True] * 4
        assert torch.equal(pool.first_pages(4), original)
        assert backend.store.counters.direct_loads == 0
        backend.close()
    finally:
        srv.stop()

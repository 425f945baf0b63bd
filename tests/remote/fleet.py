"""In-process hosts for the global-invalidation tests: each host is its own
:class:`KVStore` (chain ``[memory dram, (disk), SHARED shared]``) against one real
redis-server (the Redis tier) or one real Mooncake master with a Redis index (the
Mooncake tier, inside the private network namespace only)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest

from kvlife.core.identity import ModelIdentity, Namespace, NamespaceKind
from kvlife.globalindex import GlobalIndex
from kvlife.results import LoadResult, LookupResult
from kvlife.store import Accept, KVStore, TierSpec
from kvlife.tiers.mooncake.server import MooncakeMaster, in_private_netns
from kvlife.tiers.redis.published import PublishedTier
from tests.conftest import TINY, prompt_kv, tiny_identity

ACME = Namespace(NamespaceKind.ORGANISATION, "acme")
GLOBEX = Namespace(NamespaceKind.ORGANISATION, "globex")
KINDS = ["redis", "mooncake"]


def shared_kind(request: pytest.FixtureRequest) -> str:
    """The shared tier's kind of a test parametrized over :data:`KINDS` (Mooncake runs
    only inside the private network namespace: tests/remote/test_mooncake.py)."""
    kind = str(request.param)
    if kind == "mooncake" and not in_private_netns():
        pytest.skip("Mooncake runs inside a private network namespace (test_mooncake.py)")
    return kind


class Fleet:
    """Opens hosts sharing one index namespace on one Redis (and Mooncake master)."""

    def __init__(
        self,
        tmp: Path,
        kind: str,
        url: str,
        index_ns: str,
        master: MooncakeMaster | None = None,
    ) -> None:
        self.tmp = tmp
        self.kind = kind
        self.url = url
        self.index_ns = index_ns
        self.master = master
        self.open_stores: list[KVStore] = []

    def spec(self, name: str, **extra: object) -> TierSpec:
        transform = str(extra.pop("transform", ""))
        opts: dict[str, object] = {"index_namespace": self.index_ns, "host": name}
        if self.kind == "redis":
            if "cluster" not in extra:
                opts["url"] = extra.pop("url", self.url)
        else:
            assert self.master is not None
            opts.update(
                master=self.master.master,
                metadata=self.master.metadata,
                index=extra.pop("url", self.url),
                segment_bytes=32 << 20,
            )
        opts.update(extra)
        return TierSpec(
            self.kind, "shared", 64 << 20, options=tuple(opts.items()), transform=transform
        )

    def host(self, name: str, *, disk: bool = False, **extra: object) -> KVStore:
        chain = [TierSpec("memory", "dram", 8 << 20)]
        if disk:
            chain.append(TierSpec("disk", "disk", 32 << 20))
        chain.append(self.spec(name, **extra))
        store = KVStore.open(self.tmp / name, tiers=tuple(chain))
        self.open_stores.append(store)
        return store

    def close(self) -> None:
        for s in self.open_stores:
            with contextlib.suppress(Exception):  # a test may have cut the server
                s.close(flush=False)


def index_of(store: KVStore) -> GlobalIndex:
    shared = store.tier("shared")
    assert isinstance(shared, PublishedTier)
    return shared.index


def shared_of(store: KVStore) -> PublishedTier:
    shared = store.tier("shared")
    assert isinstance(shared, PublishedTier)
    return shared


def put(store: KVStore, seed: int, ns: Namespace = ACME, ident: ModelIdentity | None = None) -> int:
    tokens, kv = prompt_kv(seed, 64)
    return store.put_prompt(ident or tiny_identity(), ns, tokens, kv).stored


def look(
    store: KVStore, seed: int, ns: Namespace = ACME, accept: Accept = Accept.EXACT
) -> LookupResult:
    tokens, _ = prompt_kv(seed, 64)
    return store.lookup(tiny_identity(), ns, tokens, accept=accept)


def hits(store: KVStore, seed: int, ns: Namespace = ACME) -> int:
    return len(look(store, seed, ns).hits)


def expected(seed: int) -> list[np.ndarray]:
    _, kv = prompt_kv(seed, 64)
    n = TINY.tokens_per_chunk
    return [np.ascontiguousarray(kv[:, :, :, i * n : (i + 1) * n]) for i in range(4)]


def assert_exact(got: LoadResult, seed: int) -> None:
    """Every array served is the exact KV of its chunk (dtype, shape and bytes)."""
    want = expected(seed)
    for i, arr in enumerate(got.arrays):
        assert arr.dtype == np.float16 and arr.shape == TINY.chunk_shape, (arr.dtype, arr.shape)
        assert np.array_equal(arr, want[i]), f"chunk {i} is not the exact KV"


def served(store: KVStore, seed: int, ns: Namespace = ACME) -> int:
    """lookup + load; asserts every served byte is exact; returns chunks loaded."""
    got = store.load(look(store, seed, ns))
    assert_exact(got, seed)
    store.drain()
    return got.loaded

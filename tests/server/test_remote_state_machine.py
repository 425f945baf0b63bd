"""A RemoteStore against a live server and an embedded KVStore, driven by the same
random sequences of puts, two-phase puts (committed or aborted), lookups, loads and
invalidations: every answer must be the same, every served byte the prompt's own.

Each example uses a fresh namespace on one server for the whole module, and a fresh
embedded store as the model (capacities large enough that nothing is evicted, so the
two must agree exactly).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvlife.client import RemoteStore
from kvlife.core.identity import Namespace, NamespaceKind
from kvlife.store import KVStore
from tests.conftest import TINY, prompt_kv, tiny_identity
from tests.server.conftest import MiB, ServerProc

N = TINY.tokens_per_chunk
_examples = itertools.count()
_ctx: dict[str, Any] = {}


@pytest.fixture(scope="module", autouse=True)
def machine_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    base = tmp_path_factory.mktemp("sm")
    srv = ServerProc(base / "store", dram=32 * MiB, disk=64 * MiB).start()
    _ctx.update(server=srv, base=base)
    yield
    _ctx.clear()
    assert srv.stop() == 0


def _prompt(p: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompt p shares its first chunk with every prompt of the same parity."""
    tokens, kv = prompt_kv(500 + p, 3 * N)
    head_tokens, head_kv = prompt_kv(400 + p % 2, N)
    tokens[:N] = head_tokens
    kv[:, :, :, :N] = head_kv
    return tokens, kv


class RemoteMatchesEmbedded(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        n = next(_examples)
        self.ns = Namespace(NamespaceKind.USER, f"sm{n}")
        self.ident = tiny_identity()
        base: Path = _ctx["base"]
        self.model = KVStore.open(base / f"model{n}", dram_bytes=32 * MiB, disk_bytes=0)
        self.remote = RemoteStore(_ctx["server"].socket)
        self.pending: list[tuple[Any, Any]] = []
        self.saved: list[tuple[int, Any, Any]] = []
        """Lookups kept for a later load (their hints go stale as extents are reused)."""

    def teardown(self) -> None:
        for m, r in self.pending:
            self.model.abort_put(m)
            self.remote.abort_put(r)
        self.model.close(flush=False)
        self.remote.close()

    @rule(p=st.integers(0, 5))
    def put(self, p: int) -> None:
        tokens, kv = _prompt(p)
        a = self.model.put_prompt(self.ident, self.ns, tokens, kv)
        b = self.remote.put_prompt(self.ident, self.ns, tokens, kv)
        assert a == b

    @precondition(lambda self: len(self.pending) < 3)
    @rule(p=st.integers(0, 5))
    def prepare(self, p: int) -> None:
        tokens, kv = _prompt(p)
        self.pending.append(
            (
                self.model.prepare_put(self.ident, self.ns, tokens, kv),
                self.remote.prepare_put(self.ident, self.ns, tokens, kv),
            )
        )

    @precondition(lambda self: self.pending)
    @rule(commit=st.booleans(), data=st.data())
    def finish(self, commit: bool, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.pending) - 1))
        m, r = self.pending.pop(i)
        if commit:
            assert self.model.commit_put(m) == self.remote.commit_put(r)
        else:
            self.model.abort_put(m)
            self.remote.abort_put(r)

    @rule(p=st.integers(0, 5), into=st.booleans())
    def lookup_and_load(self, p: int, into: bool) -> None:
        tokens, kv = _prompt(p)
        a = self.model.lookup(self.ident, self.ns, tokens)
        b = self.remote.lookup(self.ident, self.ns, tokens)
        assert [h.key for h in a.hits] == [h.key for h in b.hits]
        assert (a.chunks_total, a.tokens) == (b.chunks_total, b.tokens)
        outs = [np.zeros(TINY.chunk_shape, np.float16) for _ in b.hits] if into else None
        la, lb = self.model.load(a), self.remote.load(b, outs)
        assert la.loaded == lb.loaded == len(b.hits)
        for i, arr in enumerate(lb.arrays):
            assert np.array_equal(arr, kv[:, :, :, i * N : (i + 1) * N])

    @precondition(lambda self: len(self.saved) < 4)
    @rule(p=st.integers(0, 5))
    def lookup_for_later(self, p: int) -> None:
        tokens, _ = _prompt(p)
        a = self.model.lookup(self.ident, self.ns, tokens)
        self.saved.append((p, a, self.remote.lookup(self.ident, self.ns, tokens)))

    @precondition(lambda self: self.saved)
    @rule(into=st.booleans(), data=st.data())
    def load_later(self, into: bool, data: st.DataObject) -> None:
        """A lookup loaded after puts and invalidations moved its chunks: the same
        chunks load as from the embedded store, each one the prompt's own bytes."""
        p, a, b = self.saved.pop(data.draw(st.integers(0, len(self.saved) - 1)))
        _, kv = _prompt(p)
        outs = [np.zeros(TINY.chunk_shape, np.float16) for _ in b.hits] if into else None
        la, lb = self.model.load(a), self.remote.load(b, outs)
        assert la.loaded == lb.loaded
        for i, arr in enumerate(lb.arrays):
            assert np.array_equal(arr, kv[:, :, :, i * N : (i + 1) * N])

    @rule(p=st.integers(0, 5), chunk=st.integers(0, 2))
    def invalidate_prefix(self, p: int, chunk: int) -> None:
        tokens, _ = _prompt(p)
        keys = self.model.lookup(self.ident, self.ns, tokens).hits
        if len(keys) > chunk:
            key = keys[chunk].key
            assert self.model.invalidate(prefix=key) == self.remote.invalidate(prefix=key)

    @rule()
    def invalidate_namespace(self) -> None:
        assert self.model.invalidate(namespace=self.ns) == self.remote.invalidate(namespace=self.ns)

    @invariant()
    def same_indexed_count(self) -> None:
        mine = sum(
            len(self.model.lookup(self.ident, self.ns, _prompt(p)[0]).hits) for p in range(6)
        )
        theirs = sum(
            len(self.remote.lookup(self.ident, self.ns, _prompt(p)[0]).hits) for p in range(6)
        )
        assert mine == theirs


TestRemoteMatchesEmbedded = RemoteMatchesEmbedded.TestCase
TestRemoteMatchesEmbedded.settings = settings(
    max_examples=25,
    stateful_step_count=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

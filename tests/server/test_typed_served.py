"""Typed replicas through ``kvlife serve``: the lookup's accept travels, each hit says what
it serves, and a lossy disk replica is never served to an exact lookup."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvlife.core.errors import InvalidArgument
from kvlife.core.identity import Namespace, NamespaceKind
from kvlife.store import Accept
from tests.conftest import TINY, prompt_kv, tiny_identity
from tests.server.conftest import MiB, ServerProc

NS = Namespace(NamespaceKind.ORGANISATION, "acme")


@pytest.fixture
def int8_server(tmp_path: Path) -> Iterator[ServerProc]:
    srv = ServerProc(tmp_path / "store", extra=("--disk-transform", "int8")).start()
    yield srv
    srv.stop()


def test_a_served_lossy_disk_replica_is_taken_only_by_a_lossy_accept(
    int8_server: ServerProc,
) -> None:
    tokens, kv = prompt_kv(3, 64)
    ident = tiny_identity()
    with int8_server.client() as store:
        assert store.put_prompt(ident, NS, tokens, kv).stored == 4
        hot = store.lookup(ident, NS, tokens)
        assert [h.transform for h in hot.hits] == ["exact"] * 4  # DRAM holds exact copies
        store.flush()
        store.evict("dram", 8 * MiB)  # only the int8 disk replicas remain
        exact = store.lookup(ident, NS, tokens)
        assert exact.hits == [] and "int8" in exact.refusal and exact.refused == 1
        lossy = store.lookup(ident, NS, tokens, accept=Accept.lossy(transforms=["int8"]))
        assert [(h.tier, h.transform, h.exactness) for h in lossy.hits] == [
            ("disk", "int8", "lossy")
        ] * 4
        assert all(h.decode_nbytes == TINY.chunk_nbytes for h in lossy.hits)
        got = store.load(lossy)
        assert got.loaded == 4
        n = TINY.tokens_per_chunk
        for i, arr in enumerate(got.arrays):
            want = kv[:, :, :, i * n : (i + 1) * n].astype(np.float32)
            err = np.abs(np.asarray(arr, np.float32) - want).max()
            assert 0 < err < 0.1
        with pytest.raises(InvalidArgument):
            store.lookup(ident, NS, tokens, accept="lossy")  # type: ignore[arg-type]

"""The adapter from a built prompt to the store's sources API, on a real KVStore: a new
version of a source misses the old chunks from its span on, ``supersede`` removes
exactly those, and a put of only the exact leading part (``upto``) stores the chunks
the whole prompt's lookup finds."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvlife.core.identity import PUBLIC
from kvlife.core.sources import Source
from kvlife.store import KVStore
from kvlife.upstream import sourced
from kvlife.upstream.builder import BuiltPrompt, PromptBuilder
from tests.conftest import TINY, tiny_identity

TPC = TINY.tokens_per_chunk  # 16


def _prompt(doc_version: int) -> BuiltPrompt:
    return (
        PromptBuilder()
        .system(list(range(1, 21)))  # 20 tokens: chunk 0 and part of chunk 1
        .document(Source("doc", doc_version), list(range(100, 130)))  # 20..50
        .query("q@0", list(range(200, 214)))  # 50..64
        .build()
    )


def _kv(n: int) -> np.ndarray:
    shape = (TINY.num_layers, 2, TINY.num_kv_heads, n, TINY.head_dim)
    return np.random.default_rng(n).standard_normal(shape).astype(np.float16)


def test_a_new_version_misses_from_its_span_on_and_supersede_drops_the_old(
    tmp_path: Path,
) -> None:
    ident = tiny_identity()
    with KVStore.open(tmp_path / "s", dram_bytes=1 << 20, disk_bytes=4 << 20) as store:
        old = _prompt(0)
        assert sourced.put(store, ident, PUBLIC, old, _kv(64)).stored == 4
        assert len(sourced.lookup(store, ident, PUBLIC, old).hits) == 4
        new = _prompt(1)
        # chunk 0 ends before doc's span starts: it is shared; chunk 1 on reads doc@1
        assert len(sourced.lookup(store, ident, PUBLIC, new).hits) == 1
        assert sourced.supersede(store, Source("doc", 1)) == 3
        assert len(sourced.lookup(store, ident, PUBLIC, old).hits) == 1
        assert sourced.supersede(store, Source("doc", 0)) == 0


def test_a_put_of_the_exact_part_is_found_by_the_whole_prompt(tmp_path: Path) -> None:
    ident = tiny_identity()
    with KVStore.open(tmp_path / "s", dram_bytes=1 << 20, disk_bytes=4 << 20) as store:
        p = _prompt(0)
        assert sourced.put(store, ident, PUBLIC, p, _kv(40), upto=40).stored == 2
        assert len(sourced.lookup(store, ident, PUBLIC, p).hits) == 2
        assert sourced.put(store, ident, PUBLIC, p, _kv(64)).stored == 2  # the other two
        assert len(sourced.lookup(store, ident, PUBLIC, p).hits) == 4

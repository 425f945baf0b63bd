"""Upstream sources (issue 26) on the embedded store: sources are part of a chunk's
identity, ``invalidate(source=...)`` removes exactly the chunks that depend on the source
(at the versions named) and every chunk chained after them, durably, and
``invalidate(model=..., keep_weights_digest=...)`` takes back every other weights
version's room on every tier with no stale hit in between. Real stores (DRAM + disk)
in a temporary directory; the state machine checks every lookup and load against a
model of which chunks must still be there."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvlife.core.errors import InvalidArgument
from kvlife.core.identity import (
    PUBLIC,
    ROOT_PARENT,
    ChunkKey,
    KVLayout,
    ModelIdentity,
    chunk_key,
    prompt_chunk_keys,
)
from kvlife.core.objects import ObjectInfo
from kvlife.core.sources import Source, SourceSpan, chunk_sources, dependent
from kvlife.store import KVStore

N = 4
LAYOUT = KVLayout(1, 1, 4, "float16", N)
IDENT = ModelIdentity("m", "w1", "tok", LAYOUT)
NAMES = ["sys", "doc:a", "doc:b", "tool"]


def _kv(tokens: int, fill: float) -> np.ndarray:
    arr = np.empty((1, 2, 1, tokens, 4), np.float16)
    for t in range(tokens):
        arr[:, :, :, t, :] = fill + t
    return arr


def _open(path: Path) -> KVStore:
    return KVStore.open(path, dram_bytes=1 << 20, disk_bytes=64 << 20)


# ---------------------------------------------------------------------- identity


def test_a_chunk_depends_on_every_span_that_starts_before_its_end() -> None:
    spans = [
        SourceSpan(Source("sys"), 0, 3),
        SourceSpan(Source("doc", 2), 3, 9),
        SourceSpan(Source("user", 1), 9, 12),
    ]
    assert dependent(spans, 3) == (Source("sys"),)
    assert dependent(spans, 4) == (Source("doc", 2), Source("sys"))
    per = chunk_sources(spans, 0, 3, 4)
    assert per == [dependent(spans, 4), dependent(spans, 8), dependent(spans, 12)]
    assert per[2] == (Source("doc", 2), Source("sys"), Source("user", 1))


def test_keys_without_sources_are_those_of_format_v1_and_a_new_version_changes_them() -> None:
    tokens = list(range(12))
    plain = prompt_chunk_keys(IDENT, PUBLIC, tokens)
    assert plain == prompt_chunk_keys(IDENT, PUBLIC, tokens, sources=())
    v1 = [SourceSpan(Source("sys"), 0, 4), SourceSpan(Source("doc", 1), 4, 12)]
    v2 = [SourceSpan(Source("sys"), 0, 4), SourceSpan(Source("doc", 2), 4, 12)]
    k1 = prompt_chunk_keys(IDENT, PUBLIC, tokens, sources=v1)
    k2 = prompt_chunk_keys(IDENT, PUBLIC, tokens, sources=v2)
    # chunk 0 depends on sys only in both versions: one key; every other chunk differs
    assert k1[0] == k2[0]
    assert len(set(plain) | set(k1) | set(k2)) == 8
    # one chunk's key alone, from its dependent sources, is the same
    again = chunk_key(
        IDENT.digest, PUBLIC.salt, ROOT_PARENT, 0, tokens[:4], sources=[Source("sys")]
    )
    assert again == k1[0]
    # an extra key spelling the sources section is not the section
    from kvlife.core.sources import SOURCES_TAG, sources_digest

    forged = chunk_key(
        IDENT.digest,
        PUBLIC.salt,
        ROOT_PARENT,
        0,
        tokens[:4],
        extra_keys=[SOURCES_TAG + sources_digest([Source("sys")])],
    )
    assert forged != k1[0]


def test_object_info_keeps_its_sources_and_refuses_damaged_ones() -> None:
    info = ObjectInfo.for_chunk(IDENT, PUBLIC, ChunkKey(ROOT_PARENT), 0, (Source("a", 3),))
    assert ObjectInfo.decode(info.encode()) == info
    plain = ObjectInfo.for_chunk(IDENT, PUBLIC, ChunkKey(ROOT_PARENT), 0)
    assert len(plain.encode()) < len(info.encode())
    assert ObjectInfo.decode(plain.encode()) == plain
    import msgpack

    bad = msgpack.unpackb(info.encode())
    bad[9] = [["b", 1], ["a", 1]]  # not sorted
    with pytest.raises(InvalidArgument):
        ObjectInfo.decode(msgpack.packb(bad))


@pytest.mark.parametrize(
    "sources",
    ["doc@1", [("doc", 1, 0, 4)], [SourceSpan(Source("d"), 0, 4), "x"], b"xx"],
)
def test_bad_sources_are_refused_before_anything_is_written(
    tmp_path: Path, sources: object
) -> None:
    with _open(tmp_path / "s") as store:
        with pytest.raises(InvalidArgument, match="sources"):
            store.put_prompt(IDENT, PUBLIC, list(range(8)), _kv(8, 0), sources=sources)  # type: ignore[arg-type]
        assert store.indexed_keys() == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"source": Source("d", 2), "before_version": 3}, "names one version"),
        ({"before_version": 3}, "needs a source"),
        ({"source": "d", "before_version": 0}, "before_version"),
        ({"source": "a@b"}, "'@'"),
        ({"source": 7}, "Source or a name"),
        ({"keep_weights_digest": "w2"}, "needs a model"),
        ({"model": ""}, "model"),
    ],
)
def test_bad_invalidation_arguments_are_typed(
    tmp_path: Path, kwargs: dict[str, object], match: str
) -> None:
    with _open(tmp_path / "s") as store, pytest.raises(InvalidArgument, match=match):
        store.invalidate(**kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- the model


@st.composite
def prompts(draw: st.DrawFn) -> tuple[list[int], list[SourceSpan]]:
    """A prompt of 1..4 segments, each a source at a version, 1..9 tokens: the tokens
    are a function of the source and its version, so two versions differ in tokens as
    they would (and a repeated source repeats them)."""
    tokens: list[int] = []
    spans: list[SourceSpan] = []
    for _ in range(draw(st.integers(1, 4))):
        src = Source(draw(st.sampled_from(NAMES)), draw(st.integers(0, 2)))
        length = draw(st.integers(1, 9))
        base = 100 * NAMES.index(src.name) + 10 * src.version
        spans.append(SourceSpan(src, len(tokens), len(tokens) + length))
        tokens += [base + i for i in range(length)]
    return tokens, spans


class SourcesMachine(RuleBasedStateMachine):
    """Puts of prompts built of spans (and continuations of them declared without their
    spans), invalidations by source, reopens; the model knows each stored chunk's key,
    its sources, its parent and its bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.path: Path = Path()
        self.store: KVStore | None = None
        self.chunks: dict[bytes, tuple[tuple[Source, ...], bytes, np.ndarray]] = {}
        """key -> (its sources, its parent key, its KV)."""
        self.prompts: list[tuple[list[int], list[SourceSpan], bytes, int]] = []
        """(tokens, spans, parent, start) of every put so far (looked up again)."""
        self.fills = 0

    @initialize()
    def open_store(self) -> None:
        self.path = Path(TMP.mkdtemp()) / "store"
        self.store = _open(self.path)

    def _put(self, tokens: list[int], spans: list[SourceSpan], parent: bytes, start: int) -> None:
        assert self.store is not None
        self.fills += 1
        kv = _kv(len(tokens), float(self.fills % 50))
        res = self.store.put_prompt(
            IDENT, PUBLIC, tokens, kv, start=start, parent=ChunkKey(parent), sources=spans
        )
        deps = chunk_sources(spans, start, len(res.keys), N)
        prev = parent
        for i, key in enumerate(res.keys):
            if key not in self.chunks:
                self.chunks[key] = (deps[i], prev, kv[:, :, :, i * N : (i + 1) * N, :].copy())
            prev = key
        self.prompts.append((tokens, spans, parent, start))

    @rule(p=prompts())
    def put(self, p: tuple[list[int], list[SourceSpan]]) -> None:
        self._put(p[0], p[1], bytes(ROOT_PARENT), 0)

    @precondition(lambda self: any(len(t) >= N for t, _, par, _s in self.prompts))
    @rule(data=st.data(), extra=st.integers(N, 3 * N))
    def continue_without_spans(self, data: st.DataObject, extra: int) -> None:
        """A continuation chained after a stored prompt, declared without its spans: its
        chunks depend on no source by their own record, only by their chain."""
        full = [p for p in self.prompts if len(p[0]) >= N and p[2] == bytes(ROOT_PARENT)]
        if not full:
            return
        tokens, spans, _, _ = data.draw(st.sampled_from(full))
        keys = prompt_chunk_keys(IDENT, PUBLIC, tokens, sources=spans)
        whole = len(keys) * N
        more = [900 + (self.fills + i) % 50 for i in range(extra)]
        self._put(more, [], bytes(keys[-1]), whole)

    @rule(
        name=st.sampled_from(NAMES),
        how=st.sampled_from(["all", "before", "exact"]),
        version=st.integers(0, 3),
    )
    def invalidate(self, name: str, how: str, version: int) -> None:
        assert self.store is not None
        bound = max(1, version)

        def hit(s: Source) -> bool:
            if how == "all":
                return s.name == name
            if how == "before":
                return s.name == name and s.version < bound
            return s == Source(name, version)

        if how == "all":
            got = self.store.invalidate(source=name)
        elif how == "before":
            got = self.store.invalidate(source=name, before_version=bound)
        else:
            got = self.store.invalidate(source=Source(name, version))
        doomed = {k for k, (deps, _, _) in self.chunks.items() if any(hit(s) for s in deps)}
        changed = True
        while changed:  # and every chunk chained after them
            changed = False
            for k, (_, parent, _) in self.chunks.items():
                if k not in doomed and parent in doomed:
                    doomed.add(k)
                    changed = True
        assert got == len(doomed)
        for k in doomed:
            del self.chunks[k]

    @rule()
    def reopen(self) -> None:
        assert self.store is not None
        self.store.close()
        self.store = _open(self.path)

    @invariant()
    def exactly_the_model_is_served(self) -> None:
        if self.store is None:
            return
        assert set(self.store.indexed_keys()) == set(self.chunks)
        for tokens, spans, parent, start in self.prompts[-3:]:
            res = self.store.lookup(
                IDENT, PUBLIC, tokens, start=start, parent=ChunkKey(parent), sources=spans
            )
            keys = prompt_chunk_keys(
                IDENT, PUBLIC, tokens, start=start, parent=parent, sources=spans
            )
            want = 0
            while want < len(keys) and keys[want] in self.chunks:
                want += 1
            assert len(res.hits) == want
            loaded = self.store.load(res)
            assert loaded.loaded == want
            for key, arr in zip(keys, loaded.arrays, strict=False):
                np.testing.assert_array_equal(arr, self.chunks[key][2])

    def teardown(self) -> None:
        if self.store is not None:
            self.store.close()


class _Tmp:
    """Temporary directories for the machine's stores (pytest's tmp_path is per test)."""

    def __init__(self) -> None:
        self.root: Path | None = None
        self.n = 0

    def mkdtemp(self) -> Path:
        assert self.root is not None
        self.n += 1
        out = self.root / f"run{self.n}"
        out.mkdir()
        return out


TMP = _Tmp()
SourcesMachine.TestCase.settings = settings(
    max_examples=25,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_invalidation_by_source_removes_exactly_the_dependent_chunks(tmp_path: Path) -> None:
    TMP.root = tmp_path
    SourcesMachine.TestCase().runTest()


# ---------------------------------------------------------------------- durability, races


def test_invalidation_by_source_survives_a_reopen(tmp_path: Path) -> None:
    tokens = list(range(16))
    spans = [SourceSpan(Source("sys"), 0, 4), SourceSpan(Source("doc", 1), 4, 16)]
    with _open(tmp_path / "s") as store:
        store.put_prompt(IDENT, PUBLIC, tokens, _kv(16, 1), sources=spans)
    with _open(tmp_path / "s") as store:  # recovered from the disk tier's catalog
        assert len(store.lookup(IDENT, PUBLIC, tokens, sources=spans).hits) == 4
        assert store.invalidate(source="doc", before_version=2) == 3
    with _open(tmp_path / "s") as store:
        assert len(store.lookup(IDENT, PUBLIC, tokens, sources=spans).hits) == 1
        assert store.invalidate(source="doc") == 0


def test_a_source_invalidation_reaches_puts_in_flight(tmp_path: Path) -> None:
    """A put prepared before the invalidation returned stores nothing that depends on
    the source, whether it commits before or after; one prepared after is stored."""
    tokens = list(range(12))
    spans = [SourceSpan(Source("sys"), 0, 4), SourceSpan(Source("doc", 1), 4, 12)]
    other = [SourceSpan(Source("sys"), 0, 4), SourceSpan(Source("doc:b"), 4, 12)]
    with _open(tmp_path / "s") as store:
        pending = store.prepare_put(IDENT, PUBLIC, tokens, _kv(12, 1), sources=spans)
        keep = store.prepare_put(IDENT, PUBLIC, tokens, _kv(12, 2), sources=other)
        assert store.invalidate(source="doc") == 2  # its TENTATIVE chunks 1 and 2
        res = store.commit_put(pending)
        assert res.stored == 1  # chunk 0 (sys only)
        assert store.commit_put(keep).stored == 2  # chunk 0 is shared with the first
        assert len(store.lookup(IDENT, PUBLIC, tokens, sources=spans).hits) == 1
        assert len(store.lookup(IDENT, PUBLIC, tokens, sources=other).hits) == 3
        store.put_prompt(IDENT, PUBLIC, tokens, _kv(12, 1), sources=spans)
        assert len(store.lookup(IDENT, PUBLIC, tokens, sources=spans).hits) == 3


def test_source_invalidations_racing_puts_never_leave_a_dependent_chunk(tmp_path: Path) -> None:
    """Threads put prompts of doc@v while another invalidates doc before v+1 over and
    over: after each invalidation returns no chunk of a put prepared before it is
    stored (checked once the writers stop: whatever is indexed was prepared after the
    last invalidation began)."""
    with _open(tmp_path / "s") as store:
        stop = threading.Event()
        errors: list[BaseException] = []
        prepared_after: list[set[bytes]] = []
        gate = threading.Lock()
        generation = [0]

        def writer(seed: int) -> None:
            rng = np.random.default_rng(seed)
            mine: set[bytes] = set()
            try:
                while not stop.is_set():
                    n = int(rng.integers(2, 5)) * N
                    tokens = [int(t) for t in rng.integers(0, 1000, n)]
                    spans = [SourceSpan(Source("doc", 0), 0, n)]
                    with gate:
                        gen = generation[0]
                    pending = store.prepare_put(IDENT, PUBLIC, tokens, _kv(n, 1), sources=spans)
                    res = store.commit_put(pending)
                    with gate:
                        if generation[0] == gen:
                            mine.update(bytes(k) for k in res.keys)
            except BaseException as exc:
                errors.append(exc)
            prepared_after.append(mine)

        threads = [threading.Thread(target=writer, args=(s,)) for s in range(2)]
        for t in threads:
            t.start()
        for _ in range(15):
            with gate:
                generation[0] += 1
            store.invalidate(source="doc")
        stop.set()
        for t in threads:
            t.join(timeout=60)
        assert not errors
        with gate:
            generation[0] += 1
        store.invalidate(source="doc")
        assert store.indexed_keys() == []  # the last one took everything that depended


# ---------------------------------------------------------------------- weights versions


def _room(store: KVStore) -> dict[str, int]:
    """Bytes each tier holds for live replicas (the disk's live frames: a segment's file
    bytes come back when compaction or the seal of an emptied segment reclaims it)."""
    out = {t.name: t.used_bytes for t in store.info().tiers}
    live = store.tier("disk").details()["live_bytes"]
    assert isinstance(live, int)
    out["disk"] = live
    return out


def test_every_weights_version_but_the_current_one_is_freed_on_every_tier(
    tmp_path: Path,
) -> None:
    old = [ModelIdentity("m", f"w{v}", "tok", LAYOUT) for v in (1, 2)]
    cur = ModelIdentity("m", "w3", "tok", LAYOUT)
    other = ModelIdentity("other-model", "w1", "tok", LAYOUT)
    tokens = list(range(16))
    with _open(tmp_path / "s") as store:
        for ident in [*old, cur, other]:
            store.put_prompt(ident, PUBLIC, tokens, _kv(16, 3))
        store.flush()  # every chunk in DRAM and on disk
        used = _room(store)
        assert store.invalidate(model="m", keep_weights_digest="w3") == 8
        for ident in old:
            assert store.lookup(ident, PUBLIC, tokens).hits == []
        for ident in (cur, other):
            assert len(store.lookup(ident, PUBLIC, tokens).hits) == 4
        after = _room(store)
        for tier in ("dram", "disk"):
            freed = store.counters.tier(tier).invalidated_bytes
            assert freed == 8 * LAYOUT.chunk_nbytes, tier
            assert used[tier] - after[tier] >= freed, tier
        assert store.invalidate(model="m", keep_weights_digest="w3") == 0
    with _open(tmp_path / "s") as store:
        for ident in old:
            assert store.lookup(ident, PUBLIC, tokens).hits == []
        assert len(store.lookup(cur, PUBLIC, tokens).hits) == 4

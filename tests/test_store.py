"""KVStore behaviour: put/lookup/load, tiers, invalidation, bad input, threads, reopen."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvlife.core.errors import (
    InvalidArgument,
    LayoutMismatch,
    PartialChunkError,
    ReplicaNotFound,
    StoreClosedError,
)
from kvlife.core.events import MemorySink
from kvlife.core.identity import PUBLIC, ModelIdentity, Namespace, NamespaceKind
from kvlife.core.lifecycle import Move, ObjectState, check_move
from kvlife.store import KVStore
from kvlife.tiers.disk.frame import frame_len
from tests.conftest import TINY, prompt_kv, tiny_identity

CHUNK = TINY.chunk_nbytes
N = TINY.tokens_per_chunk
ALICE = Namespace(NamespaceKind.USER, "alice")


def chunk(kv: np.ndarray, i: int) -> np.ndarray:
    return kv[:, :, :, i * N : (i + 1) * N, :]


def assert_prefix_equal(arrays: list[np.ndarray], kv: np.ndarray) -> None:
    for i, a in enumerate(arrays):
        assert np.array_equal(a, chunk(kv, i)), f"chunk {i} differs"


def open_store(path: Path, **kw: object) -> KVStore:
    kw.setdefault("dram_bytes", 64 * CHUNK)
    kw.setdefault("disk_bytes", 1 << 26)
    kw.setdefault("segment_bytes", 1 << 20)
    return KVStore.open(path, **kw)  # type: ignore[arg-type]


def test_round_trip_and_partial_last_chunk(tmp_path: Path, identity: ModelIdentity) -> None:
    tokens, kv = prompt_kv(1, 5 * N + 7)
    with open_store(tmp_path) as store:
        res = store.put_prompt(identity, PUBLIC, tokens, kv)
        assert (res.chunks, res.stored, res.dropped) == (5, 5, 0)
        assert res.tokens_stored_or_present == 5 * N
        hit = store.lookup(identity, PUBLIC, tokens)
        assert hit.tokens == 5 * N and hit.tiers() == {"dram": 5}
        loaded = store.load(hit)
        assert loaded.complete and loaded.loaded == 5
        assert_prefix_equal(loaded.arrays, kv)
        # the same prompt again: nothing rewritten
        again = store.put_prompt(identity, PUBLIC, tokens, kv)
        assert (again.stored, again.already_present) == (0, 5)
        # a longer prompt sharing the prefix reuses it
        tokens2 = np.concatenate([tokens[: 3 * N], tokens[: 2 * N] + 1])
        assert store.lookup(identity, PUBLIC, tokens2).tokens == 3 * N


def test_identity_and_namespace_isolation(tmp_path: Path, identity: ModelIdentity) -> None:
    tokens, kv = prompt_kv(2, 4 * N)
    with open_store(tmp_path) as store:
        store.put_prompt(identity, ALICE, tokens, kv)
        assert store.lookup(identity, ALICE, tokens).tokens == 4 * N
        assert store.lookup(identity, PUBLIC, tokens).tokens == 0
        assert store.lookup(identity, Namespace(NamespaceKind.USER, "bob"), tokens).tokens == 0
        for other in (
            tiny_identity(weights_digest="w1"),
            tiny_identity(tokenizer_digest="t1"),
            tiny_identity(adapter_id="lora", adapter_digest="x"),
            tiny_identity(position_encoding_digest="rope2"),
        ):
            assert store.lookup(other, ALICE, tokens).tokens == 0
        assert store.lookup(identity, ALICE, tokens, start=N).tokens == 0


def test_demotion_promotion_and_reopen(tmp_path: Path, identity: ModelIdentity) -> None:
    sink = MemorySink()
    prompts = [prompt_kv(10 + i, 4 * N) for i in range(6)]
    with open_store(tmp_path, dram_bytes=6 * CHUNK, sink=sink) as store:
        for tokens, kv in prompts:
            store.put_prompt(identity, PUBLIC, tokens, kv)
        assert store.counters.demotions >= 18
        tokens, kv = prompts[0]
        hit = store.lookup(identity, PUBLIC, tokens)
        assert hit.tiers() == {"disk": 4}
        loaded = store.load(hit)
        assert loaded.tiers == {"disk": 4}
        assert_prefix_equal(loaded.arrays, kv)
        store.drain()  # promotion runs in the background, off the load path
        assert store.counters.promotions == 4
        assert store.lookup(identity, PUBLIC, tokens).tiers() == {"dram": 4}
    kinds = {e.kind for e in sink.take()}
    assert {"put", "write", "seal", "commit", "index", "offload", "evict", "load"} <= kinds
    with open_store(tmp_path, dram_bytes=6 * CHUNK) as store:
        assert store.counters.recovered == 24
        for tokens, kv in prompts:
            loaded = store.get(identity, PUBLIC, tokens)
            assert loaded.loaded == 4
            assert_prefix_equal(loaded.arrays, kv)
        info = store.info()
        assert info.objects_by_state["indexed"] == 24
        assert info.lifetime_counters["puts"] == 6 + 0


def test_close_without_flush_loses_only_dram_only_objects(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    tokens, kv = prompt_kv(3, 3 * N)
    store = open_store(tmp_path)
    store.put_prompt(identity, PUBLIC, tokens, kv)
    store.close(flush=False)
    with open_store(tmp_path) as store:
        assert store.lookup(identity, PUBLIC, tokens).tokens == 0
    with open_store(tmp_path, write_through=True) as store:
        store.put_prompt(identity, PUBLIC, tokens, kv)
    with open_store(tmp_path) as store:
        assert store.lookup(identity, PUBLIC, tokens).tiers() == {"disk": 3}


def test_invalidate_by_each_criterion(tmp_path: Path) -> None:
    a = tiny_identity()
    b = tiny_identity(weights_digest="w1")
    lora = tiny_identity(adapter_id="lora", adapter_digest="d")
    t1, kv1 = prompt_kv(4, 3 * N)
    with open_store(tmp_path, dram_bytes=4 * CHUNK) as store:
        store.put_prompt(a, PUBLIC, t1, kv1)
        store.put_prompt(b, PUBLIC, t1, kv1)
        store.put_prompt(lora, ALICE, t1, kv1)
        store.put_prompt(a, ALICE, t1, kv1)
        assert store.invalidate(weights_digest="w1") == 3
        assert store.lookup(b, PUBLIC, t1).tokens == 0
        assert store.lookup(a, PUBLIC, t1).tokens == 3 * N
        assert store.invalidate(adapter_id="lora") == 3
        assert store.lookup(lora, ALICE, t1).tokens == 0
        assert store.invalidate(namespace=ALICE) == 3
        assert store.lookup(a, ALICE, t1).tokens == 0
        keys = store.lookup(a, PUBLIC, t1).hits
        assert store.invalidate(prefix=keys[1].key) == 2
        assert store.lookup(a, PUBLIC, t1).tokens == N
        assert store.invalidate(weights_digest="w0", namespace=ALICE) == 0
        with pytest.raises(InvalidArgument, match="criterion"):
            store.invalidate()
    with open_store(tmp_path) as store:  # invalidation is durable
        assert store.lookup(b, PUBLIC, t1).tokens == 0
        assert store.lookup(a, PUBLIC, t1).tokens == N


def test_bad_kv_is_rejected_before_anything_is_written(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    tokens, kv = prompt_kv(5, 3 * N)
    with open_store(tmp_path) as store:
        with pytest.raises(LayoutMismatch, match="dtype"):
            store.put_prompt(identity, PUBLIC, tokens, kv.astype(np.float32))
        with pytest.raises(LayoutMismatch, match="shape"):
            store.put_prompt(identity, PUBLIC, tokens, kv[:, :, :1])
        with pytest.raises(LayoutMismatch, match="covers"):
            store.put_prompt(identity, PUBLIC, tokens, kv[:, :, :, : 2 * N])
        chunks = [chunk(kv, 0), chunk(kv, 1), kv[:, :, :, 2 * N : 2 * N + 5]]
        with pytest.raises(PartialChunkError, match="chunk 2 holds 5 tokens"):
            store.put_prompt(identity, PUBLIC, tokens, chunks)
        with pytest.raises(LayoutMismatch, match="numpy array or a torch tensor"):
            store.put_prompt(identity, PUBLIC, tokens, "not kv")
        assert store.lookup(identity, PUBLIC, tokens).tokens == 0
        assert store.counters.chunks_stored == 0
        res = store.put_prompt(identity, PUBLIC, tokens, [chunk(kv, i) for i in range(3)])
        assert res.stored == 3
    with pytest.raises(StoreClosedError):
        store.lookup(identity, PUBLIC, tokens)


def test_prepare_commit_abort(tmp_path: Path, identity: ModelIdentity) -> None:
    tokens, kv = prompt_kv(6, 2 * N)
    sink = MemorySink()
    with open_store(tmp_path, sink=sink) as store:
        pending = store.prepare_put(identity, PUBLIC, tokens, kv)
        assert store.lookup(identity, PUBLIC, tokens).tokens == 0
        assert store.info().objects_by_state["tentative"] == 2
        store.abort_put(pending)
        with pytest.raises(InvalidArgument):
            store.commit_put(pending)
        assert store.lookup(identity, PUBLIC, tokens).tokens == 0
        p1 = store.prepare_put(identity, PUBLIC, tokens, kv)
        p2 = store.prepare_put(identity, PUBLIC, tokens, kv)
        assert store.commit_put(p1).stored == 2
        r2 = store.commit_put(p2)
        assert (r2.stored, r2.already_present, r2.in_flight) == (0, 0, 2)
        p3 = store.prepare_put(identity, PUBLIC, tokens, kv)
        assert store.commit_put(p3).already_present == 2
        assert store.info().objects_by_state == {
            "tentative": 0,
            "committed": 0,
            "indexed": 2,
            "invalidated": 0,
            "deleted": 0,
        }
    aborted = [e for e in sink.take() if e.kind == "abort"]
    assert len(aborted) == 2 and {e.reason for e in aborted} == {"aborted by caller"}


def test_store_larger_than_dram_goes_to_disk_chunk_by_chunk(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    tokens, kv = prompt_kv(7, 10 * N)
    with open_store(tmp_path, dram_bytes=3 * CHUNK) as store:
        res = store.put_prompt(identity, PUBLIC, tokens, kv)
        assert res.stored == 10
        loaded = store.get(identity, PUBLIC, tokens)
        assert loaded.loaded == 10
        assert_prefix_equal(loaded.arrays, kv)
    with open_store(tmp_path / "small", dram_bytes=0, disk_bytes=4 * frame_len(CHUNK)) as store:
        res = store.put_prompt(identity, PUBLIC, tokens, kv)
        assert res.stored + res.dropped == 10 and res.dropped > 0


def test_threads_share_a_store(tmp_path: Path, identity: ModelIdentity) -> None:
    prompts = [prompt_kv(100 + i, 3 * N) for i in range(24)]
    errors: list[BaseException] = []
    with open_store(tmp_path, dram_bytes=10 * CHUNK) as store:

        def work(offset: int) -> None:
            try:
                for j in range(offset, len(prompts), 4):
                    tokens, kv = prompts[j]
                    store.put_prompt(identity, PUBLIC, tokens, kv)
                    for k in range(0, j + 1, 3):
                        t2, kv2 = prompts[k]
                        loaded = store.get(identity, PUBLIC, t2)
                        assert_prefix_equal(loaded.arrays, kv2)
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for tokens, kv in prompts:
            loaded = store.get(identity, PUBLIC, tokens)
            assert loaded.loaded == 3
            assert_prefix_equal(loaded.arrays, kv)


def test_corrupt_disk_chunk_becomes_a_counted_miss(tmp_path: Path, identity: ModelIdentity) -> None:
    tokens, kv = prompt_kv(8, 4 * N)
    sink = MemorySink()
    with open_store(tmp_path, dram_bytes=0, sink=sink) as store:
        store.put_prompt(identity, PUBLIC, tokens, kv)
    seg = next((tmp_path / "disk" / "segments").glob("seg-*.kvs"))
    frame = frame_len(CHUNK)
    with seg.open("r+b") as fh:  # flip a byte in chunk 2's payload
        fh.seek(2 * frame + 4096 + 17)
        b = fh.read(1)
        fh.seek(2 * frame + 4096 + 17)
        fh.write(bytes([b[0] ^ 1]))
    with open_store(tmp_path, dram_bytes=0, sink=sink) as store:
        hit = store.lookup(identity, PUBLIC, tokens)
        assert hit.tokens == 4 * N
        out = store.load(hit)
        assert out.loaded == 2 and not out.complete
        assert out.corrupt == [hit.hits[2].key]
        assert_prefix_equal(out.arrays, kv)
        assert store.counters.corrupt == 1
        assert store.lookup(identity, PUBLIC, tokens).tokens == 2 * N
        # recompute and store again: served correctly afterwards
        store.put_prompt(identity, PUBLIC, tokens, kv)
        again = store.get(identity, PUBLIC, tokens)
        assert again.loaded == 4
        assert_prefix_equal(again.arrays, kv)
    corrupt = [e for e in sink.take() if e.kind == "corrupt"]
    assert len(corrupt) == 1 and corrupt[0].reason.startswith("corrupt")


def test_event_stream_obeys_the_table(tmp_path: Path, identity: ModelIdentity) -> None:
    sink = MemorySink()
    with open_store(tmp_path, dram_bytes=5 * CHUNK, sink=sink) as store:
        for i in range(5):
            tokens, kv = prompt_kv(200 + i, 3 * N)
            store.put_prompt(identity, PUBLIC if i % 2 else ALICE, tokens, kv)
            store.get(identity, PUBLIC, tokens)
        store.invalidate(namespace=ALICE)
    events = sink.take()
    assert [e.seq for e in events] == sorted(e.seq for e in events)
    state: dict[str, ObjectState | None] = {}
    for e in events:
        before = state.get(e.key)
        if before is ObjectState.DELETED:
            before = None
        after = check_move(e.key, before, Move(e.kind))
        assert after is not None and after.value == e.state
        state[e.key] = after


@pytest.mark.parametrize("vanish", [2, 99])
def test_flush_plans_again_when_sources_vanish_under_its_copies(
    tmp_path: Path, identity: ModelIdentity, monkeypatch: pytest.MonkeyPatch, vanish: int
) -> None:
    """A flush whose copies find their source gone (another thread evicted, replaced or
    re-adopted it between the plan and the read) plans again from the replicas then; it
    raises the ReplicaNotFound only when three plans in a row lost sources."""
    tokens, kv = prompt_kv(5, 3 * N)
    with open_store(tmp_path) as store:
        store.put_prompt(identity, PUBLIC, tokens, kv)
        dram = store.tier("dram")
        calls = {"n": 0}

        def vanishing(real: Any) -> Any:
            def read(keys: Any, *a: Any, **k: Any) -> Any:
                calls["n"] += 1
                if calls["n"] <= vanish:
                    raise ReplicaNotFound(f"{bytes(keys[0]).hex()} went away under the read")
                return real(keys, *a, **k)

            return read

        for name in ("read_batch", "read_verified"):
            monkeypatch.setattr(dram, name, vanishing(getattr(dram, name)))
        if vanish > 6:  # every plan lost its sources: the error, nothing half-done
            with pytest.raises(ReplicaNotFound, match="went away"):
                store.flush()
            assert store.lookup(identity, PUBLIC, tokens).tiers() == {"dram": 3}
            monkeypatch.undo()  # the sources are back: close() flushes them
        else:
            assert store.flush() == 3
            assert store.lookup(identity, PUBLIC, tokens).tiers() == {"dram": 3}
            assert store.flush() == 0  # all durable now

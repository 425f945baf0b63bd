"""A write-through put overtaken by an invalidation while its disk copy is being written
(what vLLM's prefix-cache reset does to a put still in flight): the invalidation wins.
The copy is given up as its objects go; nothing of it is left on disk, now or after a
reopen, and the event log says what happened to each chunk (no offload is claimed)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from kvlife.core.events import MemorySink
from kvlife.core.identity import PUBLIC, ChunkKey, ModelIdentity
from kvlife.faults.fileio import FaultyIO
from kvlife.results import PutResult
from kvlife.store import KVStore
from tests.conftest import prompt_kv, tiny_identity
from tests.helpers.workload import disk_of

N = 16  # tokens per chunk of the tiny layout


def _open(path: Path, sink: MemorySink | None = None, io: FaultyIO | None = None) -> KVStore:
    return KVStore.open(
        path, dram_bytes=1 << 20, disk_bytes=16 << 20, write_through=True, sink=sink, fileio=io
    )


def _wait(cond: object, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _moves(sink: MemorySink) -> dict[str, list[str]]:
    """Each chunk's events in order, a copy as ``offload>disk``."""
    kinds: dict[str, list[str]] = {}
    for e in sink.take():
        kinds.setdefault(e.key, []).append(f"{e.kind}>{e.dst_tier}" if e.dst_tier else e.kind)
    return kinds


def test_an_invalidation_overtaking_a_write_through_copy_leaves_nothing_of_it(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    tokens, kv = prompt_kv(7, 4 * N)
    sink = MemorySink()
    io = FaultyIO()
    store = _open(tmp_path, sink, io)
    try:
        stall = io.stall("pwritev")  # the put's copy to disk, held in its write
        put: dict[str, PutResult | BaseException] = {}

        def do_put() -> None:
            try:
                put["result"] = store.put_prompt(identity, PUBLIC, tokens, kv)
            except BaseException as exc:  # reported below
                put["result"] = exc

        putter = threading.Thread(target=do_put)
        putter.start()
        assert stall.wait_entered(), "the write-through copy never reached the disk"
        # indexed in DRAM already (a write-through put's chunks are visible before their
        # copy is durable): a reader in between hits
        assert store.lookup(identity, PUBLIC, tokens).tokens == 4 * N
        removed: list[int] = []
        inval = threading.Thread(
            target=lambda: removed.append(store.invalidate(weights_digest="w0"))
        )
        inval.start()
        _wait(lambda: store.lookup(identity, PUBLIC, tokens).tokens == 0, "the invalidation")
        stall.release()  # the copy completes after its objects went
        putter.join(30)
        inval.join(30)
        assert not putter.is_alive() and not inval.is_alive()

        result = put["result"]
        assert isinstance(result, PutResult), result
        assert result.stored == 4  # stored (indexed), then invalidated: not an error
        assert removed == [4]
        assert store.lookup(identity, PUBLIC, tokens).tokens == 0
        counters = store.counters.as_dict()
        assert counters["tier.disk.stored"] == 0  # no copy was published
        disk = disk_of(store)  # and the bytes it wrote are gone, not leaked
        assert not any(disk.contains(ChunkKey(k)) for k in result.keys)
        assert disk.live_bytes == 0
        assert counters["invalidated"] == 4

        kinds = _moves(sink)
        assert len(kinds) == 4
        for key, seen in kinds.items():
            assert seen == ["put", "write", "seal", "commit", "index", "invalidate", "delete"], (
                key,
                seen,
            )
    finally:
        store.close(flush=False)

    # the copy's bytes, written after the invalidation, were removed: a reopen finds
    # nothing of the prompt on disk, and no flush at close made any durable
    with _open(tmp_path) as again:
        assert again.indexed_keys() == []
        assert again.lookup(identity, PUBLIC, tokens).tokens == 0


def test_a_write_through_copy_finished_before_the_invalidation_is_logged_as_an_offload(
    tmp_path: Path,
) -> None:
    """The ordinary order, for contrast: the put returns durable, then the invalidation
    takes both replicas."""
    identity = tiny_identity()
    tokens, kv = prompt_kv(8, 4 * N)
    sink = MemorySink()
    with _open(tmp_path, sink) as store:
        assert store.put_prompt(identity, PUBLIC, tokens, kv).stored == 4
        assert store.counters.as_dict()["tier.disk.stored"] == 4
        assert store.invalidate(weights_digest="w0") == 4
        kinds = _moves(sink)
        for seen in kinds.values():
            assert seen == [
                "put", "write", "seal", "commit", "index", "offload>disk", "invalidate", "delete"
            ]  # fmt: skip
    with _open(tmp_path) as again:
        assert again.indexed_keys() == []

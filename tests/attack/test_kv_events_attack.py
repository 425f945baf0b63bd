"""Attacks on the KV-events publisher (kvlife/ops/kv_events.py): a router that follows
every batch must never keep a block the store no longer holds ("never keeps a removal
it missed", docs/operations.md), and nothing the publisher does may hold up a put.

Each test runs the real publisher on real ZMQ sockets and reads every batch back from
its replay socket, folding them as a router does."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq

from kvlife.core.events import ChunkFacts, LifecycleEvent
from kvlife.core.identity import PUBLIC
from kvlife.faults.damage import flip, scan_frames
from kvlife.ops.kv_events import KVEventPublisher, KVEventsConfig
from kvlife.store import KVStore
from tests.conftest import prompt_kv, tiny_identity


def _event(seq: int, kind: str, key: bytes, state: str) -> LifecycleEvent:
    return LifecycleEvent(time.time(), seq, kind, key.hex(), state, tier="dram")


def _replayed(endpoint: str) -> list[list[dict[str, Any]]]:
    """Every buffered batch's events, in order, from the replay socket (vLLM's protocol)."""
    ctx = zmq.Context()
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(endpoint)
    req.send_multipart((b"", (0).to_bytes(8, "big")))
    out: list[list[dict[str, Any]]] = []
    try:
        while True:
            assert req.poll(10_000), "the replay socket did not answer"
            _, _topic, seq, payload = req.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return out
            out.append(msgpack.unpackb(payload, raw=False)[1])
    finally:
        req.close()
        ctx.term()


def _router_view(batches: list[list[dict[str, Any]]]) -> set[tuple[bytes, str]]:
    held: set[tuple[bytes, str]] = set()
    for events in batches:
        for e in events:
            if e["type"] == "AllBlocksCleared":
                held.clear()
            elif e["type"] == "BlockStored":
                held |= {(h, e["medium"]) for h in e["block_hashes"]}
            elif e["type"] == "BlockRemoved":
                held -= {(h, e["medium"]) for h in e["block_hashes"]}
    return held


def _drained(pub: KVEventPublisher) -> None:
    deadline = time.monotonic() + 10
    seen = -1
    while time.monotonic() < deadline:  # no new batch for a while: the queue is empty
        if pub.batches == seen:
            return
        seen = pub.batches
        time.sleep(0.2)
    raise AssertionError("the publisher never drained")


def test_a_removal_dropped_on_a_full_queue_never_leaves_a_stale_block() -> None:
    """The queue fills with stores, then the removals of the same chunks are dropped.
    The ``AllBlocksCleared`` that stands for the drop must come after the stores that
    were queued before it: sent first (as it was), the stores follow it and the router
    keeps blocks the store has removed, for good."""
    cfg = KVEventsConfig("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", max_queue=4)
    pub = KVEventPublisher(cfg)
    try:
        keys = [bytes([i]) * 32 for i in range(1, 5)]
        facts = ChunkFacts(bytes(32), 16, "")
        old = sys.getswitchinterval()
        # the store emits under its lock, faster than the thread drains: hold the GIL so
        # the burst lands before the publisher's thread runs (as under a busy store)
        sys.setswitchinterval(30.0)
        try:
            for i, key in enumerate(keys):
                pub.emit_detailed(_event(i, "index", key, "indexed"), facts)
            for i, key in enumerate(keys):  # the queue is full: these are dropped
                pub.emit_detailed(_event(10 + i, "invalidate", key, "invalidated"), facts)
        finally:
            sys.setswitchinterval(old)
        assert pub.dropped == 4
        _drained(pub)
        view = _router_view(_replayed(pub.replay_endpoint))
        assert view == set(), f"the router still holds removed blocks: {len(view)}"
    finally:
        pub.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_held_puts_go_on_with_no_subscriber_and_a_tiny_queue(tmp_path: Path) -> None:
    """A PUB connected to a router that is not there, with a queue of 2 events: every
    put commits and is found, the events beyond the queue are dropped and counted."""
    cfg = KVEventsConfig(f"tcp://127.0.0.1:{_free_port()}", max_queue=2)
    pub = KVEventPublisher(cfg)
    store = KVStore.open(tmp_path / "s", dram_bytes=1 << 22, disk_bytes=0, sink=pub)
    ident = tiny_identity()
    try:
        deadline = time.monotonic() + 60
        for seed in range(40):
            tokens, kv = prompt_kv(seed, 64)
            store.put_prompt(ident, PUBLIC, tokens, kv)
            assert time.monotonic() < deadline, "puts are held up by the publisher"
        for seed in range(40):
            tokens, _ = prompt_kv(seed, 64)
            assert store.lookup(ident, PUBLIC, tokens).tokens == 64
    finally:
        store.close()
        pub.close()
    assert pub.dropped > 0


def test_a_replica_dropped_as_corrupt_while_another_survives_is_announced(
    tmp_path: Path,
) -> None:
    """A chunk held on DRAM and disk (write-through); its disk frame is damaged and the
    check with fix drops that replica. The chunk stays on DRAM, but its disk replica is
    gone: the router must be told (a ``BlockRemoved`` on ``disk``), as for every other
    way a replica leaves a tier. The store dropped the replica without a lifecycle
    event, so the router kept a disk block the store no longer held."""
    cfg = KVEventsConfig("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    pub = KVEventPublisher(cfg)
    store = KVStore.open(
        tmp_path / "s",
        dram_bytes=1 << 22,
        disk_bytes=16 << 20,
        segment_bytes=1 << 20,
        write_through=True,
        sink=pub,
    )
    ident = tiny_identity()
    try:
        tokens, kv = prompt_kv(3, 64)
        keys = store.put_prompt(ident, PUBLIC, tokens, kv).keys
        store.flush()
        frame = next(f for f in scan_frames(tmp_path / "s") if f.key == keys[1])
        flip(frame.segment, frame.payload_offset + 37, 5)
        assert not store.check(fix=True).clean
        store.lookup(ident, PUBLIC, tokens)  # takes in what the tiers dropped
        got = store.load(store.lookup(ident, PUBLIC, tokens))
        assert got.loaded == 4  # DRAM still serves every chunk
        _drained(pub)
        view = _router_view(_replayed(pub.replay_endpoint))
        assert (bytes(keys[1]), "dram") in view
        assert (bytes(keys[1]), "disk") not in view, "the router keeps a dropped disk replica"
        assert (bytes(keys[0]), "disk") in view
    finally:
        store.close()
        pub.close()

"""KV events for routers: what kvlife holds, in vLLM's KV-events wire format.

A KV-aware router (llm-d's indexer, Dynamo's router, vLLM's own examples) subscribes
to a ZMQ PUB socket and keeps, per publisher, which blocks sit in which medium. This
module publishes the store's lifecycle events in that format, so such a router can
route on what a kvlife store holds:

- ``BlockStored`` once a chunk becomes visible on a tier: published (``index``), copied
  there by a demotion, promotion, flush or write-through (``offload``), or sealed there
  while already published;
- ``BlockRemoved`` when it leaves a tier (``evict``) or leaves service everywhere
  (``invalidate``, ``corrupt``: one per tier that still held it);
- ``AllBlocksCleared`` when the publisher starts (before the recovered chunks are
  announced: whatever a previous server process announced is void), when it stops,
  and after events had to be dropped (the router then starts over from what follows).

``medium`` is the kvlife tier's name (``dram``, ``disk``, ...). ``block_hashes`` are
kvlife chunk keys (32 bytes each, the BLAKE3 identity of :mod:`kvlife.core.identity`),
``parent_block_hash`` the key of the chunk before (None for a prompt's first chunk),
``block_size`` the chunk's tokens, ``lora_name`` the adapter id, ``token_ids`` empty
(the store never keeps token ids). A router matches a request by computing the same keys
(docs/operations.md, "KV events").

Wire format, byte for byte what vLLM's ``ZmqEventPublisher`` sends
(``vllm/distributed/kv_events.py``): a multipart message ``(topic, seq, payload)``,
``seq`` an 8-byte big-endian counter from 0, ``payload`` the msgpack of a
``KVEventBatch``: an array ``[ts, events, data_parallel_rank]`` (rank 0, as vLLM's
publisher sends for a single engine), each event a map whose
first entry is ``"type": "<class name>"`` followed by the fields in declaration order,
those equal to their default left out (msgspec's ``tag=True, omit_defaults=True``).
An optional ROUTER socket answers replay requests (an 8-byte start sequence) with the
buffered batches and an end marker, as vLLM's does. The endpoint is bound when it has
``*`` or ``::`` or is ``ipc://``/``inproc://``, and connected to otherwise (vLLM's rule).

The store calls :meth:`KVEventPublisher.emit` under its lock, so it only queues the
event; the publisher's thread turns queued events into batches, encodes and sends them
(ZMQ sockets are used by that thread only).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from kvlife.core.errors import InvalidArgument
from kvlife.core.events import ChunkFacts, DetailedSink, LifecycleEvent

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay socket's end-of-replay marker (vLLM's ``ZmqEventPublisher.END_SEQ``)."""


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """Where and how ``kvlife serve`` publishes KV events."""

    endpoint: str
    """ZMQ endpoint of the PUB socket: bound when it has ``*`` or ``::`` or is
    ``ipc://``/``inproc://`` (``tcp://127.0.0.1:*`` binds a free loopback port), else
    connected to (a router's bound SUB socket)."""
    replay_endpoint: str = ""
    """ZMQ endpoint of a ROUTER socket that replays buffered batches (empty: none)."""
    topic: str = ""
    """First frame of every message."""
    buffer_steps: int = 10_000
    """Batches kept for replay."""
    max_queue: int = 100_000
    """Events queued for the publishing thread; beyond it events are dropped, counted,
    and an ``AllBlocksCleared`` is sent once the queue drains."""

    def __post_init__(self) -> None:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise InvalidArgument(f"kv events {name} must be a string, got {value!r}")
            if value and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise InvalidArgument(
                    f"kv events {name} must be tcp://, ipc:// or inproc://..., got {value!r}"
                )
        if not self.endpoint:
            raise InvalidArgument("kv events endpoint must be given")
        if not isinstance(self.topic, str):
            raise InvalidArgument(f"kv events topic must be a string, got {self.topic!r}")
        for name in ("buffer_steps", "max_queue"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise InvalidArgument(f"kv events {name} must be an int >= 1, got {value!r}")


_RELEVANT = frozenset({"index", "seal", "offload", "evict", "invalidate", "corrupt"})
"""Lifecycle moves that change what a tier holds (the others are left in the store)."""
_ROOT = bytes(32)
"""The parent key of a prompt's first chunk."""

Event = dict[str, Any]
"""One KV event as its msgpack map (keys in vLLM's field order)."""


def block_stored(
    hashes: Sequence[bytes], parent: bytes | None, block_size: int, medium: str, lora: str = ""
) -> Event:
    """vLLM's ``BlockStored`` (fields with their defaults left out)."""
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": [],
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": lora or None,
    }


def block_removed(hashes: Sequence[bytes], medium: str) -> Event:
    """vLLM's ``BlockRemoved``."""
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium}


def all_blocks_cleared() -> Event:
    """vLLM's ``AllBlocksCleared``."""
    return {"type": "AllBlocksCleared"}


def encode_batch(ts: float, events: Sequence[Event], data_parallel_rank: int | None = 0) -> bytes:
    """A ``KVEventBatch`` as vLLM's msgspec encoder writes it: an array (``array_like``:
    every field written, nil for a rank of None) of the time, the events and the rank."""
    body = [float(ts), list(events), data_parallel_rank]
    return bytes(msgpack.packb(body, use_bin_type=True))


class Tracker:
    """Which tiers each chunk is announced on, turning lifecycle events into KV events
    (run on the publisher's thread only)."""

    def __init__(self) -> None:
        self.held: dict[bytes, list[str]] = {}

    def clear(self) -> None:
        self.held.clear()

    def events(self, event: LifecycleEvent, facts: ChunkFacts) -> list[Event]:
        key = bytes.fromhex(event.key)
        kind = event.kind
        if kind == "index" or (kind == "seal" and event.state == "indexed"):
            return self._stored(key, event.tier, facts)
        if kind == "offload" and event.state == "indexed" and event.dst_tier:
            return self._stored(key, event.dst_tier, facts)
        if kind == "evict":
            tiers = self.held.get(key)
            if tiers is None or event.tier not in tiers:
                return []
            tiers.remove(event.tier)
            if not tiers:
                del self.held[key]
            return [block_removed([key], event.tier)]
        if kind in ("invalidate", "corrupt"):
            return [block_removed([key], t) for t in self.held.pop(key, [])]
        return []

    def _stored(self, key: bytes, tier: str, facts: ChunkFacts) -> list[Event]:
        if not tier:
            return []
        tiers = self.held.setdefault(key, [])
        if tier in tiers:
            return []
        tiers.append(tier)
        parent = facts.parent if facts.parent and facts.parent != _ROOT else None
        return [block_stored([key], parent, facts.ntokens, tier, facts.adapter)]


def merge(events: Sequence[Event]) -> list[Event]:
    """Consecutive events folded as vLLM folds a step's: a ``BlockStored`` that continues
    the previous one's chain on the same medium joins it, as do consecutive
    ``BlockRemoved`` of one medium."""
    out: list[Event] = []
    for e in events:
        prev = out[-1] if out else None
        if prev is not None and prev["type"] == e["type"] == "BlockStored":
            same = all(prev[f] == e[f] for f in ("medium", "block_size", "lora_name"))
            if same and e["parent_block_hash"] == prev["block_hashes"][-1]:
                prev["block_hashes"].extend(e["block_hashes"])
                continue
        removed = prev is not None and prev["type"] == e["type"] == "BlockRemoved"
        if removed and prev is not None and prev["medium"] == e["medium"]:
            prev["block_hashes"].extend(e["block_hashes"])
            continue
        out.append(e)
    return out


class KVEventPublisher(DetailedSink):
    """The store's lifecycle events published as vLLM KV events over ZMQ."""

    MAX_BATCH = 4096
    """Lifecycle events turned into one batch at most."""
    LINGER_MS = 1000
    """How long closing waits for the last batches to leave."""

    def __init__(self, config: KVEventsConfig) -> None:
        try:
            import zmq
        except ImportError as exc:  # the ops extra is not installed
            raise InvalidArgument(
                f"KV events need pyzmq: pip install 'kvlife[ops]' ({exc})"
            ) from exc

        self.config = config
        # None: events were dropped here, in queue order (an ``AllBlocksCleared`` goes
        # out after everything queued before the drop, never ahead of it)
        self._queue: deque[tuple[LifecycleEvent, ChunkFacts] | None] = deque()
        self._marked = False
        """The queue ends with a drop's marker (later drops add none)."""
        self._wake = threading.Event()
        self._closing = False
        self.dropped = 0
        """Lifecycle events not published because the queue was full (each run of them
        is followed by an ``AllBlocksCleared``)."""
        self.batches = 0
        """Batches published."""
        self.events = 0
        """KV events published (after folding)."""
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, 100_000)
            self._pub.setsockopt(zmq.LINGER, self.LINGER_MS)
            self.bound = binds(config.endpoint)
            """Whether the PUB socket is bound (else connected to a router's SUB)."""
            self.endpoint = _open(self._pub, config.endpoint)
            """The endpoint in use (a bound wildcard port resolved)."""
            self.replay_endpoint = ""
            if config.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
                self.replay_endpoint = _last_endpoint(self._replay)
        except zmq.ZMQError as exc:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            self._ctx.term()
            raise InvalidArgument(f"kv events: cannot open {config.endpoint}: {exc}") from exc
        self._topic = config.topic.encode()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._tracker = Tracker()
        self._thread = threading.Thread(target=self._run, name="kvlife-kv-events", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the store's side

    def emit_detailed(self, event: LifecycleEvent, facts: ChunkFacts) -> None:
        if event.kind not in _RELEVANT or self._closing:
            return
        if len(self._queue) >= self.config.max_queue:
            self.dropped += 1  # the store serialises emits: no lost update
            if not self._marked:  # one marker per run of drops: at most max_queue + 1
                self._queue.append(None)
                self._marked = True
            self._wake.set()
            return
        self._queue.append((event, facts))
        self._marked = False
        self._wake.set()

    def close(self) -> None:
        """Publish what is queued and a final ``AllBlocksCleared``, then stop."""
        if self._closing:
            return
        self._closing = True
        self._wake.set()
        self._thread.join(timeout=10)
        self._ctx.term()

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            self._send([all_blocks_cleared()])  # a new publisher: nothing announced before holds
            while True:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                self._wake.wait(0.01)
                self._wake.clear()
                self._step()
                if self._closing and not self._queue:
                    break
            self._send([all_blocks_cleared()])
        finally:
            self._pub.close(linger=self.LINGER_MS)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _step(self) -> None:
        out: list[Event] = []
        queue = self._queue
        for _ in range(self.MAX_BATCH):
            if not queue:
                break
            item = queue.popleft()
            if item is None:
                # events were lost here: the router must forget what this publisher
                # said (including what was queued before the loss) and learn again
                # from what follows
                self._tracker.clear()
                out.append(all_blocks_cleared())
                continue
            out.extend(self._tracker.events(*item))
        if out:
            self._send(merge(out))

    def _send(self, events: list[Event]) -> None:
        payload = encode_batch(time.time(), events)
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.batches += 1
        self.events += len(events)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart(
                    (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


def binds(endpoint: str) -> bool:
    """Whether the publisher binds ``endpoint`` (else it connects): vLLM's rule."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _open(sock: Any, endpoint: str) -> str:
    if binds(endpoint):
        sock.bind(endpoint)
        return _last_endpoint(sock)
    sock.connect(endpoint)
    return endpoint


def _last_endpoint(sock: Any) -> str:
    import zmq

    return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))

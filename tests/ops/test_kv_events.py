"""``kvlife serve --kv-events``: a real server publishes what it holds as vLLM KV events,
and a subscriber in the vLLM virtualenv decodes them with vLLM's own types
(``msgspec.msgpack.Decoder(KVEventBatch)``) from a real ZMQ SUB socket, the missed
batches fetched from the replay socket as vLLM's subscribers do. The stored and removed
events name the keys that were put, demoted, evicted and invalidated."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from kvlife.core.identity import PUBLIC
from kvlife.interpreters import vllm_python
from kvlife.ops.kv_events import (
    all_blocks_cleared,
    block_removed,
    block_stored,
    encode_batch,
    merge,
)
from tests.conftest import prompt_kv, tiny_identity
from tests.server.conftest import ROOT, ServerProc, child_env


def _vllm() -> str | None:
    try:
        python = vllm_python()
    except Exception:
        return None
    return python if Path(python).exists() else None


VLLM = _vllm()

# run in the vLLM virtualenv: vLLM's own event types and decoder, a real SUB socket
SUBSCRIBER = r"""
import json, sys, time
import msgspec, zmq
from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared

endpoint, replay_endpoint = sys.argv[1], sys.argv[2]
decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
encoder = msgspec.msgpack.Encoder()
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(endpoint)
batches = {}   # seq -> decoded batch
via_sub = set()
same_bytes = True

def take(seq_bytes, payload, live):
    global same_bytes
    seq = int.from_bytes(seq_bytes, "big")
    batch = decoder.decode(payload)
    same_bytes &= encoder.encode(batch) == payload   # what vLLM's encoder would send
    batches[seq] = batch
    if live:
        via_sub.add(seq)

def drain(timeout_ms):
    while sub.poll(timeout_ms):
        topic, seq_bytes, payload = sub.recv_multipart()
        take(seq_bytes, payload, True)
        timeout_ms = 50

def replay():
    # a DEALER (one request, many replies), framed as a REQ: empty delimiter first
    req = ctx.socket(zmq.DEALER)
    req.connect(replay_endpoint)
    req.send_multipart((b"", (0).to_bytes(8, "big")))
    while True:
        _, topic, seq_bytes, payload = req.recv_multipart()
        if int.from_bytes(seq_bytes, "big", signed=True) == -1:
            break
        take(seq_bytes, payload, False)
    req.close(linger=0)

def show(event):
    if isinstance(event, BlockStored):
        return {"type": "stored", "hashes": [h.hex() for h in event.block_hashes],
                "parent": event.parent_block_hash.hex() if event.parent_block_hash else None,
                "medium": event.medium, "block_size": event.block_size,
                "lora_name": event.lora_name}
    if isinstance(event, BlockRemoved):
        return {"type": "removed", "hashes": [h.hex() for h in event.block_hashes],
                "medium": event.medium}
    assert isinstance(event, AllBlocksCleared)
    return {"type": "cleared"}

time.sleep(0.3)
print("ready", flush=True)
sys.stdin.readline()          # the test has put, demoted, evicted and invalidated
drain(500)
replay()                      # whatever the SUB socket joined too late for
seqs = sorted(batches)
print(json.dumps({
    "seqs": seqs,
    "via_sub": sorted(via_sub),
    "same_bytes": same_bytes,
    "ranks": sorted({b.data_parallel_rank for b in batches.values()}, key=str),
    "batches": [[show(e) for e in batches[s].events] for s in seqs],
}), flush=True)
deadline = time.monotonic() + 30   # the server stops: its last batch clears everything
last = None
while time.monotonic() < deadline and sub.poll(500):
    topic, seq_bytes, payload = sub.recv_multipart()
    last = [show(e) for e in decoder.decode(payload).events]
print(json.dumps(last), flush=True)
"""


@pytest.mark.skipif(VLLM is None, reason="needs the vLLM virtualenv (.venv-vllm)")
def test_vllm_decodes_what_kvlife_holds(tmp_path: Path) -> None:
    assert VLLM is not None
    srv = ServerProc(
        tmp_path / "store",
        dram=16 * 4096,  # 16 chunks of 4 KiB pages in the arena
        disk=4 << 20,
        extra=(
            "--kv-events",
            "tcp://127.0.0.1:*",
            "--kv-events-replay",
            "tcp://127.0.0.1:*",
            "--kv-events-topic",
            "kvlife",
        ),
    ).start()
    sub: subprocess.Popen[str] | None = None
    try:
        m = re.search(r"kv_events endpoint=(\S+) bound=yes replay=(\S+)", srv.log.read_text())
        assert m is not None, srv.log.read_text()
        sub = subprocess.Popen(
            [VLLM, "-c", SUBSCRIBER, m.group(1), m.group(2)],
            cwd=ROOT,
            env=child_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert sub.stdout is not None and sub.stdin is not None
        assert sub.stdout.readline().strip() == "ready"
        with srv.client() as c:
            kept: list[list[str]] = []
            for seed in range(8):  # 32 chunks through a 16-chunk DRAM tier
                tokens, kv = prompt_kv(seed, 64)
                c.put_prompt(tiny_identity(), PUBLIC, tokens, kv)
                kept.append([h.key.hex() for h in c.lookup(tiny_identity(), PUBLIC, tokens).hits])
            old = tiny_identity(weights_digest="w-old")
            tokens, kv = prompt_kv(100, 32)
            c.put_prompt(old, PUBLIC, tokens, kv)
            gone = [h.key.hex() for h in c.lookup(old, PUBLIC, tokens).hits]
            assert c.invalidate(weights_digest="w-old") == 2
            assert c.counters.tier("dram").evictions > 0
            time.sleep(0.3)
        sub.stdin.write("go\n")
        sub.stdin.flush()
        got = json.loads(sub.stdout.readline())
    finally:
        stopped = srv.stop()
    assert stopped == 0
    last = json.loads(sub.stdout.readline())
    assert sub.wait(timeout=60) == 0

    assert got["seqs"] == list(range(len(got["seqs"]))), "a gap in the sequence numbers"
    assert got["via_sub"], "nothing arrived on the SUB socket"
    assert got["same_bytes"], "vLLM's encoder would not send these bytes"
    assert got["ranks"] == [0]
    assert got["batches"][0] == [{"type": "cleared"}]  # a new publisher
    assert last == [{"type": "cleared"}]  # and a stopped one

    stored: dict[str, set[str]] = {}
    removed: dict[str, set[str]] = {}
    parents: dict[str, str | None] = {}
    for batch in got["batches"]:
        for e in batch:
            if e["type"] == "stored":
                assert e["block_size"] == 16 and e["lora_name"] is None
                parent = e["parent"]
                for h in e["hashes"]:
                    stored.setdefault(h, set()).add(e["medium"])
                    parents[h] = parent
                    parent = h
            elif e["type"] == "removed":
                for h in e["hashes"]:
                    removed.setdefault(h, set()).add(e["medium"])
    for keys in [*kept, gone]:
        assert all("dram" in stored.get(k, ()) for k in keys), "a put not announced"
        assert parents[keys[0]] is None
        assert [parents[k] for k in keys[1:]] == keys[:-1], "parent chain"
    # DRAM overflowed: chunks demoted to disk were announced there, and left DRAM
    demoted = [k for keys in kept for k in keys if "disk" in stored.get(k, ())]
    evicted = [k for keys in kept for k in keys if "dram" in removed.get(k, ())]
    assert demoted and evicted and set(evicted) <= set(demoted)
    # the invalidated prompt left every tier it was announced on
    assert all(removed.get(k) == stored[k] for k in gone)


def test_encoding_is_what_vllm_sends() -> None:
    """The bytes of each event kind, as vLLM 0.32's msgspec encoder wrote them for the
    same batch (captured once in .venv-vllm; the test above checks it live)."""
    batch = encode_batch(
        1.5,
        [
            block_stored([b"\x01" * 4], None, 64, "dram"),
            block_removed([b"\x02"], "disk"),
            all_blocks_cleared(),
        ],
    )
    assert batch == (
        b"\x93\xcb?\xf8\x00\x00\x00\x00\x00\x00\x93\x88\xa4type\xabBlockStored\xacblock_hashes"
        b"\x91\xc4\x04\x01\x01\x01\x01\xb1parent_block_hash\xc0\xa9token_ids\x90\xaablock_size"
        b"@\xa7lora_id\xc0\xa6medium\xa4dram\xa9lora_name\xc0\x83\xa4type\xacBlockRemoved"
        b"\xacblock_hashes\x91\xc4\x01\x02\xa6medium\xa4disk\x81\xa4type\xb0AllBlocksCleared\x00"
    )


def test_merge_folds_chains_and_removals() -> None:
    a, b, c = b"a" * 32, b"b" * 32, b"c" * 32
    events: list[dict[str, Any]] = [
        block_stored([a], None, 16, "dram"),
        block_stored([b], a, 16, "dram"),
        block_stored([c], a, 16, "dram"),  # not b's child: a new event
        block_removed([a], "dram"),
        block_removed([b], "dram"),
        block_removed([c], "disk"),
    ]
    out = merge(events)
    assert [e["block_hashes"] for e in out] == [[a, b], [c], [a, b], [c]]


class Subscriber:
    """A SUB socket in this process (pyzmq), batches decoded with msgpack, and the
    replay socket for what it joined too late for."""

    def __init__(self, endpoint: str, replay: str) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay_endpoint = replay
        self.batches: dict[int, list[Any]] = {}

    def collect(self) -> list[list[dict[str, Any]]]:
        import msgpack
        import zmq

        while self.sub.poll(300):
            _, seq, payload = self.sub.recv_multipart()
            self.batches[int.from_bytes(seq, "big")] = msgpack.unpackb(payload)
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        while True:
            _, _, seq, payload = dealer.recv_multipart()
            n = int.from_bytes(seq, "big", signed=True)
            if n == -1:
                break
            self.batches[n] = msgpack.unpackb(payload)
        dealer.close(linger=0)
        assert sorted(self.batches) == list(range(len(self.batches)))
        return [self.batches[s][1] for s in sorted(self.batches)]

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


def test_a_restarted_server_announces_what_it_recovered(tmp_path: Path) -> None:
    """After a restart the router is told to forget what the old process said, then
    every chunk recovered from disk is announced on the disk tier."""
    srv = ServerProc(tmp_path / "store", dram=64 * 4096, disk=4 << 20)
    srv.start()
    with srv.client() as c:
        tokens, kv = prompt_kv(5, 64)
        c.put_prompt(tiny_identity(), PUBLIC, tokens, kv)
        keys = [h.key for h in c.lookup(tiny_identity(), PUBLIC, tokens).hits]
    assert srv.stop() == 0  # flushed to disk
    srv.args += ["--kv-events", "tcp://127.0.0.1:*", "--kv-events-replay", "tcp://127.0.0.1:*"]
    srv.log.write_text("")
    srv.start()
    try:
        m = re.search(r"kv_events endpoint=(\S+) bound=yes replay=(\S+)", srv.log.read_text())
        assert m is not None
        sub = Subscriber(m.group(1), m.group(2))
        batches = sub.collect()
        sub.close()
    finally:
        assert srv.stop() == 0
    assert batches[0] == [{"type": "AllBlocksCleared"}]
    stored = [e for b in batches[1:] for e in b if e["type"] == "BlockStored"]
    assert {e["medium"] for e in stored} == {"disk"}
    announced = [h for e in stored for h in e["block_hashes"]]
    assert sorted(announced) == sorted(bytes(k) for k in keys)

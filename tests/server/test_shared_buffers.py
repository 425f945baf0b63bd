"""Streamed disk loads on the wire, and output buffers in shared memory: a load whose
buffers all lie in one the server made lands there directly (disk reads too), with
exactly the bytes of the store; other buffers take the grant path. The buffer's file
goes with the connection."""

from __future__ import annotations

import contextlib
import functools
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from kvlife.client import RemoteStore
from kvlife.core.errors import InvalidArgument, StorageFullError
from kvlife.core.identity import PUBLIC, KVLayout, ModelIdentity
from kvlife.results import LookupResult
from kvlife.server import protocol
from tests.conftest import TINY, prompt_kv, tiny_identity
from tests.server.conftest import MiB, ServerProc, quiet, wait_for

N = TINY.tokens_per_chunk


def _streamed_load(
    socket_path: str,
    lk: LookupResult,
    layout: KVLayout,
    during: Callable[[], object] = lambda: None,
) -> tuple[Path, list[list[Any]], dict[str, Any], socket.socket]:
    """A streamed load of ``lk``'s hits on a connection of its own, spoken raw: the
    arena's path, the partial replies (chunk, offset, dtype, shape), the final reply
    and the connection (the caller closes it). ``during`` runs once the first frame
    after the request arrived (the server has read chunk 0)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(socket_path)
    sock.sendall(protocol.pack([1, "hello", {"version": protocol.PROTOCOL_VERSION}]))
    body = protocol.recv_frame(sock)
    assert body is not None
    arena = Path(msgpack.unpackb(body)[2]["arena"])
    args = {
        "keys": b"".join(h.key for h in lk.hits),
        "starts": [h.start for h in lk.hits],
        "chunks_total": lk.chunks_total,
        "layout": protocol.encode_layout(layout),
        "stream": True,
    }
    sock.sendall(protocol.pack([2, "load", args]))
    parts: list[list[Any]] = []
    body = protocol.recv_frame(sock)
    during()
    while True:
        assert body is not None
        rid, kind, payload = msgpack.unpackb(body)
        assert rid == 2
        if kind != protocol.PART:
            break
        parts.append(payload)
        body = protocol.recv_frame(sock)
    assert kind is True, payload
    return arena, parts, payload, sock


def test_loads_land_in_shared_buffers_from_dram_and_disk(remote: RemoteStore) -> None:
    ident = tiny_identity()
    tokens, kv = prompt_kv(21, 3 * N)
    remote.put_prompt(ident, PUBLIC, tokens, kv)
    raw = remote.alloc_buffer(3 * 4096)
    assert raw.ctypes.data % 4096 == 0
    n = TINY.chunk_nbytes
    outs = [
        raw[i * 4096 : i * 4096 + n].view(np.float16).reshape(TINY.chunk_shape) for i in range(3)
    ]
    arena = Path(remote.info().tiers[0].details["arena"])
    files = list(arena.parent.glob(arena.name + "-buf-*"))
    assert len(files) == 1 and files[0].stat().st_mode & 0o777 == 0o600
    for where in ("dram", "disk"):
        if where == "disk":
            remote.flush()
            remote.evict("dram", 8 * MiB)
        for o in outs:
            o[...] = 0
        lk = remote.lookup(ident, PUBLIC, tokens)
        assert lk.tiers() == {where: 3}
        got = remote.load(lk, outs)
        assert got.loaded == 3 and got.tiers == {where: 3}
        for i, (a, o) in enumerate(zip(got.arrays, outs, strict=True)):
            assert a is o
            assert np.array_equal(o, kv[:, :, :, i * N : (i + 1) * N])
    assert quiet(remote)["buffers"] == 1
    remote.close()
    wait_for(lambda: not files[0].exists(), what="the buffer file to go with the connection")


def test_buffers_outside_shared_memory_take_the_grant_path(remote: RemoteStore) -> None:
    ident = tiny_identity()
    tokens, kv = prompt_kv(22, 2 * N)
    remote.put_prompt(ident, PUBLIC, tokens, kv)
    remote.alloc_buffer(4096)
    lk = remote.lookup(ident, PUBLIC, tokens)
    outs = [np.zeros(TINY.chunk_shape, np.float16) for _ in range(2)]
    got = remote.load(lk, outs)
    assert got.loaded == 2 and np.array_equal(outs[1], kv[:, :, :, N:])
    with pytest.raises(InvalidArgument):
        remote.alloc_buffer(0)


def test_a_load_from_disk_is_streamed_chunk_by_chunk(remote: RemoteStore) -> None:
    """On the wire: one partial reply per chunk read from disk and verified before the
    load was published, in order, then the final reply counting them and granting the
    rest (chunks verified once every read had finished ride in it: one frame, not one
    per chunk); the bytes at each offset are the chunk's."""
    ident = tiny_identity()
    tokens, kv = prompt_kv(23, 3 * N)
    remote.put_prompt(ident, PUBLIC, tokens, kv)
    remote.flush()
    remote.evict("dram", 8 * MiB)
    lk = remote.lookup(ident, PUBLIC, tokens)
    arena, parts, payload, sock = _streamed_load(remote.socket_path, lk, TINY)
    assert payload["streamed"] == len(parts) and len(parts) + len(payload["grants"]) == 3
    assert [p[0] for p in parts] == list(range(len(parts)))
    placed = [(off, dtype, shape) for _, off, dtype, shape in parts] + payload["grants"]
    with arena.open("rb") as f:
        for i, (off, dtype, shape) in enumerate(placed):
            f.seek(off)
            got = np.frombuffer(f.read(TINY.chunk_nbytes), dtype).reshape(shape)
            assert np.array_equal(got, kv[:, :, :, i * N : (i + 1) * N])
    sock.close()


BIG = KVLayout(num_layers=2, num_kv_heads=8, head_dim=64, dtype="float16", tokens_per_chunk=64)
"""256 KiB chunks: a disk load of 24 of them takes long enough for an invalidation to
land while it runs."""


def test_streamed_chunks_an_invalidation_uncounted_stay_pinned_until_released(
    tmp_path: Path,
) -> None:
    """A streamed load sends each chunk's place in the arena as soon as it verified; an
    invalidation landing before the load's end makes the load count those chunks as a
    miss, but the client may not have copied them yet (it copies each when it reads its
    part) and hands each out once copied. Their extents stay pinned with the grant until
    the client releases it: before, they were freed with the reply, another put reused
    them, and the client copied that put's bytes (the soak's "wrong bytes served" in a
    streamed load_async)."""
    srv = ServerProc(tmp_path / "srv", dram=24 * MiB, disk=128 * MiB, staging=16 * MiB).start()
    try:
        remote = srv.client()
        other = srv.client()
        ident = ModelIdentity(model_id="big", weights_digest="w", tokenizer_digest="t", layout=BIG)
        hit = 0
        for attempt in range(12):
            tokens, kv = prompt_kv(100 + attempt, 24 * BIG.tokens_per_chunk, BIG)
            remote.put_prompt(ident, PUBLIC, tokens, kv)
            remote.flush()
            remote.evict("dram", 1 << 40)
            lk = remote.lookup(ident, PUBLIC, tokens)
            assert lk.tiers() == {"disk": 24}
            arena, frames, payload, sock = _streamed_load(
                remote.socket_path,
                lk,
                BIG,  # chunk 0 was read: the prompt is invalidated while the rest are
                during=functools.partial(other.invalidate, prefix=lk.hits[0].key),
            )
            if payload["streamed"] == len(frames):
                sock.close()  # the invalidation came after the load's end: again
                continue
            hit += 1
            # chunks streamed but not counted: still pinned, with a grant to release
            assert payload["load"] != 0
            # other puts take every free extent meanwhile (none of the pinned ones)
            for j in range(40):
                t2, kv2 = prompt_kv(900 + j, 4 * BIG.tokens_per_chunk, BIG)
                with contextlib.suppress(StorageFullError):  # the arena is full: done
                    other.put_prompt(ident, PUBLIC, t2, kv2)
            with arena.open("rb") as f:
                for i, off, dtype, shape in frames:
                    f.seek(off)
                    got = np.frombuffer(f.read(BIG.chunk_nbytes), dtype).reshape(shape)
                    want = kv[:, :, :, i * BIG.tokens_per_chunk : (i + 1) * BIG.tokens_per_chunk]
                    assert np.array_equal(got, want), f"chunk {i}'s extent was reused"
            sock.sendall(protocol.pack([3, "release", {"load": payload["load"]}]))
            sock.close()
            if hit >= 2:
                break
        assert hit, "no invalidation landed inside a streamed load in 12 tries"
        snap = quiet(remote, sessions=2)
        assert snap["loads"] == 0 and snap["held_grant_bytes"] == 0, snap  # all released
    finally:
        srv.stop()

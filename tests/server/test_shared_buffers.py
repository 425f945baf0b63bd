"""Output buffers in shared memory: a load whose buffers all lie in one the server made
lands there directly (disk reads too), with exactly the bytes of the store; other
buffers take the grant path. The buffer's file goes with the connection."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvlife.client import RemoteStore
from kvlife.core.errors import InvalidArgument
from kvlife.core.identity import PUBLIC
from tests.conftest import TINY, prompt_kv, tiny_identity
from tests.server.conftest import MiB, quiet, wait_for

N = TINY.tokens_per_chunk


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
    files = list(Path("/dev/shm").glob("kvlife-*-buf-*"))
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

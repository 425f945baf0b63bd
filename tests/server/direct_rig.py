"""Set-up shared by the tests of direct disk reads (tests/server/test_direct_reads.py
and the red teams tests/attack/test_direct_reads_attack.py and
tests/attack/test_direct_run_attack.py) and of served frame loads: a real ``kvlife
serve`` whose puts are written through to disk with no promotion, so that disk hits
stay disk hits, a pair of clients of it, one plain and one with direct reads, and a
spy on the client's piecewise copies (landed parts)."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvlife.client import RemoteStore
from kvlife.client import loads as client_loads
from kvlife.core.identity import PUBLIC, ModelIdentity
from tests.conftest import prompt_kv
from tests.server.conftest import MiB, ServerProc


def disk_server(
    path: Path,
    *,
    dram: int = 4 * MiB,
    disk: int = 64 * MiB,
    extra: tuple[str, ...] = (),
    prefix: tuple[str, ...] = (),
) -> ServerProc:
    """A started server at ``path``: write-through, no promotion (its staging as large
    as its DRAM)."""
    return ServerProc(
        path,
        dram=dram,
        disk=disk,
        staging=dram,
        extra=("--write-through", "--no-promote", *extra),
        prefix=prefix,
    ).start()


OUT_OF_REACH = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="a server in a private mount namespace: root and unshare(1)",
)


def out_of_reach_server(path: Path) -> ServerProc:
    """A :func:`disk_server` in a private mount namespace where its folder ``path`` is a
    bind mount of a hidden folder beside it: its segment files are there, and here
    ``path`` is an empty folder (a worker in a container without the server's
    volume). Its socket and arena are outside ``path``, reachable from here."""
    hidden = path.parent / f".{path.name}-hidden"
    hidden.mkdir()
    path.mkdir()
    # sh's $0 is the hidden folder, $1 the store's; "$@" after the shift, the server
    mount = 'mount --bind "$0" "$1" && shift && exec "$@"'
    ns = ("unshare", "--mount", "--propagation", "private", "sh", "-c", mount)
    return disk_server(path, prefix=(*ns, str(hidden), str(path)))


@contextlib.contextmanager
def client_pair(srv: ServerProc) -> Iterator[tuple[RemoteStore, RemoteStore]]:
    """(a plain client, a client with direct reads) of ``srv``, both closed after."""
    plain = srv.client()
    mine = RemoteStore(srv.socket, timeout=30, direct_reads=True)
    try:
        yield plain, mine
    finally:
        for c in (mine, plain):
            with contextlib.suppress(Exception):
                c.close()


def put_on_disk(
    store: RemoteStore, ident: ModelIdentity, chunks: int, seed: int
) -> tuple[np.ndarray, list[bytes]]:
    """A prompt of ``chunks`` full chunks put, flushed to disk and evicted from DRAM (its
    hits are disk hits): its tokens and each chunk's stored bytes."""
    layout = ident.layout
    n = layout.tokens_per_chunk
    tokens, kv = prompt_kv(seed, chunks * n, layout)
    store.put_prompt(ident, PUBLIC, tokens, kv)
    store.flush()
    store.evict("dram", 1 << 40)
    parts = [np.ascontiguousarray(kv[:, :, :, i * n : (i + 1) * n, :]) for i in range(chunks)]
    return tokens, [c.tobytes() for c in parts]


def copy_spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """The byte ranges the client copies out of extents in pieces from now on (landed
    parts and the rest after them), in order: (the destination's data address, start,
    end), filled as the client copies."""
    seen: list[tuple[int, int, int]] = []
    real = client_loads._copy_bytes

    def spy(dst: np.ndarray, src: np.ndarray, start: int, end: int) -> None:
        seen.append((dst.ctypes.data, start, end))
        real(dst, src, start, end)

    monkeypatch.setattr(client_loads, "_copy_bytes", spy)
    return seen

"""Set-up shared by the tests of direct disk reads (tests/server/test_direct_reads.py
and the red teams tests/attack/test_direct_reads_attack.py and
tests/attack/test_direct_run_attack.py): a real ``kvlife serve`` whose puts are written
through to disk with no promotion, so that disk hits stay disk hits, and a pair of
clients of it, one plain and one with direct reads."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from kvlife.client import RemoteStore
from tests.server.conftest import MiB, ServerProc


def disk_server(
    path: Path, *, dram: int = 4 * MiB, disk: int = 64 * MiB, extra: tuple[str, ...] = ()
) -> ServerProc:
    """A started server at ``path``: write-through, no promotion (its staging as large
    as its DRAM)."""
    return ServerProc(
        path, dram=dram, disk=disk, staging=dram, extra=("--write-through", "--no-promote", *extra)
    ).start()


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

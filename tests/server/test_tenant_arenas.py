"""Memory that only its tenant can map (issue 24): on a ``kvlife serve --tenants`` each
principal's private replicas live in an arena file owned by its Unix user (0600) or
group (0660), a client maps only its own, and a principal with no Unix user puts and
loads through the socket.

The two-user test runs real clients as other Unix users (setuid children: the tests run
as root): dave by his uid, erin by her group. erin cannot open dave's arena or the
server's own (EACCES from the kernel), and nothing she sends gets her dave's bytes;
each of them puts and loads through the zero-copy path in their own arena.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvlife.client.handles import RemoteLookup
from kvlife.core.errors import NotPermitted
from kvlife.core.identity import PUBLIC
from kvlife.tiers.shm import Arena, Owner
from tests.conftest import prompt_kv, tiny_identity
from tests.server.conftest import ROOT, ServerProc, child_env
from tests.server.tenants import ORG, USER, as_, tenant_server, write_config

IDENT = tiny_identity()

_CLIENT = textwrap.dedent(
    """
    import concurrent.futures, errno, json, os, secrets, sys
    import numpy as np
    import numpy.random
    from kvlife.client import RemoteStore
    from kvlife.core.identity import Namespace, NamespaceKind
    from kvlife.results import ChunkHit, LookupResult
    from tests.conftest import prompt_kv, tiny_identity
    sock, name, others = sys.argv[1], sys.argv[4], json.loads(sys.argv[6])
    uid, gid, seed = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[5])
    ident = tiny_identity()
    tokens, kv = prompt_kv(seed, 64)
    # imported above, as root: the interpreter's files need not be readable by them
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    out = {}
    with RemoteStore(sock, timeout=30) as store:
        out["principal"] = store.server_info()["principal"]["name"]
        ns = Namespace(NamespaceKind.USER, name)
        put = store.put_prompt(ident, ns, tokens, kv)
        hit = store.lookup(ident, ns, tokens)
        out["hints"] = list(hit.hints)
        got = store.load(hit)
        n = ident.layout.tokens_per_chunk
        out["stored"], out["loaded"] = put.stored, got.loaded
        out["same"] = all(
            np.array_equal(a, kv[:, :, :, i * n : (i + 1) * n]) for i, a in enumerate(got.arrays)
        )
        # into buffers: the zero-copy load into a shared buffer of her own
        buf = store.alloc_buffer(ident.layout.chunk_nbytes * 4)
        outs = [buf[i * ident.layout.chunk_nbytes:(i + 1) * ident.layout.chunk_nbytes]
                .view(np.float16).reshape(ident.layout.chunk_shape) for i in range(4)]
        out["into"] = store.load(hit, outs).loaded
        out["keys"] = [k.hex() for k in put.keys]
        # the other tenant's arena files, and its keys
        opened = {}
        for path in others.get("paths", []):
            for flags in (os.O_RDONLY, os.O_RDWR):
                try:
                    fd = os.open(path, flags)
                except OSError as exc:
                    opened[f"{path}:{flags}"] = errno.errorcode[exc.errno]
                else:
                    os.close(fd)
                    opened[f"{path}:{flags}"] = "opened"
        out["opened"] = opened
        stolen = [bytes.fromhex(k) for k in others.get("keys", [])]
        if stolen:
            res = LookupResult(
                [ChunkHit(i, k, n * i, hit.hits[0].tier) for i, k in enumerate(stolen)],
                len(stolen), n,
            )
            got = store.load(res)
            out["stolen_loaded"] = got.loaded
    print(json.dumps(out))
    """
)


def _client(sock: Path, uid: int, gid: int, name: str, seed: int, others: dict[str, Any]) -> Any:
    got = subprocess.run(
        [
            sys.executable,
            "-c",
            _CLIENT,
            str(sock),
            str(uid),
            str(gid),
            name,
            str(seed),
            json.dumps(others),
        ],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert got.returncode == 0, got.stderr[-3000:]
    return json.loads(got.stdout.splitlines()[-1])


@pytest.fixture
def sockdir() -> Iterator[Path]:
    """A directory other users can reach (pytest's tmp_path is 0700)."""
    d = Path(tempfile.mkdtemp(prefix="kvlife-arenas-"))
    os.chmod(d, 0o755)
    yield d
    for f in d.iterdir():
        f.unlink()
    d.rmdir()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run clients as other users")
def test_a_tenant_cannot_map_read_or_change_anothers_replicas(
    tmp_path: Path, sockdir: Path
) -> None:
    extra = """
[principal.dave]
uids = [40123]

[principal.erin]
gids = [40200]
"""
    srv = ServerProc(
        tmp_path / "store", extra=("--tenants", str(write_config(tmp_path / "t.toml", extra)))
    )
    srv.socket = sockdir / "s.sock"
    try:
        srv.start()
        dave = _client(srv.socket, 40123, 40123, "dave", 1, {})
        assert dave["principal"] == "dave"
        assert (dave["stored"], dave["loaded"], dave["into"], dave["same"]) == (4, 4, 4, True)
        assert all(dave["hints"][1::2])  # DRAM hits in his own arena: a zero-copy load
        with as_(srv, "root") as root:
            state = root.server_state()
            common = Path(root.server_info()["tiers"][0]["details"]["arena"])
        arenas = {p.name: p for p in common.parent.glob(common.name + "-t-*")}
        daves = arenas[common.name + "-t-dave"]
        st = daves.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (40123, 0o600)
        assert state["arena_arenas"] == 2  # the server's and dave's
        # erin, by her group: her own arena works; dave's and the server's do not open
        erin = _client(
            srv.socket,
            40124,
            40200,
            "erin",
            2,
            {"paths": [str(daves), str(common)], "keys": dave["keys"]},
        )
        assert erin["principal"] == "erin"
        assert (erin["stored"], erin["loaded"], erin["into"], erin["same"]) == (4, 4, 4, True)
        assert set(erin["opened"].values()) == {"EACCES"}, erin["opened"]
        assert erin["stolen_loaded"] == 0  # dave's keys load as keys not stored
        erins = common.with_name(common.name + "-t-erin").stat()
        assert (erins.st_gid, stat.S_IMODE(erins.st_mode)) == (40200, 0o660)
        # dave, again: his replicas are still his bytes (nobody changed them)
        again = _client(srv.socket, 40123, 40123, "dave", 1, {"keys": erin["keys"]})
        assert (again["stored"], again["loaded"], again["same"]) == (0, 4, True)
        assert again["stolen_loaded"] == 0
    finally:
        srv.stop()
    assert not list(common.parent.glob(common.name + "*"))  # every arena removed


@pytest.fixture
def served(tmp_path: Path) -> Iterator[ServerProc]:
    config = write_config(tmp_path / "t.toml", bob_uid=os.geteuid())
    srv = tenant_server(tmp_path / "store", config).start()
    yield srv
    srv.stop()


def test_a_token_only_principal_gets_copies_through_the_socket(served: ServerProc) -> None:
    """alice has no Unix user: her client maps nothing, puts and loads through the
    socket; what needs a mapping is refused with why. bob (this Unix user) maps his
    own arena, and a shared scope's replica reaches him as a copy in it."""
    tokens, kv = prompt_kv(11, 64)
    n = IDENT.layout.tokens_per_chunk
    with as_(served, "alice") as alice, as_(served, "bob") as bob:
        assert alice._wire.connected().arena is None
        assert bob._wire.connected().arena is not None
        assert alice.put_prompt(IDENT, USER["alice"], tokens, kv).stored == 4
        assert alice.put_prompt(IDENT, ORG["alice"], tokens, kv).stored == 4
        hit = alice.lookup(IDENT, USER["alice"], tokens)
        assert isinstance(hit, RemoteLookup)
        assert hit.hints == (0, 0) * 4  # no arena addresses for a client that maps none
        got = alice.load(hit)
        assert got.loaded == 4
        for i, a in enumerate(got.arrays):
            assert np.array_equal(a, kv[:, :, :, i * n : (i + 1) * n])
        outs = [np.empty(IDENT.layout.chunk_shape, np.float16) for _ in range(4)]
        assert alice.load(hit, outs).loaded == 4
        assert np.array_equal(outs[3], kv[:, :, :, 3 * n :])
        with pytest.raises(NotPermitted, match="maps no arena"):
            alice.alloc_buffer(4096)
        # a prepare_put is held by her client, sent through the socket by its commit
        held = alice.prepare_put(IDENT, USER["alice"], tokens, kv)
        assert held.held is not None
        alice.abort_put(held)
        # bob: his user scope in his own arena (hints), a public replica by a copy
        # into it (the server's arena is mapped by no client of this server)
        other, kv2 = prompt_kv(12, 64)
        assert bob.put_prompt(IDENT, USER["bob"], other, kv2).stored == 4
        mine = bob.lookup(IDENT, USER["bob"], other)
        assert isinstance(mine, RemoteLookup)
        assert all(mine.hints[1::2])
        assert bob.load(mine).loaded == 4
        shared, kv3 = prompt_kv(13, 64)
        with as_(served, "root") as root:
            assert root.put_prompt(IDENT, PUBLIC, shared, kv3).stored == 4
        theirs = bob.lookup(IDENT, USER["bob"], shared)
        assert isinstance(theirs, RemoteLookup)
        assert len(theirs.hits) == 4 and theirs.hints == (0, 0) * 4
        got = bob.load(theirs)
        assert got.loaded == 4 and np.array_equal(got.arrays[0], kv3[:, :, :, :n])


def test_a_replica_lives_in_its_home_arena(tmp_path: Path) -> None:
    """The tier's choice of arena: a sealed extent of the home arena is adopted, any
    other payload is copied there; hints name only the arena asked about."""
    from kvlife.core.identity import ChunkKey
    from kvlife.tiers.base import ReplicaMeta
    from kvlife.tiers.shm import ShmTier

    tier = ShmTier(1 << 20, "dram", tmp_path / "a", 1 << 20)
    other = Arena(
        tmp_path / "b", 2 << 20, populate_pages=False, owner=Owner(os.geteuid(), os.getegid())
    )
    tier.add_arena("b", other)
    tier.home = lambda meta: other if meta.info == b"b" else None
    try:
        ext = other.alloc(4096, np.uint8, (4096,))
        assert ext is not None
        ext[:] = 7
        ext.flags.writeable = False
        free = np.full(4096, 9, np.uint8)
        keys = [ChunkKey(bytes([i]) * 32) for i in range(3)]
        metas = [
            ReplicaMeta(keys[0], "uint8", (4096,), info=b"b"),
            ReplicaMeta(keys[1], "uint8", (4096,), info=b"b"),
            ReplicaMeta(keys[2], "uint8", (4096,)),
        ]
        tier.store(metas, [ext, free, free])
        assert tier.adopted == 1  # the sealed extent of its home: no copy
        assert tier.hint(keys[0], other) is not None and tier.hint(keys[0]) is None
        assert tier.hint(keys[1], other) is not None  # copied into its home
        assert tier.hint(keys[2]) is not None and tier.hint(keys[2], other) is None
        assert tier.arena_stats()["arena_arenas"] == 2
    finally:
        tier.close()
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_tenant_arenas_benchmark_runs_and_writes_its_json(tmp_path: Path) -> None:
    from kvlife.bench.tenant_arenas import MODES, main

    out = tmp_path / "arenas.json"
    assert main(["--quick", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert set(got["modes"]) == set(MODES) and got["chunk_bytes"] == 2 << 20
    assert "memcpy_gbps" in got["machine"]
    for mode in MODES:
        fig = got["modes"][mode]
        assert fig["put_gbps"] > 0 and fig["load_gbps"] > 0
    assert got["modes"]["socket"]["principal"] == "bench"
    assert "load_vs_single" in got["modes"]["own_arena"]

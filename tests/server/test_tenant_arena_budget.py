"""The principals' arenas within a budget (issue 24, "memory that only its tenant can
map"): each principal's arena is as large as the tenants file says (``arena_bytes``,
``[arenas] principal_bytes``), all of them together within ``[arenas] total_bytes``; a
principal past that bound maps none and puts and loads through the socket; a put staged
into a full arena is refused by the server with an error naming the principal and the
size, and the client then sends it through the socket; a copied replica its home arena
has no room for lives in the tier's own arena."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvlife.client import RemoteStore
from kvlife.client.handles import RemoteLookup
from kvlife.core.errors import InvalidArgument, StorageFullError
from kvlife.core.identity import ChunkKey, Namespace, NamespaceKind
from kvlife.core.objects import PromptRef
from kvlife.server import protocol
from kvlife.tenancy import token_digest
from kvlife.tenancy.principals import parse_config
from kvlife.tiers.base import ReplicaMeta
from kvlife.tiers.shm import Arena, Owner, ShmTier
from tests.conftest import prompt_kv, tiny_identity
from tests.server.tenants import tenant_server

IDENT = tiny_identity()
KiB = 1 << 10
CAROL = "carol-token-0123456789"


def test_the_arena_sizes_are_read_from_the_tenants_file() -> None:
    config = parse_config(
        {
            "principal": {"bob": {"arena_bytes": 4096}, "carol": {}},
            "arenas": {"principal_bytes": 8192, "total_bytes": 65536},
        }
    )
    assert config.arenas.principal_bytes == 8192 and config.arenas.total_bytes == 65536
    bob = config.by_name("bob")
    assert bob is not None and bob.arena_bytes == 4096
    assert parse_config({"principal": {"bob": {}}}).arenas.total_bytes is None
    for bad in (
        {"principal": {"bob": {"arena_bytes": 0}}},
        {"principal": {"bob": {"arena_bytes": "1"}}},
        {"principal": {"bob": {"arena_bytes": True}}},
        {"principal": {"bob": {}}, "arenas": {"principal_bytes": -1}},
        {"principal": {"bob": {}}, "arenas": {"total_bytes": 1.5}},
        {"principal": {"bob": {}}, "arenas": {"per_principal": 1}},
        {"principal": {"bob": {}}, "arenas": 3},
    ):
        with pytest.raises(InvalidArgument):
            parse_config(bad)


def _config(path: Path) -> Path:
    """bob: this Unix user, a 128 KiB arena; carol: this Unix group by a token, an arena
    of principal_bytes (1 MiB) that the total bound (640 KiB) has no room for."""
    path.write_text(
        f"""
[principal.bob]
uids = [{os.geteuid()}]
arena_bytes = {128 * KiB}

[principal.carol]
gids = [{os.getegid()}]
token_sha256 = "{token_digest(CAROL)}"

[arenas]
principal_bytes = {1024 * KiB}
total_bytes = {640 * KiB}
"""
    )
    return path


def test_each_principals_arena_is_its_size_within_the_total(tmp_path: Path) -> None:
    srv = tenant_server(tmp_path / "store", _config(tmp_path / "t.toml")).start()
    n = IDENT.layout.tokens_per_chunk
    try:
        with RemoteStore(srv.socket, timeout=30) as bob:
            conn = bob._wire.connected()
            assert conn.arena is not None and conn.arena_bytes == 128 * KiB
            arena = Path(conn.hello["arena"])
            assert arena.name.endswith("-t-bob") and arena.stat().st_size == 128 * KiB
            mine = Namespace(NamespaceKind.USER, "bob")
            # 40 chunks staged at a page each are more than his 32 pages: the server
            # refuses to stage them, naming his arena, and stores nothing of them
            tokens, kv = prompt_kv(31, 40 * n)
            prompt = PromptRef(IDENT, mine, tokens)
            with pytest.raises(StorageFullError, match=r"principal bob's arena \(131072 bytes"):
                bob._wire.call("prepare_put", protocol.encode_prompt(prompt))
            assert bob.lookup(IDENT, mine, tokens).hits == []
            # his client then puts them through the socket: the server copies what his
            # arena has no room for into its own (served to him as copies)
            assert bob.put_prompt(IDENT, mine, tokens, kv).stored == 40
            hit = bob.lookup(IDENT, mine, tokens)
            assert isinstance(hit, RemoteLookup) and len(hit.hits) == 40
            assert 0 < sum(1 for g in hit.hints[1::2] if g) < 40  # some in his arena, not all
            got = bob.load(hit)
            assert got.loaded == 40 and all(
                np.array_equal(a, kv[:, :, :, i * n : (i + 1) * n])
                for i, a in enumerate(got.arrays)
            )
            # and a prepare_put (the vLLM connector's) is held and sent so by its commit
            more, kv2 = prompt_kv(32, 40 * n)
            held = bob.prepare_put(IDENT, mine, more, kv2)
            assert held.held is not None and bob.commit_put(held).stored == 40
        with RemoteStore(srv.socket, timeout=30, token=CAROL) as carol:
            # 1 MiB more would pass the 640 KiB bound: no arena, the socket instead
            assert carol._wire.connected().arena is None
            assert not list(arena.parent.glob(arena.name.replace("-t-bob", "-t-carol")))
            ns = Namespace(NamespaceKind.USER, "carol")
            tokens, kv = prompt_kv(33, 4 * n)
            assert carol.put_prompt(IDENT, ns, tokens, kv).stored == 4
            got = carol.load(carol.lookup(IDENT, ns, tokens))
            assert got.loaded == 4 and np.array_equal(got.arrays[3], kv[:, :, :, 3 * n :])
    finally:
        srv.stop()


def test_a_copy_its_home_arena_has_no_room_for_lives_in_the_tiers_arena(tmp_path: Path) -> None:
    tier = ShmTier(1 << 20, "dram", tmp_path / "a", 1 << 20)
    home = Arena(
        tmp_path / "b", 8 * KiB, populate_pages=False, owner=Owner(os.geteuid(), os.getegid())
    )
    tier.add_arena("b", home)
    tier.home = lambda meta: home
    try:
        keys = [ChunkKey(bytes([i]) * 32) for i in range(3)]
        payloads = [np.full(4096, i, np.uint8) for i in range(3)]
        tier.store([ReplicaMeta(k, "uint8", (4096,)) for k in keys], payloads)
        assert tier.home_overflow == 1
        assert tier.hint(keys[0], home) is not None and tier.hint(keys[1], home) is not None
        assert tier.hint(keys[2], home) is None and tier.hint(keys[2]) is not None
        for k, p in zip(keys, payloads, strict=True):
            assert np.array_equal(tier.read(k), p)
    finally:
        tier.close()

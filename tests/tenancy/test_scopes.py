"""The tenancy rules without a server: names, principals and tokens, scopes and the
store's secret (the served behaviour is in tests/server/test_tenants.py)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import blake3
import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.core.errors import InvalidArgument, NotAuthenticated, NotPermitted, StorePathError
from kvlife.core.identity import PUBLIC, Namespace, NamespaceKind, prompt_chunk_keys
from kvlife.tenancy import Principal, Scopes, TenancyConfig, check_name, store_secret, token_digest
from kvlife.tenancy.names import NAME_PATTERN
from kvlife.tenancy.principals import REFUSED, parse_config
from kvlife.tenancy.secret import SECRET_FILE
from tests.helpers.workload import IDENTITY

SECRET = bytes(range(32))
ALICE = Principal("alice", frozenset({1000}), organisation="acme")
BOB = Principal("bob", frozenset({1001}), organisation="acme")
ROOT = Principal("root", frozenset({0}), admin=True)
SEPARATORS = ":/\\\0\n\r\t "


@given(st.text(max_size=40))
@settings(max_examples=300, deadline=None)
def test_a_name_is_accepted_exactly_when_it_has_no_separator_or_control(name: str) -> None:
    bad = (
        not name
        or len(name) > 128
        or not (name[0].isalnum() or name[0] == "_")
        or any(c in SEPARATORS or not c.isascii() or not c.isprintable() for c in name)
        or not all(c.isalnum() or c in "_.@+=-" for c in name)
    )
    if bad:
        with pytest.raises(InvalidArgument):
            check_name("name", name)
    else:
        assert check_name("name", name) == name


@given(st.text(min_size=1, max_size=20), st.sampled_from([*SEPARATORS, "\x7f", "\x1b"]))
@settings(max_examples=200, deadline=None)
def test_a_request_id_with_a_separator_or_control_is_refused(prefix: str, bad: str) -> None:
    scopes = Scopes(SECRET)
    with pytest.raises(InvalidArgument):
        scopes.named(ALICE, f"request:{prefix}{bad}")
    with pytest.raises(InvalidArgument):
        scopes.for_write(ALICE, f"request:{bad}{prefix}")


@given(st.text(min_size=1, max_size=20))
@settings(max_examples=200, deadline=None)
def test_no_request_id_names_another_principals_request(rid: str) -> None:
    """Whatever id alice names, her request namespace is never one bob could name."""
    scopes = Scopes(SECRET)
    try:
        mine = scopes.named(ALICE, f"request:{rid}")
    except InvalidArgument:
        return
    assert mine.name.startswith("alice/")
    assert not Scopes.may_read(BOB, str(mine))
    assert Scopes.may_read(ALICE, str(mine))


def test_scopes_are_the_principals_own_and_keyed() -> None:
    scopes = Scopes(SECRET)
    assert str(scopes.named(ALICE, "user")) == "user:alice"
    assert str(scopes.named(ALICE, "user:alice")) == "user:alice"
    assert str(scopes.named(ALICE, "organisation")) == "organisation:acme"
    assert str(scopes.named(ALICE, "request:r1")) == "request:alice/r1"
    for text in ("user:bob", "organisation:globex"):
        with pytest.raises(NotPermitted):
            scopes.named(ALICE, text)
    with pytest.raises(NotPermitted):
        scopes.named(Principal("solo"), "organisation")
    for text in ("tenant:x", "", "user:", "public:x"):
        with pytest.raises((InvalidArgument, NotPermitted)):
            scopes.named(ALICE, text)
    # the salt is keyed: not the client-computable salt of the same namespace, and
    # another store's secret gives other keys
    ns = scopes.named(ALICE, "user")
    assert ns.keyed and ns.salt != Namespace(NamespaceKind.USER, "alice").salt
    assert ns.salt != Scopes(bytes(32)).named(ALICE, "user").salt
    assert scopes.named(ALICE, "public").salt != PUBLIC.salt
    keys = prompt_chunk_keys(IDENTITY, ns, list(range(64)))
    assert keys != prompt_chunk_keys(
        IDENTITY, Namespace(NamespaceKind.USER, "alice"), list(range(64))
    )


def test_the_keyed_salt_is_blake3_keyed_over_the_v1_encoding() -> None:
    """Rebuilt independently of kvlife.core.identity (a change of format fails here)."""
    encoded = msgpack.packb(["kvlife.namespace.v1", "user", "alice"])
    want = blake3.blake3(encoded, key=SECRET).digest()
    assert Scopes(SECRET).named(ALICE, "user").salt == want
    assert Namespace(NamespaceKind.USER, "alice").salt == blake3.blake3(encoded).digest()
    with pytest.raises(InvalidArgument):
        Namespace(NamespaceKind.USER, "alice", salt_key=b"short")


def test_reads_search_most_private_first_and_public_is_written_by_admins_only() -> None:
    scopes = Scopes(SECRET)
    chain = [str(n) for n in scopes.for_read(ALICE, "request:r1")]
    assert chain == ["request:alice/r1", "user:alice", "organisation:acme", "public"]
    assert [str(n) for n in scopes.for_read(Principal("solo"), "user")] == ["user:solo", "public"]
    assert [str(n) for n in scopes.for_read(ALICE, "public")] == ["public"]
    with pytest.raises(NotPermitted):
        scopes.for_write(ALICE, "public")
    assert str(scopes.for_write(ROOT, "public")) == "public"
    assert str(scopes.for_write(ALICE, "organisation")) == "organisation:acme"
    assert Scopes.may_read(BOB, "organisation:acme") and not Scopes.may_read(BOB, "user:alice")
    assert not Scopes.may_read(ALICE, "request:alicex/1")
    assert not Scopes.may_read(ALICE, "weird")


def test_tokens_forged_expired_or_malformed_are_refused_alike() -> None:
    good = "a" * 32
    config = TenancyConfig(
        (
            Principal("alice", token_sha256=bytes.fromhex(token_digest(good))),
            Principal(
                "old", token_sha256=bytes.fromhex(token_digest("b" * 32)), token_expires=100.0
            ),
        )
    )
    assert config.by_token(good).name == "alice"
    for bad in ("a" * 31 + "b", "b" * 32, "", "x", 7, None, "a" * 300):
        with pytest.raises(NotAuthenticated) as err:
            config.by_token(bad, now=200.0)
        assert str(err.value) == REFUSED
    assert config.by_token("b" * 32, now=99.0).name == "old"


def test_configuration_is_checked() -> None:
    ok = parse_config({"principal": {"alice": {"uids": [5], "organisation": "acme"}}})
    assert ok.by_peer(5, None) == Principal("alice", frozenset({5}), organisation="acme")
    assert ok.by_peer(6, 5) is None
    bad: list[dict[str, object]] = [
        {},
        {"principals": {}},
        {"principal": {"a/b": {}}},
        {"principal": {"alice": {"uid": [1]}}},
        {"principal": {"alice": {"uids": ["1"]}}},
        {"principal": {"alice": {"token_sha256": "zz"}}},
        {"principal": {"alice": {"token_sha256": "ab"}}},
        {"principal": {"alice": {"token_expires": 5}}},
        {"principal": {"alice": {"organisation": "a:b"}}},
        {"principal": {"a": {"uids": [1]}, "b": {"uids": [1]}}},
    ]
    for data in bad:
        with pytest.raises(InvalidArgument):
            parse_config(data)


def test_the_secret_is_made_once_private_and_refused_if_exposed(tmp_path: Path) -> None:
    first = store_secret(tmp_path)
    path = tmp_path / SECRET_FILE
    assert len(first) == 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert store_secret(tmp_path) == first
    os.chmod(path, 0o644)
    with pytest.raises(StorePathError):
        store_secret(tmp_path)
    os.chmod(path, 0o600)
    path.write_bytes(b"short")
    with pytest.raises(StorePathError):
        store_secret(tmp_path)
    assert NAME_PATTERN.pattern.startswith("[A-Za-z0-9_]")

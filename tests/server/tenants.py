"""Principals for the tests of a ``kvlife serve --tenants`` (tokens tell them apart: the
tests run as one Unix user; tests/server/test_tenants.py adds a second one when root)."""

from __future__ import annotations

from pathlib import Path

from kvlife.client import RemoteStore
from kvlife.core.identity import PUBLIC, Namespace, NamespaceKind
from kvlife.tenancy import token_digest
from tests.server.conftest import MiB, ServerProc

TOKENS = {
    "alice": "alice-token-0123456789",
    "bob": "bob-token-0123456789ab",
    "root": "root-token-0123456789a",
    "old": "old-token-0123456789ab",
}
"""Each principal's token (the configuration holds their SHA-256 only)."""

USER = {name: Namespace(NamespaceKind.USER, name) for name in TOKENS}
ORG = {"alice": Namespace(NamespaceKind.ORGANISATION, "acme")}
SCOPES_OF_BOB = [
    USER["bob"],
    Namespace(NamespaceKind.ORGANISATION, "globex"),
    Namespace(NamespaceKind.REQUEST, "r1"),
    PUBLIC,
]
"""Every scope bob may name."""


def write_config(path: Path, extra: str = "", bob_uid: int | None = None) -> Path:
    """alice (org acme), bob (org globex), root (admin), old (an expired token); no
    principal for this Unix user without a token, unless ``extra`` adds one. Every one
    is a token only (its sessions map no arena: puts and loads through the socket),
    unless ``bob_uid`` names bob's Unix user (his sessions from it map his own arena)."""
    bob_uids = f"uids = [{bob_uid}]" if bob_uid is not None else ""
    path.write_text(
        f"""
[principal.alice]
organisation = "acme"
token_sha256 = "{token_digest(TOKENS["alice"])}"

[principal.bob]
organisation = "globex"
{bob_uids}
token_sha256 = "{token_digest(TOKENS["bob"])}"

[principal.root]
admin = true
token_sha256 = "{token_digest(TOKENS["root"])}"

[principal.old]
token_sha256 = "{token_digest(TOKENS["old"])}"
token_expires = 1000000000
{extra}
"""
    )
    return path


def tenant_server(store: Path, config: Path, dram: int = 16 * MiB) -> ServerProc:
    return ServerProc(store, dram=dram, extra=("--tenants", str(config)))


def as_(server: ServerProc, who: str) -> RemoteStore:
    """A client of ``server`` that is principal ``who`` (by its token)."""
    return RemoteStore(server.socket, timeout=30, token=TOKENS[who])

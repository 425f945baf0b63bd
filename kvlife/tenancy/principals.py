"""Principals: who is connected to ``kvlife serve``, from the server's configuration.

A principal is named by the server's configuration (``kvlife serve --tenants FILE``, a
TOML file) and reached in one of two ways:

- **the peer's Unix credentials** (``SO_PEERCRED`` of the connection: uid, then primary
  gid; the kernel fills them, the client cannot choose them), for processes on this
  host;
- **a token** (sent in ``hello``), for what credentials cannot name (a remote tier's
  hosts, or two principals that run as one Unix user). The configuration holds only the
  token's SHA-256; a presented token is compared against every principal's digest in
  constant time (``hmac.compare_digest``, no early exit), and a token past its
  ``token_expires`` is refused like a forged one (:class:`NotAuthenticated`, one message).

The file::

    [principal.alice]
    uids = [1000]              # Unix users that are alice (SO_PEERCRED uid)
    gids = []                  # or primary groups
    organisation = "acme"      # the organisation scope alice reads and writes
    admin = false              # an admin writes public and sees the whole store
    token_sha256 = "9f86d0…"   # hex SHA-256 of alice's token (kvlife.tenancy.token_digest)
    token_expires = 1798761600 # Unix seconds; absent: no expiry
    shares = { dram = 33554432 }  # bytes of each tier (quotas, kvlife.tenancy.quotas)

    [organisation.acme]            # the organisation scope's own shares
    shares = { dram = 16777216 }

    [public]                       # the public scope's own shares
    shares = { dram = 16777216 }

    [arenas]                       # shared memory of the principals' own arenas
    principal_bytes = 268435456    # each principal's (default: the tier's arena size)
    total_bytes = 1073741824       # all of them together (default: no bound)

A principal's own ``arena_bytes`` overrides ``principal_bytes`` for it
(:mod:`kvlife.server.shm_arenas`).
"""

from __future__ import annotations

import hashlib
import hmac
import time
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvlife.core.errors import InvalidArgument, NotAuthenticated
from kvlife.tenancy.names import check_name
from kvlife.tenancy.quotas import PUBLIC_TENANT, Shares, parse_shares

MIN_TOKEN = 16
MAX_TOKEN = 256
"""Length bounds of a token (characters)."""

REFUSED = "not authenticated: no principal for this connection (token or credentials)"
"""The one message of every refusal: it never says whether a token was unknown, forged
or expired, or which credentials were tried."""


def token_digest(token: str) -> str:
    """The hex SHA-256 of ``token``: what the configuration holds (``token_sha256``)."""
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Principal:
    """One tenant of the server."""

    name: str
    """The principal's name: its user scope is ``user:<name>``."""
    uids: frozenset[int] = frozenset()
    """Unix users that connect as this principal."""
    gids: frozenset[int] = frozenset()
    """Primary Unix groups that connect as this principal (after uids: a uid wins)."""
    organisation: str = ""
    """The organisation whose scope it reads and writes (empty: none)."""
    admin: bool = False
    """An authority: writes the public scope, runs store-wide verbs, sees every figure."""
    token_sha256: bytes = field(default=b"", repr=False)
    """SHA-256 of its token (empty: no token)."""
    token_expires: float | None = None
    """Unix time after which its token is refused (None: never)."""
    arena_bytes: int | None = None
    """Size of its own arena (None: ``[arenas] principal_bytes``)."""

    def __post_init__(self) -> None:
        check_name("principal name", self.name)
        _size(f"principal {self.name}: arena_bytes", self.arena_bytes)
        if self.organisation:
            check_name(f"principal {self.name}'s organisation", self.organisation)
        for what, ids in (("uids", self.uids), ("gids", self.gids)):
            if not isinstance(ids, frozenset) or any(
                type(i) is not int or not 0 <= i < 2**32 for i in ids
            ):
                raise InvalidArgument(f"principal {self.name}: {what} must be ints in [0, 2**32)")
        if self.token_sha256 and len(self.token_sha256) != hashlib.sha256().digest_size:
            raise InvalidArgument(f"principal {self.name}: token_sha256 must be 32 bytes")
        if self.token_expires is not None and not self.token_sha256:
            raise InvalidArgument(f"principal {self.name}: token_expires without a token")


def _size(what: str, value: object) -> None:
    if value is not None and (type(value) is not int or value <= 0):
        raise InvalidArgument(f"{what} must be a positive int (bytes), got {value!r}")


@dataclass(frozen=True, slots=True)
class ArenaBudget:
    """Shared memory of the principals' own arenas (``[arenas]``)."""

    principal_bytes: int | None = None
    """Each principal's arena (None: as large as the tier's own arena); a principal's
    ``arena_bytes`` overrides it. Never more than the tier's own arena."""
    total_bytes: int | None = None
    """All principals' arenas together (None: no bound). An arena is made at its
    principal's first ``hello`` and kept until the server stops, so the first to come
    get theirs; a principal whose arena would pass the bound gets none (its sessions put
    and load through the socket)."""

    def __post_init__(self) -> None:
        _size("[arenas] principal_bytes", self.principal_bytes)
        _size("[arenas] total_bytes", self.total_bytes)


@dataclass(frozen=True, slots=True)
class TenancyConfig:
    """Every principal of a server; a uid, gid or token names at most one (a token shared
    by two would silently name whichever is compared last)."""

    principals: tuple[Principal, ...]
    shares: Shares = ()
    """Each tenant's bytes per tier (:mod:`kvlife.tenancy.quotas`); empty: no quotas."""
    arenas: ArenaBudget = ArenaBudget()
    """The principals' arenas' sizes (:mod:`kvlife.server.shm_arenas`)."""

    def __post_init__(self) -> None:
        seen: dict[str, str] = {}
        for p in self.principals:
            keys = [f"name {p.name}"] + [f"uid {u}" for u in p.uids] + [f"gid {g}" for g in p.gids]
            if p.token_sha256:
                keys.append(f"token_sha256 {p.token_sha256.hex()}")
            for k in keys:
                if k in seen:
                    raise InvalidArgument(
                        f"tenancy configuration: {k} belongs to {seen[k]} and {p.name}"
                    )
                seen[k] = p.name

    def by_name(self, name: str) -> Principal | None:
        return next((p for p in self.principals if p.name == name), None)

    def by_peer(self, uid: int | None, gid: int | None) -> Principal | None:
        """The principal of a peer's credentials: its uid's, else its primary gid's."""
        if uid is not None:
            for p in self.principals:
                if uid in p.uids:
                    return p
        if gid is not None:
            for p in self.principals:
                if gid in p.gids:
                    return p
        return None

    def by_token(self, token: object, now: float | None = None) -> Principal:
        """The principal whose token this is, not expired; NotAuthenticated (one message
        for forged, unknown and expired) otherwise. Every digest is compared, in
        constant time each, whichever matches."""
        if not isinstance(token, str) or not MIN_TOKEN <= len(token) <= MAX_TOKEN:
            raise NotAuthenticated(REFUSED)
        presented = hashlib.sha256(token.encode()).digest()
        found: Principal | None = None
        for p in self.principals:
            if p.token_sha256 and hmac.compare_digest(presented, p.token_sha256):
                found = p
        when = time.time() if now is None else now
        if found is None or (found.token_expires is not None and when >= found.token_expires):
            raise NotAuthenticated(REFUSED)
        return found


_KEYS = {
    "uids",
    "gids",
    "organisation",
    "admin",
    "token_sha256",
    "token_expires",
    "shares",
    "arena_bytes",
}


def parse_config(data: Mapping[str, object]) -> TenancyConfig:
    """A configuration from its parsed TOML (InvalidArgument naming what is wrong)."""
    unknown = set(data) - {"principal", "organisation", "public", "arenas"}
    if unknown:
        raise InvalidArgument(f"tenancy configuration: unknown sections {sorted(unknown)}")
    table = data.get("principal", {})
    if not isinstance(table, dict) or not table:
        raise InvalidArgument("tenancy configuration: no [principal.NAME] tables")
    out = []
    shares: list[tuple[str, tuple[tuple[str, int], ...]]] = []
    for name, spec in table.items():
        if not isinstance(spec, dict):
            raise InvalidArgument(f"tenancy configuration: principal.{name} must be a table")
        extra = set(spec) - _KEYS
        if extra:
            raise InvalidArgument(f"principal {name}: unknown keys {sorted(extra)}")
        out.append(_principal(name, spec))
        if "shares" in spec:
            shares.append((f"user:{name}", parse_shares(f"principal {name}", spec["shares"])))
    orgs = data.get("organisation", {})
    if not isinstance(orgs, dict):
        raise InvalidArgument("tenancy configuration: organisation must hold [organisation.NAME]")
    for name, spec in orgs.items():
        check_name("organisation", name)
        if not isinstance(spec, dict) or set(spec) - {"shares"}:
            raise InvalidArgument(f"organisation {name}: only a shares table is known")
        if "shares" in spec:
            shares.append(
                (f"organisation:{name}", parse_shares(f"organisation {name}", spec["shares"]))
            )
    public = data.get("public", {})
    if not isinstance(public, dict) or set(public) - {"shares"}:
        raise InvalidArgument("tenancy configuration: [public] holds only a shares table")
    if "shares" in public:
        shares.append((PUBLIC_TENANT, parse_shares("public", public["shares"])))
    arenas = data.get("arenas", {})
    if not isinstance(arenas, dict) or set(arenas) - {"principal_bytes", "total_bytes"}:
        raise InvalidArgument(
            "tenancy configuration: [arenas] holds only principal_bytes and total_bytes"
        )
    budget = ArenaBudget(arenas.get("principal_bytes"), arenas.get("total_bytes"))
    return TenancyConfig(tuple(out), tuple(shares), budget)


def _principal(name: str, spec: dict[str, object]) -> Principal:
    def ids(key: str) -> frozenset[int]:
        value = spec.get(key, [])
        if not isinstance(value, list):
            raise InvalidArgument(f"principal {name}: {key} must be a list of ints")
        return frozenset(value)

    org = spec.get("organisation", "")
    admin = spec.get("admin", False)
    digest = spec.get("token_sha256", "")
    expires = spec.get("token_expires")
    if not isinstance(org, str) or not isinstance(admin, bool) or not isinstance(digest, str):
        raise InvalidArgument(
            f"principal {name}: organisation and token_sha256 are strings, admin a bool"
        )
    if expires is not None and (type(expires) not in (int, float) or isinstance(expires, bool)):
        raise InvalidArgument(f"principal {name}: token_expires must be Unix seconds")
    try:
        raw = bytes.fromhex(digest)
    except ValueError:
        raise InvalidArgument(f"principal {name}: token_sha256 must be hex") from None
    return Principal(
        name,
        ids("uids"),
        ids("gids"),
        org,
        admin,
        raw,
        None if expires is None else float(expires),  # type: ignore[arg-type]
        spec.get("arena_bytes"),  # type: ignore[arg-type]  # checked by Principal
    )


def load_config(path: Path) -> TenancyConfig:
    """The configuration in the TOML file ``path`` (InvalidArgument if unreadable)."""
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise InvalidArgument(f"cannot read the tenancy configuration {path}: {exc}") from None
    return parse_config(data)

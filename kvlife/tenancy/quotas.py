"""Quotas: each tenant's byte share of each tier, and which tenant an object belongs to.

A store built with shares (:attr:`kvlife.store.config.StoreConfig.tenant_shares`) gives
each tier that has shares a :class:`~kvlife.policy.shares.TenantShares` policy: when the
tier needs room, every victim comes from the tenant furthest over its share, so while the
shares of a tier add up to no more than its capacity, one tenant's burst evicts only its
own objects (a tenant within its share loses none). ``kvlife serve --tenants FILE``
takes the shares from ``FILE``:

    [principal.alice]
    shares = { dram = 33554432, disk = 1073741824 }   # bytes per tier name

    [organisation.acme]          # the organisation scope's own budget
    shares = { dram = 16777216 }

    [public]                     # the public scope's own budget
    shares = { dram = 16777216 }

The tenant of an object is decided by its namespace alone (:func:`tenant_of_namespace`):
a principal's request and user scopes are charged to ``user:<principal>``, an
organisation's scope to ``organisation:<org>``, the public scope to ``public``. A tenant
without a share in a tier has share 0 there: the first to lose objects when the tier is
full. Shares are in bytes of the tier (framing included, as the placement engine charges
them).
"""

from __future__ import annotations

from collections.abc import Mapping

from kvlife.core.errors import InvalidArgument
from kvlife.core.identity import NamespaceKind
from kvlife.tenancy.names import REQUEST_SEPARATOR

PUBLIC_TENANT = "public"
UNSCOPED = ""
"""The tenant of an object whose namespace is none of a principal's (share 0)."""

Shares = tuple[tuple[str, tuple[tuple[str, int], ...]], ...]
"""``((tenant, ((tier, bytes), ...)), ...)``: hashable, as a frozen config wants it."""


def tenant_of_namespace(stored: str) -> str:
    """The tenant charged for an object of the namespace whose text is ``stored``
    (``str(Namespace)``, as an object's record holds it)."""
    kind, _, name = stored.partition(":")
    if kind == NamespaceKind.REQUEST.value:
        owner = name.partition(REQUEST_SEPARATOR)[0]
        return f"user:{owner}" if owner else UNSCOPED
    if kind == NamespaceKind.USER.value:
        return f"user:{name}" if name else UNSCOPED
    if kind == NamespaceKind.ORGANISATION.value:
        return f"organisation:{name}" if name else UNSCOPED
    if kind == NamespaceKind.PUBLIC.value:
        return PUBLIC_TENANT
    return UNSCOPED


def parse_shares(owner: str, value: object) -> tuple[tuple[str, int], ...]:
    """A ``shares = {tier = bytes, ...}`` table of ``owner`` (InvalidArgument naming what
    was wrong)."""
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"{owner}: shares must be a table of tier name = bytes")
    out = []
    for tier, nbytes in value.items():
        if not isinstance(tier, str) or not tier:
            raise InvalidArgument(f"{owner}: shares names a tier by a non-empty string")
        if type(nbytes) is not int or nbytes < 0:
            raise InvalidArgument(f"{owner}: share of tier {tier} must be an int >= 0 (bytes)")
        out.append((tier, nbytes))
    return tuple(sorted(out))


def by_tier(shares: Shares) -> dict[str, dict[str, int]]:
    """Tier name -> tenant -> bytes."""
    out: dict[str, dict[str, int]] = {}
    for tenant, tiers in shares:
        for tier, nbytes in tiers:
            out.setdefault(tier, {})[tenant] = nbytes
    return out

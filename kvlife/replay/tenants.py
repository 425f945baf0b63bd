"""Quotas in the replay simulator: each tier's shares between a trace's tenants.

``kvlife replay --tenant-shares SPEC`` gives every tier of the simulator a
:class:`~kvlife.policy.shares.TenantShares` policy (the replay's ``--policy`` within each
tenant), exactly the policy a store built from ``kvlife serve --tenants`` uses, so the
simulator enforces the same quotas as the live store:

- ``equal``: every tenant of the trace gets an equal share of each tier;
- ``a=0.5,b=0.25``: the named tenants get those fractions of each tier (others: 0).

A trace without tenant labels (Mooncake's) can be given tenants derived from its
structure (``kvlife replay --derive-tenants user|organisation``, :func:`derive_tenants`:
a conversation chain is a user, requests with the same first two blocks an
organisation). A block's tenant is the tenant of the first request of the trace that holds it (block
ids are prefix-chained: the same id is the same KV, so a block shared by two tenants
is charged to the one that brought it in; a trace replayed per scope, as the
sharing-scope experiment does, has no such block).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
from numpy.typing import NDArray

from kvlife.core.errors import InvalidArgument
from kvlife.policy.base import EvictionPolicy, make_policy
from kvlife.policy.shares import TenantShares
from kvlife.trace.model import Trace


def block_owners(trace: Trace) -> dict[int, str]:
    """Each block id -> the tenant (name) of the first request that holds it."""
    names = trace.tenant_names
    reps = np.repeat(trace.tenants, np.diff(trace.offsets))
    ids, first = np.unique(trace.blocks, return_index=True)
    return {int(b): names[int(reps[i])] for b, i in zip(ids.tolist(), first.tolist(), strict=True)}


def parse_tenant_shares(spec: str, trace: Trace) -> dict[str, float]:
    """Fractions of a tier per tenant from ``equal`` or ``name=fraction,...``
    (InvalidArgument naming what was wrong; fractions must add up to at most 1)."""
    spec = spec.strip()
    if spec == "equal":
        n = len(trace.tenant_names)
        return dict.fromkeys(trace.tenant_names, 1.0 / n)
    out: dict[str, float] = {}
    for part in spec.split(","):
        name, sep, value = part.partition("=")
        try:
            frac = float(value)
        except ValueError:
            frac = -1.0
        if not sep or not name or not 0.0 <= frac <= 1.0:
            raise InvalidArgument(
                f"tenant shares {spec!r}: use 'equal' or name=fraction,... (0 <= fraction <= 1)"
            )
        out[name.strip()] = frac
    if sum(out.values()) > 1.0 + 1e-9:
        raise InvalidArgument(f"tenant shares {spec!r} add up to more than the tier")
    return out


def shares_policy(
    policy: str, capacity: int, fractions: Mapping[str, float], owners: Mapping[int, str]
) -> TenantShares[object, str]:
    """One tier's policy: ``policy`` within each tenant, ``fractions`` of ``capacity``
    blocks as the shares, each block's tenant from ``owners``."""
    shares = {t: int(capacity * f) for t, f in fractions.items()}

    def tenant_of(key: object) -> str:
        return owners.get(key, "")  # type: ignore[call-overload,no-any-return]

    def inner() -> EvictionPolicy[object]:
        return make_policy(policy)

    return TenantShares(tenant_of, shares, inner=inner)


@dataclass(frozen=True, slots=True)
class Tenants:
    """A user and an organisation for every request of a trace."""

    user: NDArray[np.int64]
    org: NDArray[np.int64]
    rule: str
    """How they were found (ground truth, or the derivation rule)."""

    @property
    def n_users(self) -> int:
        return int(self.user.max()) + 1 if self.user.size else 0

    @property
    def n_orgs(self) -> int:
        return int(self.org.max()) + 1 if self.org.size else 0


DERIVED_RULE = (
    "user: a request extending all but the last block of an earlier request joins that "
    "request's user (a conversation); organisation: requests with the same first two "
    "blocks; a user belongs to the organisation of its first request"
)


def derive_tenants(trace: Trace) -> Tenants:
    """Users and organisations of a trace without ids, by :data:`DERIVED_RULE`."""
    n = trace.n_requests
    blocks = trace.blocks.tolist()
    offs = trace.offsets.tolist()
    user = np.zeros(n, np.int64)
    org = np.zeros(n, np.int64)
    ends: dict[int, int] = {}
    """A prefix (the id of its last block) that a later request may extend -> its user."""
    orgs: dict[int, int] = {}
    org_of_user: list[int] = []
    for r in range(n):
        req = blocks[offs[r] : offs[r + 1]]
        found = -1
        for k in range(len(req) - 1, 0, -1):  # longest first; at least two blocks
            u = ends.get(req[k])
            if u is not None:
                found = u
                break
        if found < 0:
            found = len(org_of_user)
            head = req[1] if len(req) > 1 else (req[0] if req else -1)
            org_of_user.append(orgs.setdefault(head, len(orgs)))
        user[r] = found
        org[r] = org_of_user[found]
        if len(req) >= 2:
            ends[req[-2]] = found  # all but the (partial) last block
        if req:
            ends[req[-1]] = found
    return Tenants(user, org, DERIVED_RULE)


def with_derived_tenants(trace: Trace, level: str) -> Trace:
    """``trace`` labelled with derived users or organisations (``level``)."""
    tenants = derive_tenants(trace)
    if level == "user":
        ids, prefix = tenants.user, "user"
    elif level == "organisation":
        ids, prefix = tenants.org, "org"
    else:
        raise InvalidArgument(f"derived tenants: 'user' or 'organisation', got {level!r}")
    n = int(ids.max()) + 1 if ids.size else 1
    return replace(
        trace, tenants=ids.astype(np.int32), tenant_names=tuple(f"{prefix}{i}" for i in range(n))
    )

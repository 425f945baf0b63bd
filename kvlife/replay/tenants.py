"""Quotas in the replay simulator: each tier's shares between a trace's tenants.

``kvlife replay --tenant-shares SPEC`` gives every tier of the simulator a
:class:`~kvlife.policy.shares.TenantShares` policy (the replay's ``--policy`` within each
tenant), exactly the policy a store built from ``kvlife serve --tenants`` uses, so the
simulator enforces the same quotas as the live store:

- ``equal``: every tenant of the trace gets an equal share of each tier;
- ``a=0.5,b=0.25``: the named tenants get those fractions of each tier (others: 0).

A block's tenant is the tenant of the first request of the trace that holds it (block
ids are prefix-chained: the same id is the same KV, so a block shared by two tenants
is charged to the one that brought it in; a trace replayed per scope, as the
sharing-scope experiment does, has no such block).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

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

"""``kvlife experiment sharing-scope``: what sharing KV beyond a user buys, and what it leaks.

A trace with tenants is replayed by the store's placement engine (the replay simulator,
:class:`~kvlife.replay.cache.CacheSim`) four times, once per sharing scope, at the same
capacity: a block is reusable only by requests of the same **request** (no reuse across
requests), the same **user**, the same **organisation**, or by everyone (**global**, the
undefended prefix cache). Per scope it reports:

- ``hit_ratio``: prefix blocks served from the cache over all prompt blocks;
- ``cross_user_hit_fraction``: of those hits, the fraction on blocks the requesting user
  had never sent itself (only another user can have put them: each such hit is an
  existence signal about another user's prompt); ``cross_org_hit_fraction`` likewise
  for blocks no user of its organisation had sent;
- ``bytes_per_tenant``: KV bytes each user stored (summary over users: total, median,
  largest, the largest user's fraction);
- ``eviction_skew``: the tenth of the users who lost the most blocks to eviction, their
  fraction of the evictions over their fraction of the stored blocks (1: evictions fall
  on users as they store; above 1: some users lose more than they bring).

**Tenants of the Mooncake conversation trace**, which has no user ids, are derived from
its structure (block ids are prefix-chained, so one id names a whole prefix):

- a request *extends* an earlier one when it starts with all of that request's blocks
  but its last (the last block of a prompt is partial: the next turn re-hashes it); it
  then belongs to the same **user** (a conversation is the chain of requests extending
  one another; the most recent such request wins);
- requests whose first two blocks agree form one **organisation** (a shared system
  prompt or template); a user belongs to the organisation of its first request.

Two requests that share a system prompt and a one-block question are merged into one
user by this rule (the trace cannot tell them apart): the user scope is, if anything,
credited with reuse that belongs to the organisation.

A **seeded synthetic multi-tenant workload** (:func:`synthetic_tenants`) has true user
and organisation ids: organisations with a system prompt each, users with multi-turn
conversations, and a few documents that users of every organisation quote.

**Quotas beside LMCache's IsolatedLRU** (:func:`quota_comparison`): tenants with a steady
working set, one of which bursts with unique prompts; the same budgets (capacity over
tenants) under plain LRU (one budget), kvlife's :class:`~kvlife.policy.shares.TenantShares`
LMCache 0.5.6's own ``IsolatedLRUEvictionPolicy``, ``QuotaManager`` and L2 eviction
controller, run in LMCache's interpreter (:func:`lmcache_quota_hits`, arm
``lmcache-isolated-lru``; skipped with a note on how to install it when no LMCache
interpreter is found), and a **re-implementation** of those semantics
(:class:`IsolatedLRUModel`, cited from LMCache's source; it gives the same hits per
request as LMCache's code on this workload, tests/experiments/test_lmcache_quota.py).
Reported: each tenant's hit ratio, and the worst other tenant's hit ratio during the
burst.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvlife.core.errors import InvalidArgument
from kvlife.policy.base import EvictionPolicy, make_policy
from kvlife.policy.shares import TenantShares
from kvlife.replay.cache import DRAM, CacheRun, CacheSim
from kvlife.replay.runner import DEFAULT_KV_BYTES_PER_TOKEN
from kvlife.replay.tenants import Tenants, derive_tenants
from kvlife.trace.importers import read_trace
from kvlife.trace.model import Trace, TraceBuilder

SCOPES = ("request", "user", "organisation", "global")


# ---------------------------------------------------------------------------- tenants


def synthetic_tenants(
    seed: int = 0,
    *,
    orgs: int = 4,
    users_per_org: int = 8,
    conversations: int = 3,
    turns: int = 6,
    system_blocks: int = 4,
    shared_docs: int = 6,
    doc_blocks: int = 6,
    doc_share: float = 0.25,
) -> tuple[Trace, Tenants]:
    """A seeded multi-tenant workload with true users and organisations: each
    organisation has a system prompt; each user holds ``conversations`` conversations of
    ``turns`` turns (each turn's prompt extends the last by 1-3 blocks); with probability
    ``doc_share`` a conversation quotes one of ``shared_docs`` documents that every
    organisation's users quote (the only reuse across organisations). Arrivals are
    interleaved at random."""
    rng = np.random.default_rng(seed)
    ids = iter(range(1, 1 << 62))
    docs = [[next(ids) for _ in range(doc_blocks)] for _ in range(shared_docs)]
    events: list[tuple[float, int, int, list[int]]] = []
    for o in range(orgs):
        system = [next(ids) for _ in range(system_blocks)]
        for u in range(users_per_org):
            uid = o * users_per_org + u
            for _ in range(conversations):
                t = float(rng.uniform(0, 1000))
                # chained ids: the same blocks after the same prefix have the same ids,
                # so a quoted document after the same system prompt is reusable across
                # the organisation's users, and across organisations only through a
                # global scope when the prefix is the document itself
                prompt: list[int] = []
                if rng.random() < doc_share:
                    doc = docs[int(rng.integers(shared_docs))]
                    prompt = list(doc) + list(system)
                else:
                    prompt = list(system)
                for _ in range(turns):
                    prompt = prompt + [next(ids) for _ in range(int(rng.integers(1, 4)))]
                    events.append((t, uid, o, list(prompt)))
                    t += float(rng.exponential(20.0))
    events.sort(key=lambda e: e[0])
    b = TraceBuilder(f"synthetic-tenants-seed{seed}", 512)
    for t, uid, o, prompt in events:
        b.add(t, 512 * len(prompt), 64, prompt, tenant=f"org{o}-user{uid}")
    trace = b.build()
    user = np.array([e[1] for e in events], np.int64)
    org = np.array([e[2] for e in events], np.int64)
    return trace, Tenants(user, org, "ground truth (synthetic)")


# ---------------------------------------------------------------------------- scoped replay


def scoped(trace: Trace, tenants: Tenants, scope: str) -> Trace:
    """``trace`` with block ids made private to ``scope``: the same block of two
    requests is the same id only if they share that scope. Its tenants are the users."""
    lens = np.diff(trace.offsets)
    if scope == "global":
        owner = np.zeros(trace.n_requests, np.int64)
    elif scope == "organisation":
        owner = tenants.org
    elif scope == "user":
        owner = tenants.user
    elif scope == "request":
        owner = np.arange(trace.n_requests, dtype=np.int64)
    else:
        raise InvalidArgument(f"scope {scope!r}: one of {SCOPES}")
    per_block = np.repeat(owner, lens)
    _, blocks = np.unique(np.stack([per_block, trace.blocks]), axis=1, return_inverse=True)
    names = tuple(f"user{u}" for u in range(tenants.n_users))
    return replace(
        trace,
        blocks=blocks.reshape(-1).astype(np.int64),
        tenants=tenants.user.astype(np.int32),
        tenant_names=names or ("default",),
    )


class CountingPolicy(EvictionPolicy[object]):
    """Another policy, with its victims counted per tenant (the experiment's view of
    who loses; the choices are the inner policy's)."""

    def __init__(self, inner: EvictionPolicy[object], tenant_of: Callable[[object], int]) -> None:
        self.inner = inner
        self.name = inner.name
        self.tenant_of = tenant_of
        self.victims: dict[int, int] = {}

    def _count(self, got: list[object]) -> None:
        for key in got:
            t = self.tenant_of(key)
            self.victims[t] = self.victims.get(t, 0) + 1

    def insert(self, key: object) -> None:
        self.inner.insert(key)

    def touch(self, key: object) -> None:
        self.inner.touch(key)

    def remove(self, key: object) -> None:
        self.inner.remove(key)

    def evict(self, n: int, protected: Collection[object] = ()) -> list[object] | None:
        got = self.inner.evict(n, protected)
        if got:
            self._count(got)
        return got

    def evict_up_to(self, n: int, protected: Collection[object] = ()) -> list[object]:
        got = self.inner.evict_up_to(n, protected)
        self._count(got)
        return got

    def __contains__(self, key: object) -> bool:
        return key in self.inner

    def __len__(self) -> int:
        return len(self.inner)


def _owners(trace: Trace) -> NDArray[np.int64]:
    """Each (scoped) block id -> the tenant index of its first requester."""
    reps = np.repeat(trace.tenants.astype(np.int64), np.diff(trace.offsets))
    owner = np.full(int(trace.blocks.max()) + 1 if trace.blocks.size else 0, -1, np.int64)
    ids, first = np.unique(trace.blocks, return_index=True)
    owner[ids] = reps[first]
    return owner


def _cross(trace: Trace, tenants: Tenants, run: CacheRun) -> tuple[int, int, int]:
    """(hits, hits on blocks the user never sent before, ... no user of its
    organisation sent before), in the unscoped block ids."""
    blocks = trace.blocks.tolist()
    offs = trace.offsets.tolist()
    prefix = (run.prefix_dram + run.prefix_disk).tolist()
    users, orgs = tenants.user.tolist(), tenants.org.tolist()
    seen_u: dict[int, set[int]] = {}
    seen_o: dict[int, set[int]] = {}
    hits = cross_u = cross_o = 0
    for r in range(trace.n_requests):
        req = blocks[offs[r] : offs[r + 1]]
        su = seen_u.setdefault(users[r], set())
        so = seen_o.setdefault(orgs[r], set())
        p = prefix[r]
        hits += p
        for b in req[:p]:
            if b not in su:
                cross_u += 1
                if b not in so:
                    cross_o += 1
        su.update(req)
        so.update(req)
    return hits, cross_u, cross_o


def eviction_skew(stored: NDArray[Any], evicted: NDArray[Any]) -> float:
    """The tenth of the users who lost the most: their fraction of the evictions over
    their fraction of the stored blocks (1: evictions fall as blocks are stored; 0: no
    eviction)."""
    total_s, total_e = float(stored.sum()), float(evicted.sum())
    users = np.flatnonzero(stored > 0)
    if not total_e or not total_s or not users.size:
        return 0.0
    top = users[np.argsort(-evicted[users], kind="stable")][: max(1, math.ceil(users.size / 10))]
    return float((evicted[top].sum() / total_e) / (stored[top].sum() / total_s))


def run_scope(
    trace: Trace, tenants: Tenants, scope: str, capacity: int, block_bytes: int
) -> dict[str, Any]:
    """One scope at one capacity (blocks)."""
    st = scoped(trace, tenants, scope)
    owner = _owners(st)
    sim = CacheSim("lru", capacity, class_hints=False)
    counting = CountingPolicy(sim.policies[DRAM], lambda k: int(owner[k]))  # type: ignore[call-overload]
    sim.policies[DRAM] = counting
    run = sim.run(st)
    touches = trace.n_touches
    hits, cross_u, cross_o = _cross(trace, tenants, run)
    stored = np.bincount(tenants.user, weights=run.new, minlength=tenants.n_users)
    victims = counting.victims
    total_v = sum(victims.values())
    skew = eviction_skew(
        stored,
        np.bincount(
            np.fromiter(victims, np.int64, len(victims)),
            weights=np.fromiter(victims.values(), np.float64, len(victims)),
            minlength=tenants.n_users,
        )
        if victims
        else np.zeros(tenants.n_users),
    )
    per_user = stored * block_bytes
    return {
        "scope": scope,
        "capacity_blocks": capacity,
        "hit_ratio": hits / touches if touches else 0.0,
        "cross_user_hit_fraction": cross_u / hits if hits else 0.0,
        "cross_org_hit_fraction": cross_o / hits if hits else 0.0,
        "cross_user_hits": cross_u,
        "bytes_per_tenant": {
            "total": int(per_user.sum()),
            "median": float(np.median(per_user)) if per_user.size else 0.0,
            "max": int(per_user.max()) if per_user.size else 0,
            "max_fraction": float(per_user.max() / per_user.sum()) if per_user.sum() else 0.0,
        },
        "evictions": total_v,
        "eviction_skew": skew,
    }


def scope_table(
    trace: Trace, tenants: Tenants, fractions: Sequence[float], block_bytes: int
) -> dict[str, Any]:
    """Every scope at every capacity (fractions of the trace's distinct blocks)."""
    unique = trace.n_unique_blocks()
    rows = [
        run_scope(trace, tenants, scope, max(1, int(unique * f)), block_bytes) | {"capacity": f}
        for f in fractions
        for scope in SCOPES
    ]
    return {
        "trace": trace.name,
        "requests": trace.n_requests,
        "block_touches": trace.n_touches,
        "distinct_blocks": unique,
        "users": tenants.n_users,
        "organisations": tenants.n_orgs,
        "tenant_rule": tenants.rule,
        "rows": rows,
    }


# ---------------------------------------------------------------------------- quotas


class IsolatedLRUModel:
    """A re-implementation of LMCache 0.5.6's per-``cache_salt`` quotas, for the same
    workload as kvlife's: ``IsolatedLRUEvictionPolicy``
    (lmcache/v1/distributed/eviction_policy/isolated_lru.py: one LRU ``OrderedDict`` per
    salt; a request's new keys are inserted in reverse, so its last key is evicted first;
    hits are touched in reverse) driven by the L2 eviction controller's
    ``_check_and_evict_by_cache_salt``
    (lmcache/v1/distributed/storage_controllers/eviction_controller.py: each cycle, every
    salt whose bytes are ``>= trigger_watermark * limit`` (0.8) loses ``eviction_ratio``
    (0.2) of its list, at least one key; a salt without a quota loses all). The cycle runs
    on a timer there; here after every request (the most favourable schedule). A put
    that finds the tier full stores nothing more (the adapter has no room until the next
    cycle)."""

    def __init__(
        self, capacity: int, limits: dict[int, int], watermark: float = 0.8, ratio: float = 0.2
    ) -> None:
        self.capacity = capacity
        self.limits = limits
        self.watermark = watermark
        self.ratio = ratio
        self.order: dict[int, OrderedDict[int, None]] = {}
        self.where: dict[int, int] = {}
        self.evicted: dict[int, int] = {}

    def request(self, salt: int, req: list[int]) -> int:
        """Lookup, put and one eviction cycle; the prefix blocks hit."""
        p = 0
        while p < len(req) and req[p] in self.where:
            p += 1
        order = self.order.setdefault(salt, OrderedDict())
        for key in reversed(req[:p]):
            o = self.order[self.where[key]]
            o.move_to_end(key)
        new = [k for k in req if k not in self.where]
        stored = []
        for key in new:
            if len(self.where) >= self.capacity:
                break
            stored.append(key)
            self.where[key] = salt
        for key in reversed(stored):
            order[key] = None
        self._cycle()
        return p

    def _cycle(self) -> None:
        for salt, order in list(self.order.items()):
            if not order:
                continue
            limit = self.limits.get(salt, 0)
            if len(order) < self.watermark * limit:
                continue
            ratio = 1.0 if limit == 0 else self.ratio
            want = max(1, int(len(order) * ratio))
            for _ in range(min(want, len(order))):
                key, _ = order.popitem(last=False)
                del self.where[key]
                self.evicted[salt] = self.evicted.get(salt, 0) + 1


LMCACHE_INSTALL = (
    "python3 -m venv VENV && VENV/bin/pip install torch==2.13.0 lmcache==0.5.6, then "
    "KVLIFE_LMCACHE_PYTHON=VENV/bin/python (docs/tenants.md)"
)
RUNNER = Path(__file__).resolve().parents[1] / "bench" / "lmcache_quota_runner.py"


def lmcache_python() -> str | None:
    """The interpreter that has LMCache (it pins torch, so it lives in a virtualenv of its
    own): :func:`kvlife.bench.peer_lmcache_mp.find_peer_python`'s answer
    (``$KVLIFE_LMCACHE_PYTHON``, else ``peer-venv/bin/python`` beside the checkout), or
    None."""
    from kvlife.bench.peer_lmcache_mp import find_peer_python

    found = find_peer_python()
    return None if found is None else str(found)


def lmcache_quota_hits(
    trace: Trace,
    capacity: int,
    quotas: dict[str, int],
    watermark: float = 0.8,
    ratio: float = 0.2,
) -> tuple[dict[str, Any] | None, str]:
    """Each request's prefix hits under LMCache's own ``IsolatedLRUEvictionPolicy``,
    ``QuotaManager`` and L2 eviction controller (:mod:`kvlife.bench.lmcache_quota_runner`,
    run by the LMCache interpreter as a script: kvlife is not imported there), the cache
    salt being the tenant's name; or None and why not."""
    python = lmcache_python()
    if python is None:
        return None, f"LMCache not run: no LMCache interpreter found ({LMCACHE_INSTALL})"
    blocks, offs = trace.blocks.tolist(), trace.offsets.tolist()
    names = trace.tenant_names
    ten = trace.tenants.tolist()
    spec = {
        "requests": [
            [names[ten[r]], blocks[offs[r] : offs[r + 1]]] for r in range(trace.n_requests)
        ],
        "capacity_blocks": capacity,
        "quotas": quotas,
        "trigger_watermark": watermark,
        "eviction_ratio": ratio,
    }
    # kvlife is kept off the peer's path: the runner imports LMCache only.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with tempfile.TemporaryDirectory(prefix="kvlife-lmcache-quota-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec), encoding="utf-8")
        try:
            proc = subprocess.run(
                [python, str(RUNNER), str(spec_path), str(out_path)],
                env=env,
                cwd=tmp,
                capture_output=True,
                text=True,
                timeout=600,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, f"LMCache runner ({python}) did not run: {e}"
        if proc.returncode != 0:
            return None, f"LMCache runner failed: {proc.stderr.strip()[-2000:]}"
        result: dict[str, Any] = json.loads(out_path.read_text(encoding="utf-8"))
    if len(result["prefix_hits"]) != trace.n_requests:
        return None, "LMCache runner answered a different number of requests"
    return result, ""


def burst_workload(
    seed: int = 0, tenants: int = 4, working_set: int = 40, requests: int = 1200
) -> tuple[Trace, int, int]:
    """Tenants re-asking for their own prompts (a working set of ``working_set`` blocks
    each, in prompts of 4 blocks); between the middle third's start and end, tenant 0
    also sends ``requests // 3`` prompts of fresh blocks (its burst). Returns the trace
    and the burst's first and last request index."""
    rng = np.random.default_rng(seed)
    ids = iter(range(1, 1 << 62))
    sets = [
        [[next(ids) for _ in range(4)] for _ in range(working_set // 4)] for _ in range(tenants)
    ]
    b = TraceBuilder(f"burst-seed{seed}", 512)
    start = end = 0
    for r in range(requests):
        in_burst = requests // 3 <= r < 2 * requests // 3
        if in_burst and r % 2 == 0:
            if not start:
                start = len(b)
            b.add(float(r), 2048, 1, [next(ids) for _ in range(4)], tenant="t0")
            end = len(b)
        t = int(rng.integers(tenants))
        prompt = sets[t][int(rng.integers(len(sets[t])))]
        b.add(float(r) + 0.5, 2048, 1, list(prompt), tenant=f"t{t}")
    return b.build(), start, end


def quota_comparison(seed: int = 0, tenants: int = 4) -> dict[str, Any]:
    """Plain LRU, kvlife's TenantShares and the IsolatedLRU model on :func:`burst_workload`
    with the same budgets: the tier holds every tenant's working set, each tenant's
    budget (share, quota) is the tier over the tenants."""
    working_set = 40
    trace, start, end = burst_workload(seed, tenants, working_set)
    capacity = tenants * working_set + working_set // 2
    budget = capacity // tenants
    out: dict[str, Any] = {
        "workload": trace.name,
        "tenants": tenants,
        "capacity_blocks": capacity,
        "budget_blocks": budget,
        "burst_requests": [start, end],
        "note": (
            "lmcache-isolated-lru (re-implementation): LMCache 0.5.6's semantics re-written "
            "here; lmcache-isolated-lru: LMCache's own classes, in its interpreter"
        ),
    }
    owners = _owners(trace)
    tnames = trace.tenant_names
    arms: dict[str, NDArray[np.int64]] = {}
    for arm in ("lru", "kvlife-shares"):
        sim = CacheSim("lru", capacity, class_hints=False)
        if arm == "kvlife-shares":
            shares = {tnames.index(f"t{t}"): budget for t in range(tenants)}
            pol: TenantShares[object, int] = TenantShares(
                lambda k: int(owners[k]),  # type: ignore[call-overload]
                shares,
                inner=lambda: make_policy("lru"),
            )
            sim.policies[DRAM] = pol
        run = sim.run(trace)
        arms[arm] = run.prefix_dram + run.prefix_disk
    model = IsolatedLRUModel(capacity, {i: budget for i in range(len(tnames))})
    blocks, offs = trace.blocks.tolist(), trace.offsets.tolist()
    ten = trace.tenants.tolist()
    arms["lmcache-isolated-lru (re-implementation)"] = np.array(
        [model.request(ten[r], blocks[offs[r] : offs[r + 1]]) for r in range(trace.n_requests)],
        np.int64,
    )
    real, why = lmcache_quota_hits(trace, capacity, {name: budget for name in tnames})
    if real is None:
        out["lmcache_note"] = why
    else:
        arms["lmcache-isolated-lru"] = np.array(real["prefix_hits"], np.int64)
        out["lmcache_version"] = real["lmcache_version"]
    lens = np.diff(trace.offsets)
    window = np.zeros(trace.n_requests, bool)
    window[start:end] = True
    for arm, prefix in arms.items():
        per: dict[str, Any] = {}
        worst = 1.0
        for i, name in enumerate(tnames):
            m = trace.tenants == i
            during = m & window
            row = {
                "hit_ratio": float(prefix[m].sum() / lens[m].sum()),
                "hit_ratio_during_burst": float(prefix[during].sum() / max(1, lens[during].sum())),
            }
            per[name] = row
            if name != "t0":
                worst = min(worst, row["hit_ratio_during_burst"])
        out[arm] = {"tenants": per, "worst_other_tenant_during_burst": worst}
    return out


# ---------------------------------------------------------------------------- report


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = [t for t in result["scopes"]]
    fig, axes = plt.subplots(1, len(tables) + 1, figsize=(5 * (len(tables) + 1), 4))
    for ax, table in zip(axes, tables, strict=False):
        caps = sorted({r["capacity"] for r in table["rows"]})
        x = np.arange(len(SCOPES))
        width = 0.8 / len(caps)
        for j, cap in enumerate(caps):
            rows = [r for r in table["rows"] if r["capacity"] == cap]
            hr = [r["hit_ratio"] for r in rows]
            cu = [r["hit_ratio"] * r["cross_user_hit_fraction"] for r in rows]
            ax.bar(x + j * width, hr, width, label=f"hit ratio, cap {cap:.0%}")
            ax.bar(x + j * width, cu, width, hatch="//", fill=False, label=f"cross-user, {cap:.0%}")
        ax.set_xticks(x + width * (len(caps) - 1) / 2, SCOPES)
        ax.set_title(f"{table['trace'][:32]} ({table['users']} users)")
        ax.set_ylabel("prefix hit ratio (hatched: hits across users)")
        ax.legend(fontsize=7)
    q = result["quotas"]
    ax = axes[-1]
    arms = [a for a in q if isinstance(q[a], dict) and "tenants" in q[a]]
    names = list(q[arms[0]]["tenants"])
    x = np.arange(len(names))
    width = 0.8 / len(arms)
    for j, arm in enumerate(arms):
        vals = [q[arm]["tenants"][n]["hit_ratio_during_burst"] for n in names]
        ax.bar(x + j * width, vals, width, label=arm)
    ax.set_xticks(
        x + width * (len(arms) - 1) / 2, [f"{n}{' (burst)' if n == 't0' else ''}" for n in names]
    )
    ax.set_title("hit ratio during t0's burst, same budgets")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_report(result: dict[str, Any]) -> str:
    lines = []
    for table in result["scopes"]:
        lines.append(
            f"{table['trace']}: {table['requests']} requests, {table['users']} users, "
            f"{table['organisations']} organisations"
        )
        lines.append(
            f"  {'capacity':>8} {'scope':>12} {'hit':>7} {'x-user':>7} {'x-org':>7} {'skew':>6}"
        )
        for r in table["rows"]:
            lines.append(
                f"  {r['capacity']:>8.0%} {r['scope']:>12} {r['hit_ratio']:>7.4f} "
                f"{r['cross_user_hit_fraction']:>7.3f} {r['cross_org_hit_fraction']:>7.3f} "
                f"{r['eviction_skew']:>6.2f}"
            )
    q = result["quotas"]
    lines.append(
        f"quotas ({q['workload']}, budget {q['budget_blocks']} of {q['capacity_blocks']} blocks):"
    )
    for arm, v in q.items():
        if isinstance(v, dict) and "tenants" in v:
            worst = v["worst_other_tenant_during_burst"]
            lines.append(f"  {arm:>42}: worst other tenant during the burst {worst:.3f}")
    if "lmcache_note" in q:
        lines.append(f"  {q['lmcache_note']}")
    return "\n".join(lines)


def run_experiment(
    trace_path: str | None,
    fmt: str = "mooncake",
    max_requests: int | None = None,
    seed: int = 0,
    fractions: Sequence[float] = (0.1, 1.0),
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN,
) -> dict[str, Any]:
    tables = []
    if trace_path is not None:
        trace = read_trace(trace_path, fmt, max_requests)
        tables.append(
            scope_table(
                trace, derive_tenants(trace), fractions, kv_bytes_per_token * trace.block_tokens
            )
        )
    strace, stenants = synthetic_tenants(seed)
    tables.append(
        scope_table(strace, stenants, fractions, kv_bytes_per_token * strace.block_tokens)
    )
    return {"scopes": tables, "quotas": quota_comparison(seed), "seed": seed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvlife experiment sharing-scope",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--trace", default=None, help="a trace (Mooncake JSON lines by default)")
    parser.add_argument("--format", default="mooncake", help="trace format")
    parser.add_argument("--max-requests", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic workloads")
    parser.add_argument(
        "--capacities", default="0.1,1.0", help="cache capacities: fractions of distinct blocks"
    )
    parser.add_argument("--json", default=None, help="write the results to this file")
    parser.add_argument("--plot", default=None, help="write the figure (PNG) to this file")
    args = parser.parse_args(argv)
    try:
        fractions = [float(x) for x in args.capacities.split(",")]
    except ValueError:
        raise InvalidArgument(
            f"--capacities {args.capacities!r}: fractions, comma separated"
        ) from None
    if not fractions or any(not (f > 0 and math.isfinite(f)) for f in fractions):
        raise InvalidArgument("--capacities: fractions > 0")
    result = run_experiment(args.trace, args.format, args.max_requests, args.seed, fractions)
    print(format_report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, Path(args.plot))
    return 0

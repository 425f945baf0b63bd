"""TenantShares: one tier's eviction isolated between tenants, through the placement
engine (the replay simulator's) and against a model under hypothesis."""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.policy.lru import LRUPolicy
from kvlife.policy.shares import TenantShares
from kvlife.replay.cache import DRAM, CacheSim
from kvlife.trace.model import TraceBuilder


def _burst_trace() -> object:
    """b puts four blocks, a bursts through twenty of its own, b asks for its four."""
    t = TraceBuilder("burst", 16)
    t.add(0.0, 64, 1, [101, 102, 103, 104], tenant="b")
    for i in range(5):
        t.add(1.0 + i, 64, 1, [4 * i + 1, 4 * i + 2, 4 * i + 3, 4 * i + 4], tenant="a")
    t.add(9.0, 64, 1, [101, 102, 103, 104], tenant="b")
    return t.build()


def _tenant(block: object) -> str:
    return "b" if isinstance(block, int) and block > 100 else "a"


def test_a_tenants_burst_evicts_only_its_own_blocks_in_the_engine() -> None:
    trace = _burst_trace()
    plain = CacheSim("lru", 8).run(trace)  # type: ignore[arg-type]
    assert plain.prefix_dram.tolist()[-1] == 0  # a's burst evicted all of b's blocks
    sim = CacheSim("lru", 8)
    shares: TenantShares[object, str] = TenantShares(_tenant, {"a": 4, "b": 4})
    sim.policies[DRAM] = shares
    run = sim.run(trace)  # type: ignore[arg-type]
    assert run.prefix_dram.tolist()[-1] == 4  # b kept its share
    assert shares.used("a") == 4 and shares.used("b") == 4
    # a's own last blocks are what it kept
    assert all(k in shares for k in (17, 18, 19, 20)) and 16 not in shares


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(0, 3), st.integers(0, 11)),
        st.tuples(st.just("touch"), st.integers(0, 3), st.integers(0, 11)),
        st.tuples(st.just("remove"), st.integers(0, 3), st.integers(0, 11)),
        st.tuples(st.just("evict"), st.integers(0, 4), st.frozensets(st.integers(0, 47))),
    ),
    max_size=60,
)


@given(OPS, st.lists(st.integers(0, 6), min_size=4, max_size=4))
@settings(max_examples=150, deadline=None)
def test_every_victim_is_of_a_tenant_furthest_over_its_share(
    ops: list[tuple[object, ...]], share_list: list[int]
) -> None:
    """Against a model: residents, each tenant's units, and every victim taken from a
    tenant with the largest excess (used + its protected keys not resident - share)
    among those with an unprotected resident, in LRU order within it; ``evict(n)`` is
    all or nothing."""
    shares = dict(enumerate(share_list))
    size = {k: 1 + k % 3 for k in range(48)}  # keys of tenant t: 12 t .. 12 t + 11
    policy: TenantShares[int, int] = TenantShares(lambda k: k // 12, shares, size=size.__getitem__)
    model: dict[int, OrderedDict[int, None]] = {t: OrderedDict() for t in range(4)}
    for op in ops:
        if op[0] == "evict":
            _, n, protected = op
            assert isinstance(n, int) and isinstance(protected, frozenset)
            free = sum(1 for t in model for k in model[t] if k not in protected)
            resident = {k for m in model.values() for k in m}
            incoming = {t: 0 for t in model}
            for k in protected:
                if k not in resident:
                    incoming[k // 12] += size[k]
            got = policy.evict(n, protected)
            if free < n:
                assert got is None
            else:
                assert got is not None and len(got) == n
                for key in got:  # replay the choice one victim at a time in the model
                    used = {t: sum(size[k] for k in model[t]) for t in model}
                    live = [t for t in model if any(k not in protected for k in model[t])]
                    most = max(used[t] + incoming[t] - shares[t] for t in live)
                    t = key // 12
                    assert used[t] + incoming[t] - shares[t] == most
                    first = next(k for k in model[t] if k not in protected)
                    assert key == first
                    del model[t][key]
        else:
            verb, tenant, i = op
            assert isinstance(tenant, int) and isinstance(i, int)
            key = 12 * tenant + i
            if verb == "insert":
                policy.insert(key)
                model[tenant][key] = None
                model[tenant].move_to_end(key)
            elif verb == "touch":
                policy.touch(key)
                if key in model[tenant]:
                    model[tenant].move_to_end(key)
            else:
                policy.remove(key)
                model[tenant].pop(key, None)
        assert len(policy) == sum(len(m) for m in model.values())
        for t in model:
            assert policy.used(t) == sum(size[k] for k in model[t])
            assert all(k in policy for k in model[t])


def test_one_tenant_without_shares_is_plain_lru() -> None:
    shares: TenantShares[int, int] = TenantShares(lambda k: 0, {})
    lru: LRUPolicy[int] = LRUPolicy()
    for k in (1, 2, 3, 1, 4):
        shares.insert(k)
        lru.insert(k)
    assert shares.evict_up_to(3, {2}) == lru.evict_up_to(3, {2}) == [3, 1, 4]

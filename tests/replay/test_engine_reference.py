"""Policy-only replay through the placement engine equals a straightforward reference run:
the documented one-tier rules (docs/replay.md) written out with one policy call per block
and one ``evict(1, protected)`` per victim, for every built-in policy, on seeded synthetic
traces, at capacities from smaller than one request (blocks dropped) to most of the trace.

The engine's batch calls (``touch_all``, ``record_in_order``, ``evict_up_to``) and the
simulator's one-tier bookkeeping (no map beside the policy, a put in one engine call) are
the fast forms of exactly these calls; this test keeps them equal, request by request.
The KV-aware policies learn from a put as a whole, so their reference makes the one
``record_in_order`` call per put that defines them (its written-out fast path is held to
their general path by tests/policy/test_kvaware.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kvlife.policy.base import (
    BUILTIN_POLICIES,
    LearnsFromPrompts,
    SupportsClassHints,
    make_policy,
)
from kvlife.replay.cache import CacheSim, pos_bucket
from kvlife.trace.model import Trace
from kvlife.trace.synthetic import SyntheticConfig, synthetic_trace


def reference_run(
    trace: Trace, policy: str, cap: int, class_hints: bool = True
) -> dict[str, list[int]]:
    """Per request: usable-prefix hits, blocks present, blocks stored, blocks dropped;
    and the evictions in total (one entry)."""
    pol = make_policy(policy)
    classed = class_hints and isinstance(pol, SupportsClassHints)
    blocks = trace.blocks.tolist()
    offs = trace.offsets.tolist()
    cats = trace.categories.tolist()
    out: dict[str, list[int]] = {"prefix": [], "present": [], "new": [], "dropped": []}
    evictions = 0
    for r in range(trace.n_requests):
        req = blocks[offs[r] : offs[r + 1]]
        # lookup: the leading present blocks, touched from last to first
        p = 0
        while p < len(req) and req[p] in pol:
            p += 1
        for b in reversed(req[:p]):
            pol.touch(b)
        new = [b for b in req if b not in pol]
        # put: room for all new blocks at once, never evicting a block of the request
        protected = set(req)
        short = len(pol) + len(new) - cap
        while short > 0:
            got = pol.evict(1, protected)
            if not got:
                break
            evictions += 1
            short -= 1
        stored = new[: max(0, cap - len(pol))]  # what fits, in prompt order
        if isinstance(pol, LearnsFromPrompts):  # the put as a whole: its held blocks
            pol.record_in_order([b for b in req if b in stored or b in pol], set(stored))
        for pos, b in enumerate([] if isinstance(pol, LearnsFromPrompts) else req):
            if b in stored:
                if classed:
                    pol.insert_classed(b, cats[r] * 4 + pos_bucket(pos))  # type: ignore[attr-defined]
                else:
                    pol.insert(b)
            elif b in pol:
                pol.touch(b)
        out["prefix"].append(p)
        out["present"].append(len(req) - len(new))
        out["new"].append(len(stored))
        out["dropped"].append(len(new) - len(stored))
    out["evictions"] = [evictions]
    return out


@pytest.fixture(scope="module")
def trace() -> Trace:
    return synthetic_trace(SyntheticConfig(seed=11, sessions=40))


@pytest.mark.parametrize(
    "policy", [*BUILTIN_POLICIES, "prefixtree", "prefixtree-admit", "kvhd", "wild"]
)
def test_engine_replay_equals_the_reference_run(trace: Trace, policy: str) -> None:
    longest = int(np.diff(trace.offsets).max())
    unique = trace.n_unique_blocks()
    for cap in (longest // 2, longest, 3 * longest, unique // 10, unique // 2):
        for hints in (True, False):
            ref = reference_run(trace, policy, cap, hints)
            run = CacheSim(policy, cap, class_hints=hints).run(trace)
            assert run.prefix_dram.tolist() == ref["prefix"], (cap, hints)
            assert run.present.tolist() == ref["present"], (cap, hints)
            assert run.new.tolist() == ref["new"], (cap, hints)
            assert run.dropped.tolist() == ref["dropped"], (cap, hints)
            assert run.tiers["dram"].evictions == ref["evictions"][0], (cap, hints)
            assert run.tiers["dram"].block_hits == sum(ref["present"])
            assert run.tiers["dram"].prefix_hits == sum(ref["prefix"])


def test_the_reference_run_drops_and_evicts_at_small_capacities(trace: Trace) -> None:
    """The comparison above covers the paths that matter: blocks dropped when a request
    does not fit, and evictions."""
    longest = int(np.diff(trace.offsets).max())
    ref = reference_run(trace, "lru", longest // 2)
    assert sum(ref["dropped"]) > 0 and ref["evictions"][0] > 0

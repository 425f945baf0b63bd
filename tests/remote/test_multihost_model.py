"""The multi-host model test (issue 29's defence), in the spirit of Jepsen: several
hosts (in-process stores with the chain [memory dram, redis shared], one of them storing
``int8`` in the shared tier, one with a disk tier between, and two ``kvlife serve``
processes, one storing ``int4``) share one real Redis (or a Redis Cluster, or a Mooncake
master with its Redis index), driven by a seeded random schedule of puts (whole and
two-phase), flushes, lookups, loads, global invalidations by every selector (through
``KVStore.invalidate`` and ``GlobalIndex.invalidate``, malformed ones included),
revocations (one racing a publishing thread), lease expiry, host restarts (clean and
crashed), Redis restarts with and without persistence, ``FLUSHALL``, partitions and
delays through a loopback fault proxy per host, handoffs of fresh prompts between two
hosts and a host configured with another bucket count. An oracle
(``tests/remote/multihost_oracle.py``) checks every served chunk (the bytes of one put
for the representation asked for, and nothing a rule or a wipe of the index that came
before the lookup covers) and what must still be served (a handoff, a get that must
serve, what the disk host made durable, across its restarts).

Environment:

- ``KVLIFE_MULTIHOST_SECONDS`` (default 600): how long the slow runs
  (``make test-slow``) go on, one seed after another, on a single Redis (the cluster
  and Mooncake runs get a fifth of it each).
- ``KVLIFE_MULTIHOST_SEED``: the first seed of the random runs (default 1).
- ``KVLIFE_MULTIHOST_REPORT``: a file the slow runs append one JSON line per seed to
  (steps, chunks served, checks, findings).

A failing schedule is printed as JSON; ``python -m tests.remote.multihost_run replay
'<json>'`` runs it again and ``... shrink --seed N --steps M --label LABEL`` makes it
smaller.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from kvlife.tiers.mooncake.server import in_private_netns, netns_command
from tests.conftest import budget
from tests.remote.multihost_api import Criteria
from tests.remote.multihost_oracle import Finding, Oracle, Served
from tests.remote.multihost_run import (
    CLUSTER_CAST,
    DEFAULT_CAST,
    MOONCAKE_CAST,
    SOCKET_TIMEOUT_S,
    Outcome,
    world,
)
from tests.remote.multihost_schedule import (
    Cast,
    Step,
    chunk_of,
    dumps,
    generate,
    key_infos,
    loads,
    prompt_keys,
    version_kv,
)

ROOT = Path(__file__).resolve().parents[2]

SECONDS = float(os.environ.get("KVLIFE_MULTIHOST_SECONDS", "600"))
SEED = int(os.environ.get("KVLIFE_MULTIHOST_SEED", "1"))
REPORT = os.environ.get("KVLIFE_MULTIHOST_REPORT", "")

FINAL = Step("handoff", "a", target="b")
"""Every random run ends with a handoff: whatever came before, a host publishes and
another one serves it (a store that only stays safe by serving nothing fails here)."""

# The minimal schedules the model found (issue 29's holes on the code before the fixes,
# shrunk and written as the issue tells them), and the ones written for the checks added
# since; each must now run without a finding. ``inv_index`` is ``GlobalIndex.invalidate``
# (the call the holes were found with), ``inv_global`` is ``KVStore.invalidate``.
MINIMAL: dict[str, str] = {
    # item 1: B's KV computed before A's rule is published after it (its epoch was read
    # at publish time) and served by C
    "item1": (
        '[{"kind":"put","host":"b"},'
        '{"kind":"inv_index","host":"a","crit":{"namespace":"acme"}},'
        '{"kind":"flush","host":"b"},{"kind":"get","host":"c"}]'
    ),
    # the same with the public call
    "item1-store": (
        '[{"kind":"put","host":"b"},'
        '{"kind":"inv_global","host":"a","crit":{"namespace":"acme"}},'
        '{"kind":"flush","host":"b"},{"kind":"get","host":"c"}]'
    ),
    # item 2: a put in flight across the rule: B's lookup took the rule while its objects
    # were TENTATIVE; B served them after the commit, and so did C after B's flush
    "item2": (
        '[{"kind":"begin","host":"b"},'
        '{"kind":"inv_index","host":"a","crit":{"namespace":"acme"}},'
        '{"kind":"lookup","host":"b","prompt":1},{"kind":"commit","host":"b"},'
        '{"kind":"get","host":"b"},{"kind":"flush","host":"b"},{"kind":"get","host":"c"}]'
    ),
    # the same on one host: the store's own invalidate skipped the put's TENTATIVE
    # objects (the correctness issue's hole 5; the call is global now)
    "item2-local": (
        '[{"kind":"begin","host":"b"},'
        '{"kind":"inv_global","host":"b","crit":{"namespace":"acme"}},'
        '{"kind":"commit","host":"b"},{"kind":"get","host":"b"}]'
    ),
    # item 3: B adopts A's exact records; D (int8 shared tier) overwrites them; B's load
    # returned D's int8 frames as exact KV
    "item3": (
        '[{"kind":"put","host":"a"},{"kind":"flush","host":"a"},'
        '{"kind":"lookup","host":"b"},{"kind":"put","host":"d"},{"kind":"flush","host":"d"},'
        '{"kind":"load","host":"b"}]'
    ),
    # found by seed 13 (300 steps), shrunk: the kvlife serve host s2 (int4 shared tier)
    # overwrites what D adopted from B; D's load returned int4 frames
    "item3-served-int4": (
        '[{"kind":"put","host":"b","prompt":3},{"kind":"put","host":"s2","prompt":3},'
        '{"kind":"flush","host":"b"},{"kind":"lookup","host":"d","prompt":3,"lossy":true},'
        '{"kind":"flush","host":"s2"},{"kind":"load","host":"d"}]'
    ),
    # item 4, found by seed 9 (300 steps), shrunk: after FLUSHALL the next rule reused
    # epoch 1, which the kvlife serve host s2 held (and had handed out) already: it kept
    # serving
    "item4-flushall-served": (
        '[{"kind":"inv_index","host":"d","crit":{"namespace":"acme"}},'
        '{"kind":"put","host":"s2","prompt":5},{"kind":"flushall"},'
        '{"kind":"inv_index","host":"c","crit":{"weights_digest":"w1"}},'
        '{"kind":"get","host":"s2","prompt":5}]'
    ),
    # item 4: Redis restarts empty after a rule: B publishes with its cached epoch, A's
    # next rule reused epoch 1; B (cached rule 1) and C (record epoch 1) served what it
    # covers
    "item4-epoch-reused": (
        '[{"kind":"inv_index","host":"a","crit":{"namespace":"globex"}},'
        '{"kind":"get","host":"b"},{"kind":"redis_restart"},{"kind":"wait","ms":300},'
        '{"kind":"put","host":"b"},{"kind":"flush","host":"b"},'
        '{"kind":"inv_index","host":"a","crit":{"namespace":"acme"}},'
        '{"kind":"get","host":"b"},{"kind":"get","host":"c"}]'
    ),
    # item 4: a rule lost with the index: C, which had not read it, served what it covers
    "item4-rule-lost": (
        '[{"kind":"put","host":"c"},'
        '{"kind":"inv_index","host":"a","crit":{"namespace":"acme"}},'
        '{"kind":"redis_restart"},{"kind":"wait","ms":300},{"kind":"get","host":"c"}]'
    ),
    # item 5: a rule whose namespace is no Namespace was recorded; every lookup then
    # raised (now refused when written, by either call)
    "item5": (
        '[{"kind":"put","host":"a"},{"kind":"flush","host":"a"},'
        '{"kind":"inv_index","host":"a","crit":{"raw_namespace":"acme"}},'
        '{"kind":"inv_global","host":"a","crit":{"raw_namespace":"acme"}},'
        '{"kind":"get","host":"b","must":true}]'
    ),
    # item 6: KV the disk host E put after it read a rule, flushed to disk, must be
    # served after E crashes and restarts (a fresh index handed out every rule again and
    # objects carried no epoch: all of it was invalidated)
    "item6": (
        '[{"kind":"inv_index","host":"a","crit":{"namespace":"acme"}},'
        '{"kind":"get","host":"e"},{"kind":"put","host":"e"},{"kind":"flush","host":"e"},'
        '{"kind":"restart","host":"e","clean":false},{"kind":"get","host":"e","must":true}]'
    ),
    # item 7: B publishes on a thread while A revokes it with a ban: nothing of B's
    # appears in the index after revoke returned; after the ban B publishes again
    "item7-race": (
        '[{"kind":"revoke_race","host":"a","target":"b","ban_ms":1500,"ms":50},'
        '{"kind":"handoff","host":"b","target":"c"}]'
    ),
    # after FLUSHALL, what B adopted before stayed INDEXED forever: every load vanished,
    # and B's own put of the prompt stored nothing (its keys were indexed)
    "flushall-adopted": (
        '[{"kind":"put","host":"a"},{"kind":"flush","host":"a"},{"kind":"get","host":"b"},'
        '{"kind":"flushall"},{"kind":"get","host":"b"},{"kind":"put","host":"b"},'
        '{"kind":"get","host":"b","must":true}]'
    ),
    # a delete racing a re-publish: B drops what it adopted from A (a rule covers it)
    # after A published a new version of the same keys; B's delete must not remove A's
    # new record, which C must then serve
    "fenced-delete": (
        '[{"kind":"put","host":"a"},{"kind":"flush","host":"a"},{"kind":"lookup","host":"b"},'
        '{"kind":"inv_index","host":"c","crit":{"namespace":"acme"}},'
        '{"kind":"get","host":"a"},{"kind":"put","host":"a"},{"kind":"flush","host":"a"},'
        '{"kind":"lookup","host":"b"},{"kind":"get","host":"c","must":true}]'
    ),
    # found by the soak (seed 12): a later revocation with a shorter ban cut B's first
    # ban short, and B published inside it
    "ban-shortened": (
        '[{"kind":"revoke","host":"a","target":"b","ban_ms":1500},'
        '{"kind":"revoke","host":"c","target":"b","ban_ms":100},{"kind":"wait","ms":300},'
        '{"kind":"handoff","host":"b","target":"c"}]'
    ),
    # a host configured with 8 buckets (the index has 16) tries a lookup, a put, a
    # flush and an invalidation: refused, nothing of it recorded or served
    "mismatch": (
        '[{"kind":"put","host":"a"},{"kind":"flush","host":"a"},'
        '{"kind":"mismatch","host":"a"},{"kind":"get","host":"b","must":true}]'
    ),
}


def report(out: Outcome, steps: Sequence[Step], what: str) -> str:
    seen: dict[tuple[str, str, int, str], int] = {}
    for f in out.findings:  # one line per lookup and kind, not per chunk
        seen[(f.label, f.kind, f.step, f.host)] = seen.get((f.label, f.kind, f.step, f.host), 0) + 1
    firsts: dict[tuple[str, str, int, str], Finding] = {}
    for f in out.findings:
        firsts.setdefault((f.label, f.kind, f.step, f.host), f)
    lines = [f"{what}: {out.summary()}"]
    lines += [f"  {f} (x{seen[k]})" for k, f in list(firsts.items())[:30]]
    lines.append("schedule: " + dumps(steps[: out.steps_run]))
    lines.append("log (last 40 steps):")
    lines += out.log[-40:]
    return "\n".join(lines)


def judge(out: Outcome, steps: Sequence[Step], what: str) -> None:
    """No finding; and the final handoff went through (hosts still serve each other)."""
    assert not out.findings, report(out, steps, what)
    assert out.checks.get("handoff:ok", 0) >= 1, report(out, steps, f"{what}: no handoff")
    assert out.served_chunks > 0, report(out, steps, what)


# ---------------------------------------------------------------------- the oracle alone


def _oracle_with_put(step: int = 0) -> tuple[Oracle, bytes, np.ndarray]:
    o = Oracle(key_infos(), ["int8"])
    kv = version_kv(1)
    keys = prompt_keys(0)
    v = o.created(1, "b", 1, 0, step, {k: chunk_of(kv, i) for i, k in enumerate(keys)}, 0.0)
    v.committed = step
    v.stored = len(keys)
    return o, keys[2], chunk_of(kv, 2)


def _served(key: bytes, arr: np.ndarray, step: int, host: str = "c", lossy: bool = False) -> Served:
    return Served(host, 1, step, 0.0, 0, [key], ["shared"], ["exact"], lossy, [arr])


def test_oracle_covers_by_creation_time_and_selectors() -> None:
    o, key, arr = _oracle_with_put(step=0)
    o.rule(1, Criteria(namespace="acme"))
    assert [f.kind for f in o.check(_served(key, arr, 2))] == ["stale"]
    assert o.check(_served(key, arr, 1)) == []  # the lookup began before the rule returned
    o2, key, arr = _oracle_with_put(step=5)
    o2.rule(3, Criteria(namespace="acme"))  # KV created after the rule
    o2.rule(6, Criteria(namespace="globex"))  # another tenant
    o2.rule(7, Criteria(prefix=prompt_keys(0)[3]))  # a later chunk of the chain
    o2.rule(8, Criteria(namespace="acme", adapter_id="lora-1"))  # intersected
    o2.unknown_rule(9)  # an invalidation that raised: no rule to rely on
    assert o2.check(_served(key, arr, 10)) == []
    o2.rule(11, Criteria(prefix=prompt_keys(0)[1]))  # an ancestor: covered
    assert [f.kind for f in o2.check(_served(key, arr, 12))] == ["stale"]


def test_oracle_a_wipe_covers_everything_created_before_it() -> None:
    o, key, arr = _oracle_with_put(step=0)
    o.wiped(2)
    [f] = o.check(_served(key, arr, 3))
    assert (f.kind, f.label) == ("stale", "item4")
    assert o.check(_served(key, arr, 2)) == []  # the lookup began before the wipe


def test_oracle_a_ban_lapses_with_the_index() -> None:
    o = Oracle(key_infos(), [])
    o.revoked(1, "b", 0.0, 60_000)
    kv = version_kv(1)
    keys = prompt_keys(0)
    v = o.created(1, "b", 1, 0, 2, {k: chunk_of(kv, i) for i, k in enumerate(keys)}, 0.0)
    v.committed = 2
    assert [f.kind for f in o.check(_served(keys[0], chunk_of(kv, 0), 3))] == ["revoked-published"]
    o.wiped(4)  # a ban is a key of the index: gone with it (and what b put before)
    v2 = o.created(2, "b", 1, 1, 5, {prompt_keys(1)[0]: chunk_of(version_kv(2), 0)}, 0.0)
    v2.committed = 5
    assert o.check(_served(prompt_keys(1)[0], chunk_of(version_kv(2), 0), 6)) == []


def test_oracle_judges_a_late_load_by_when_it_read() -> None:
    """A load after its lookup may read a record published since (found by seed 19:
    the revoked host's own put, published after its ban, read by a load whose lookup
    came before the revocation)."""
    o = Oracle(key_infos(), [])
    o.revoked(10, "a", 100.0, 800)
    kv = version_kv(1)
    keys = prompt_keys(0)
    v = o.created(1, "a", 1, 0, 11, {k: chunk_of(kv, i) for i, k in enumerate(keys)}, 0.0)
    v.committed = 11
    late = Served("a", 1, 5, 99.0, 0, [keys[0]], ["shared"], ["exact"], False, [chunk_of(kv, 0)])
    late.load_step, late.load_t = 12, 101.0  # after the ban
    assert o.check(late, claims=False) == []
    late.load_t = 100.5  # during it
    assert [f.kind for f in o.check(late, claims=False)] == ["revoked-published"]


def test_oracle_checks_bytes_for_the_representation_asked() -> None:
    o, key, arr = _oracle_with_put()
    frame = np.zeros(1598, np.uint8)
    [f] = o.check(_served(key, frame, 1))
    assert (f.kind, f.label) == ("wrong-bytes", "item3")
    near = (arr.astype(np.float32) + 1e-3).astype(np.float16)
    assert [x.kind for x in o.check(_served(key, near, 1))] == ["wrong-bytes"]
    assert o.check(_served(key, near, 1, lossy=True)) == []  # within int8's bound
    far = (arr.astype(np.float32) + 0.5).astype(np.float16)
    assert [x.label for x in o.check(_served(key, far, 1, lossy=True))] == ["wrong-bytes"]


def test_oracle_expects_durable_kv_unless_something_may_cover_it() -> None:
    keys = prompt_keys(0)

    def setup() -> Oracle:
        o = Oracle(key_infos(), [])
        o.rule(1, Criteria(namespace="acme"))
        o.read("e", 1, 3)  # e read the index (and rule 1) at step 3
        kv = version_kv(1)
        v = o.created(1, "e", 1, 0, 4, {k: chunk_of(kv, i) for i, k in enumerate(keys)}, 0.0)
        v.committed, v.stored = 4, len(keys)
        o.flushed("e", 1, 5)
        return o

    o = setup()
    assert o.durable("e", 0, keys, 4) is None  # not flushed yet
    assert o.durable("e", 0, keys, 9) is not None  # restarted since: still expected
    o.rule(6, Criteria(namespace="globex"))  # selects none of it
    assert o.durable("e", 0, keys, 9) is not None
    o.rule(7, Criteria(prefix=keys[3]))  # a rule after the put that selects a chunk
    assert o.durable("e", 0, keys, 9) is None
    o = setup()
    o.unknown_rule(6)
    assert o.durable("e", 0, keys, 9) is None
    o = setup()
    o.wiped(6)
    assert o.durable("e", 0, keys, 9) is None
    o = Oracle(key_infos(), [])  # no read of the index before the put: its stamp is unknown
    kv = version_kv(1)
    v = o.created(1, "e", 1, 0, 4, {k: chunk_of(kv, i) for i, k in enumerate(keys)}, 0.0)
    v.committed, v.stored = 4, len(keys)
    o.flushed("e", 1, 5)
    assert o.durable("e", 0, keys, 9) is None


# ---------------------------------------------------------------------- against servers


def _run(
    steps: Sequence[Step],
    tmp: Path,
    backend: str = "redis",
    cast: Cast = DEFAULT_CAST,
    timeout_s: float = SOCKET_TIMEOUT_S,
) -> Outcome:
    with world(backend, cast, tmp, timeout_s) as w:
        return w.run(steps)


@pytest.mark.parametrize("name", sorted(MINIMAL))
def test_minimal_schedules_serve_nothing_wrong(name: str, tmp_path: Path) -> None:
    """Each schedule that found one of issue 29's holes (or was written for a check
    added since) runs without a finding: nothing wrong is served, and what must be
    served is."""
    steps = loads(MINIMAL[name])
    out = _run(steps, tmp_path, timeout_s=5.0)  # no partition here: a slow reply is no fault
    assert not out.findings, report(out, steps, name)
    assert not [e for e in out.errors if e.startswith(("get:", "lookup:", "load:"))], report(
        out, steps, name
    )


def test_random_schedule_single_redis(tmp_path: Path) -> None:
    steps = [*generate(SEED, budget(80, 150), DEFAULT_CAST), FINAL]
    out = _run(steps, tmp_path)
    judge(out, steps, f"seed {SEED} on one Redis")


def test_random_schedule_redis_cluster(tmp_path: Path) -> None:
    steps = [*generate(SEED, budget(50, 80), CLUSTER_CAST), FINAL]
    out = _run(steps, tmp_path, "cluster", CLUSTER_CAST)
    judge(out, steps, f"seed {SEED} on a Redis Cluster")


# ---------------------------------------------------------------------- long runs


def soak(tmp: Path, seconds: float, backend: str, cast: Cast, steps_per_seed: int) -> None:
    """Seeds one after another until ``seconds`` passed; every run must pass
    :func:`judge`. What each covered is printed (and appended to ``REPORT``)."""
    deadline = time.monotonic() + seconds
    seed = SEED
    totals = {"runs": 0, "steps": 0, "served": 0}
    while time.monotonic() < deadline:
        steps = [*generate(seed, steps_per_seed, cast), FINAL]
        t0 = time.monotonic()
        out = _run(steps, tmp / f"s{seed}", backend, cast)
        line = {
            "backend": backend,
            "seed": seed,
            "steps": out.steps_run,
            "served_chunks": out.served_chunks,
            "findings": [str(f) for f in out.findings[:10]],
            "checks": out.checks,
            "errors": out.errors,
            "seconds": round(time.monotonic() - t0, 1),
        }
        print(json.dumps(line, sort_keys=True), flush=True)
        if REPORT:
            with open(REPORT, "a") as f:
                f.write(json.dumps(line, sort_keys=True) + "\n")
        judge(out, steps, f"seed {seed} on {backend}")
        totals["runs"] += 1
        totals["steps"] += out.steps_run
        totals["served"] += out.served_chunks
        seed += 1
    print(f"{backend}: {totals} (seeds {SEED}..{seed - 1})", flush=True)
    assert totals["runs"] > 0


@pytest.mark.slow
@pytest.mark.timeout(int(SECONDS) + 600)
def test_soak_single_redis(tmp_path: Path) -> None:
    soak(tmp_path, SECONDS, "redis", DEFAULT_CAST, 400)


@pytest.mark.slow
@pytest.mark.timeout(int(SECONDS / 5) + 600)
def test_soak_redis_cluster(tmp_path: Path) -> None:
    soak(tmp_path, SECONDS / 5, "cluster", CLUSTER_CAST, 300)


# ---------------------------------------------------------------------- Mooncake


@pytest.mark.skipif(not in_private_netns(), reason="runs inside the private namespace")
def test_mooncake_model_inner(tmp_path: Path) -> None:
    seconds = float(os.environ.get("KVLIFE_MULTIHOST_MOONCAKE_SECONDS", "0"))
    if seconds > 0:
        soak(tmp_path, seconds, "mooncake", MOONCAKE_CAST, 300)
        return
    steps = [*generate(SEED, budget(30, 50), MOONCAKE_CAST), FINAL]
    out = _run(steps, tmp_path, "mooncake", MOONCAKE_CAST)
    judge(out, steps, f"seed {SEED} on Mooncake")


def _mooncake_outer(seconds: float) -> None:
    if os.geteuid() != 0:
        pytest.skip("unshare -n needs root (CI runs as root)")
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no private network namespace here: {probe.stderr.strip()}")
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-s",
        "-p",
        "no:cacheprovider",
        "-m",
        "not slow or slow",
    ]
    argv += [f"{Path(__file__).relative_to(ROOT)}::test_mooncake_model_inner"]
    env = dict(os.environ, KVLIFE_MULTIHOST_MOONCAKE_SECONDS=str(seconds), PYTHONPATH=str(ROOT))
    run = subprocess.run(
        netns_command(argv),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=seconds + 500,
        env=env,
    )
    summaries = [ln for ln in run.stdout.splitlines() if ln.startswith(("{", "mooncake:"))]
    if summaries:
        print("\n".join(summaries))
    tail = run.stdout[-6000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    assert re.search(r"\b1 passed", tail), tail


# The default suite runs test_mooncake_model_inner beside the Mooncake shards of
# tests/remote/test_mooncake.py (test_mooncake_suite_in_a_private_network_namespace, its
# MODEL), which wait on Mooncake clients' closes most of the time: this runner of the same
# test alone is for `make test-slow`.
@pytest.mark.slow
@pytest.mark.skipif(in_private_netns(), reason="this is the runner; it runs outside")
def test_mooncake_model_in_a_private_network_namespace() -> None:
    _mooncake_outer(0)


@pytest.mark.slow
@pytest.mark.timeout(int(SECONDS / 5) + 700)
@pytest.mark.skipif(in_private_netns(), reason="this is the runner; it runs outside")
def test_soak_mooncake() -> None:
    _mooncake_outer(SECONDS / 5)

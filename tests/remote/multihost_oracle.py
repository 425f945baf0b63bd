"""The oracle of the multi-host model: what every host may serve, judged from the
history of the run alone (no kvlife code decides it).

It records every put (a *version*: each put computes different bytes, so served bytes
name the put they came from), when its KV was created (``prepare_put`` or
``put_prompt``) and committed, every invalidation that returned (its time, its scope:
every host, or one host for a store's local ``invalidate``, and its selectors), every
wipe of the index (a Redis restart without persistence, ``FLUSHALL``) and every
revocation. Time is the schedule's step number: the driver runs one step at a time.

Every chunk a host serves is checked:

- its bytes are exactly one version's chunk for that key (an exact lookup), or, for a
  lossy lookup, exactly one or within the declared bound of a transform in use
  (``element_bounds``) of one; anything else (an ``int8`` frame handed out as exact
  KV, another key's bytes) is ``wrong-bytes``;
- that version is not covered by an invalidation that returned before the lookup
  started. A global rule covers every version created before it (even one published
  after it); a local rule covers, on its own host, the versions that host put since its
  last restart and created before the rule (``stale``);
- it was committed, and not aborted, before the load (``tentative``);
- a host revoked with a ban published nothing during the ban (``revoked-published``),
  unless the index lost its state meanwhile: a ban is a key in Redis, and a server
  that restarts empty forgets it (docs/remote.md: fencing across a restart needs
  persistence).

A rule stays in force when the index loses its state: an acknowledged invalidation
is never undone (issue 29 item 4 asks hosts to detect such an index and treat it as
new; the oracle asks that nothing invalidated comes back).

Every finding carries a label naming the hole of issue 29 it is an instance of (a
heuristic over the history; ``label()`` says how), so that a run with the known holes
can tell them from a new one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvlife.transforms import make_transform
from tests.conftest import TINY
from tests.remote.multihost_api import Criteria
from tests.remote.multihost_schedule import KeyInfo

CHUNK_SHAPE = TINY.chunk_shape


@dataclass(slots=True)
class Version:
    vid: int
    host: str
    incarnation: int
    prompt: int
    created: int
    """Step at which its KV was computed (``put_prompt`` or ``prepare_put``)."""
    chunks: dict[bytes, np.ndarray]
    committed: int | None = None
    aborted: int | None = None
    created_t: float = 0.0


@dataclass(frozen=True, slots=True)
class Rule:
    step: int
    """Step at which it returned."""
    crit: Criteria
    scope: str | None
    """None: every host (global); else the host whose store ran it (local)."""
    incarnation: int = 0
    bad: bool = False
    """A malformed selector (matches nothing; no lookup may break on it)."""


@dataclass(frozen=True, slots=True)
class Revocation:
    step: int
    target: str
    t_returned: float
    ban_ms: int


@dataclass(slots=True)
class Finding:
    label: str
    kind: str
    step: int
    host: str
    prompt: int
    chunk: int
    detail: str

    def __str__(self) -> str:
        return (
            f"[{self.label}] {self.kind} at step {self.step} on {self.host} "
            f"(prompt {self.prompt}, chunk {self.chunk}): {self.detail}"
        )


@dataclass(slots=True)
class Served:
    """One lookup's answer and what its load returned, as the oracle sees it."""

    host: str
    incarnation: int
    step: int
    """Step at which the lookup started."""
    t: float
    """Its start on the monotonic clock."""
    prompt: int
    keys: list[bytes]
    tiers: list[str]
    exactness: list[str]
    lossy: bool
    arrays: list[np.ndarray] = field(default_factory=list)
    load_step: int = -1
    """Step at which its load ran (-1: not loaded yet)."""


class Oracle:
    def __init__(self, keys: dict[bytes, KeyInfo], lossy_transforms: list[str]) -> None:
        self.keys = keys
        self.versions: list[Version] = []
        self.by_key: dict[bytes, list[Version]] = {}
        self.digests: dict[tuple[bytes, bytes], Version] = {}
        self.rules: list[Rule] = []
        self.wipes: list[int] = []
        self.revocations: list[Revocation] = []
        self.flushes: dict[str, list[int]] = {}
        self.transforms = [make_transform(t, {}) for t in lossy_transforms]
        self._bounds: dict[tuple[int, bytes, int], np.ndarray] = {}

    # ------------------------------------------------------------------ history

    def created(
        self,
        vid: int,
        host: str,
        incarnation: int,
        prompt: int,
        step: int,
        chunks: dict[bytes, np.ndarray],
        t: float,
    ) -> Version:
        v = Version(vid, host, incarnation, prompt, step, chunks, created_t=t)
        self.versions.append(v)
        for k, a in chunks.items():
            self.by_key.setdefault(k, []).append(v)
            self.digests[(k, a.tobytes())] = v
        return v

    def rule(self, step: int, crit: Criteria, scope: str | None, incarnation: int = 0) -> None:
        self.rules.append(Rule(step, crit, scope, incarnation, crit.raw_namespace is not None))

    def flushed(self, host: str, step: int) -> None:
        """``host`` flushed (or closed cleanly) at ``step``: what it had is published."""
        self.flushes.setdefault(host, []).append(step)

    def published(self, v: Version) -> int | None:
        """The step of the first flush of ``v``'s host after its commit (when it was
        published at the latest)."""
        if v.committed is None:
            return None
        return min((f for f in self.flushes.get(v.host, []) if f >= v.committed), default=None)

    def wiped(self, step: int) -> None:
        self.wipes.append(step)

    def revoked(self, step: int, target: str, t: float, ban_ms: int) -> None:
        self.revocations.append(Revocation(step, target, t, ban_ms))

    # ------------------------------------------------------------------ coverage

    def _selects(self, crit: Criteria, key: bytes) -> bool:
        if crit.raw_namespace is not None:
            return False  # no Namespace is named so: it selects nothing
        info = self.keys[key]
        if crit.namespace is not None and info.ns != crit.namespace:
            return False
        if crit.adapter_id is not None and info.adapter != crit.adapter_id:
            return False
        if crit.weights_digest is not None and info.weights != crit.weights_digest:
            return False
        return crit.prefix is None or crit.prefix in info.lineage

    def covering(self, v: Version, key: bytes, host: str, before: int) -> list[Rule]:
        """Rules that returned before step ``before`` and cover ``v``'s chunk ``key``
        for a lookup on ``host``."""
        out = []
        for r in self.rules:
            if r.step >= before or v.created >= r.step or not self._selects(r.crit, key):
                continue
            if r.scope is None or (r.scope == host == v.host and r.incarnation == v.incarnation):
                out.append(r)
        return out

    # ------------------------------------------------------------------ checks

    def _matches(self, key: bytes, got: np.ndarray, lossy: bool) -> tuple[list[Version], str]:
        """Versions ``got`` is a correct serving of, and what it is otherwise."""
        if got.dtype == np.float16 and got.shape == CHUNK_SHAPE:
            exact = self.digests.get((key, np.ascontiguousarray(got).tobytes()))
            if exact is not None:
                return [exact], ""
        else:
            return (
                [],
                f"a {got.dtype}{list(got.shape)} array, not a {list(CHUNK_SHAPE)} float16 chunk",
            )
        cands = self.by_key.get(key, [])
        if not cands:
            return [], "no put ever made this key"
        stack = np.stack([c.chunks[key].astype(np.float32) for c in cands])
        err = np.abs(stack - got.astype(np.float32)).reshape(len(cands), -1).max(axis=1)
        best = int(np.argmin(err))
        v = cands[best]
        within = any(
            np.all(
                np.abs(got.astype(np.float64) - v.chunks[key].astype(np.float64))
                <= self._bound(v, key, i)
            )
            for i in range(len(self.transforms))
        )
        if within and lossy:
            return [v], ""
        if within:
            return (
                [],
                f"within a lossy transform's bound of put {v.vid} but not exact "
                f"(max error {err[best]:.4f})",
            )
        return [], f"no put's bytes (nearest put {v.vid}, max error {err[best]:.4f})"

    def _bound(self, v: Version, key: bytes, i: int) -> np.ndarray:
        at = (v.vid, key, i)
        b = self._bounds.get(at)
        if b is None:
            got = self.transforms[i].element_bounds(v.chunks[key])
            assert got is not None, "a lossy transform declares its bound"
            b = self._bounds[at] = got
        return b

    def check(self, s: Served, claims: bool = True) -> list[Finding]:
        """Findings about the hits a lookup claimed (``claims``) and the arrays its load
        returned."""
        out: list[Finding] = []
        for i, (tier, exactness) in enumerate(zip(s.tiers, s.exactness, strict=True)):
            if claims and not s.lossy and exactness != "exact":
                out.append(
                    self._finding("lossy-for-exact", s, i, f"hit claims {exactness} from {tier}")
                )
        for i, got in enumerate(s.arrays):
            key = s.keys[i]
            vs, why = self._matches(key, got, s.lossy)
            if not vs:
                frame = got.dtype != np.float16 or got.shape != CHUNK_SHAPE
                out.append(
                    self._finding("wrong-bytes", s, i, f"from {s.tiers[i]}: {why}", frame=frame)
                )
                continue
            v = vs[0]
            at = s.load_step if s.load_step >= 0 else s.step
            if v.committed is None or v.committed >= at or v.aborted is not None:
                out.append(
                    self._finding(
                        "tentative",
                        s,
                        i,
                        f"put {v.vid} (on {v.host}) was not committed before the load",
                    )
                )
            rules = self.covering(v, key, s.host, s.step)
            if rules:
                r = rules[0]
                where = "every host" if r.scope is None else f"host {r.scope}"
                out.append(
                    self._finding(
                        "stale",
                        s,
                        i,
                        f"put {v.vid} by {v.host} created at step {v.created} (committed "
                        f"{v.committed}) served from {s.tiers[i]}, covered by the rule of step "
                        f"{r.step} for {where} {r.crit.to_json()}",
                        v,
                        r,
                    )
                )
            for rv in self.revocations:
                if (
                    rv.ban_ms > 0
                    and v.host == rv.target
                    and v.created > rv.step
                    and s.t < rv.t_returned + rv.ban_ms / 1000 - 0.05
                    and not any(rv.step < w < s.step for w in self.wipes)
                    and (s.host != v.host or s.tiers[i] == "shared")
                ):
                    out.append(
                        self._finding(
                            "revoked-published",
                            s,
                            i,
                            f"put {v.vid} by {v.host}, revoked at step {rv.step} with a ban "
                            f"of {rv.ban_ms} ms, reached {s.host} through the shared tier "
                            "during the ban",
                        )
                    )
        return out

    def raised(self, step: int, host: str, prompt: int, what: str, exc: BaseException) -> Finding:
        bad = [r for r in self.rules if r.bad]
        name = type(exc).__name__
        label = "item5" if bad and name == "InvalidArgument" else "raised"
        return Finding(label, f"{what}-raised", step, host, prompt, -1, f"{name}: {exc}")

    # ------------------------------------------------------------------ labels

    def _finding(
        self,
        kind: str,
        s: Served,
        i: int,
        detail: str,
        v: Version | None = None,
        r: Rule | None = None,
        frame: bool = False,
    ) -> Finding:
        label = self.label(kind, s, v, r, frame)
        at = s.load_step if s.load_step >= 0 else s.step
        if at != s.step:
            detail += f" (looked up at step {s.step})"
        return Finding(label, kind, at, s.host, s.prompt, i, detail)

    def label(
        self, kind: str, s: Served, v: Version | None, r: Rule | None, frame: bool = False
    ) -> str:
        """Which hole of issue 29 a finding is an instance of (a heuristic over the
        history, first match wins):

        - item3: a transform's frame served as KV, or lossy bytes under an exact
          lookup (reads never compare the record with the replica the lookup adopted);
        - item5: a lookup that raised InvalidArgument after a malformed rule;
        - item2: a stale version whose put was in flight across the rule (a global
          rule; or a local one: ``KVStore.invalidate`` leaves TENTATIVE objects to
          their put, the correctness issue's hole 5 that item 2 names);
        - item1: a stale version under a global rule, published after the rule (its
          epoch is read when it is published, not when its KV was created);
        - item4: a stale version served after a wipe of the index that came after a
          global rule (the rule was lost, or its epoch reused);
        - the kind itself for anything else (a new hole)."""
        if kind == "wrong-bytes":
            return "item3" if frame or not s.lossy else kind
        if kind != "stale" or v is None or r is None:
            return kind
        if v.committed is not None and v.created < r.step < v.committed:
            return "item2"  # global, or local: the correctness issue's hole 5
        pub = self.published(v)
        if r.scope is None and pub is not None and pub > r.step:
            return "item1"
        first_rule = min(
            (x.step for x in self.rules if x.scope is None and not x.bad), default=None
        )
        if first_rule is not None and any(first_rule < w < s.step for w in self.wipes):
            return "item4"
        return "stale" if r.scope is None else "stale-local"

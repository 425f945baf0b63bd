"""The oracle of the multi-host model: what every host may serve, and some of what it
must serve, judged from the history of the run alone (no kvlife code decides it).

It records every put (a *version*: each put computes different bytes, so served bytes
name the put they came from), when its KV was created (``prepare_put`` or
``put_prompt``), committed and made durable, every invalidation that returned (its
step and selectors), every wipe of the index (a Redis restart without persistence,
``FLUSHALL``), every invalidation whose outcome is unknown (it raised: it may or may
not have been recorded), every revocation, and when each host last surely read the
index. Time is the schedule's step number: the driver runs one step at a time.

Safety, for every chunk a host serves (docs/remote.md, "Invalidation across hosts: the
exact rules"):

- its bytes are exactly one version's chunk for that key (an exact lookup), or, for a
  lossy lookup, exactly one or within the declared bound of a transform in use
  (``element_bounds``) of one; anything else (an ``int8`` frame handed out as exact
  KV, another key's bytes) is ``wrong-bytes``;
- that version is not covered by a rule that returned before the lookup started: a
  rule covers every version created before it that its selectors match, on every host,
  published or not (``stale``). A wipe of the index is a rule that covers every version
  created before it: the index comes back as a new incarnation and every host drops
  what was created under the old one at its next lookup. (The documented rule covers
  more: a put prepared after a rule on a host that had not read the index since. When
  a host last read the index is not observable from outside precisely enough to check
  that part; it only makes a host serve less.)
- it was committed, and not aborted, before the load (``tentative``);
- a host revoked with a ban published nothing during the ban (``revoked-published``),
  unless the index lost its state meanwhile: a ban is a key of the index, and an index
  that lost its state forgot its bans (docs/remote.md: fencing across a restart needs
  persistence);
- nothing a host configured with another bucket count put is ever served by another
  host (``mismatch-published``).

Liveness (:meth:`Oracle.durable`): KV a host with a disk tier put and flushed is
still served by it later, across its restarts, unless something may have covered it: a
rule or wipe since the host last surely read the index before the put, or an
invalidation whose outcome is unknown (issue 29 item 6: a loss is ``lost``). The
runner adds its own liveness checks (a handoff between two hosts, a get that must
serve, records published after a revocation).

Every finding carries a label naming the hole of issue 29 it is an instance of (a
heuristic over the history; :meth:`Oracle.label` says how).
"""

from __future__ import annotations

from collections.abc import Iterable
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
    stored: int = -1
    """Chunks its put stored (-1: not known yet)."""
    durable: int | None = None
    """Step of the first flush (or clean close) of its host after its commit, in the
    same host incarnation, when its put stored every chunk."""


@dataclass(frozen=True, slots=True)
class Rule:
    step: int
    """Step at which it returned (a wipe: at which it happened)."""
    crit: Criteria | None
    """The selectors; None: every version (a wipe, or an unknown outcome)."""
    kind: str = "rule"
    """``rule``, ``wipe`` (the index lost its state) or ``unknown`` (an invalidation
    that raised: not a rule the safety checks may rely on, but one the liveness
    checks must allow for)."""


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
    load_t: float = 0.0
    """When its load began (0: not loaded yet): what the load read was visible then (a
    load after its lookup may read a record published since, for the same key)."""


class Oracle:
    def __init__(self, keys: dict[bytes, KeyInfo], lossy_transforms: list[str]) -> None:
        self.keys = keys
        self.versions: list[Version] = []
        self.by_key: dict[bytes, list[Version]] = {}
        self.digests: dict[tuple[bytes, bytes], Version] = {}
        self.rules: list[Rule] = []
        self.revocations: list[Revocation] = []
        self.flushes: dict[str, list[int]] = {}
        self.reads: dict[tuple[str, int], list[int]] = {}
        """(host, incarnation) -> steps at which that host surely read the index."""
        self.misconfigured: set[str] = set()
        self.bad_rules_tried = 0
        self.transforms = [make_transform(t, {}) for t in lossy_transforms]
        self._bounds: dict[tuple[int, bytes, int], np.ndarray] = {}

    # ------------------------------------------------------------------ history

    def know(self, keys: dict[bytes, KeyInfo]) -> None:
        """Keys of prompts made up during the run (fresh prompts)."""
        self.keys.update(keys)

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

    def rule(self, step: int, crit: Criteria) -> None:
        """A global invalidation returned at ``step``."""
        self.rules.append(Rule(step, crit))

    def unknown_rule(self, step: int) -> None:
        """An invalidation raised at ``step``: recorded or not, applied here or not."""
        self.rules.append(Rule(step, None, "unknown"))

    def wiped(self, step: int) -> None:
        self.rules.append(Rule(step, None, "wipe"))

    @property
    def wipes(self) -> list[int]:
        return [r.step for r in self.rules if r.kind == "wipe"]

    def read(self, host: str, incarnation: int, step: int) -> None:
        """``host`` surely read the index during ``step`` (a lookup that did, a rule it
        recorded)."""
        self.reads.setdefault((host, incarnation), []).append(step)

    def flushed(self, host: str, incarnation: int, step: int) -> None:
        """``host`` flushed (or closed cleanly) at ``step``: what it had is durable in
        its first durable tier, and published where that is the shared tier."""
        self.flushes.setdefault(host, []).append(step)
        for v in self.versions:
            if (
                v.host == host
                and v.incarnation == incarnation
                and v.durable is None
                and v.committed is not None
                and v.committed < step
                and v.aborted is None
                and v.stored == len(v.chunks)
            ):
                v.durable = step

    def published(self, v: Version) -> int | None:
        """The step of the first flush of ``v``'s host after its commit (when it was
        published at the latest)."""
        if v.committed is None:
            return None
        return min((f for f in self.flushes.get(v.host, []) if f >= v.committed), default=None)

    def revoked(self, step: int, target: str, t: float, ban_ms: int) -> None:
        self.revocations.append(Revocation(step, target, t, ban_ms))

    # ------------------------------------------------------------------ coverage

    def _selects(self, crit: Criteria | None, key: bytes) -> bool:
        if crit is None:
            return True
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

    def covering(self, v: Version, key: bytes, before: int) -> list[Rule]:
        """Rules and wipes that happened before step ``before`` and cover ``v``'s chunk
        ``key`` (created before them, selected by them)."""
        return [
            r
            for r in self.rules
            if r.kind != "unknown" and v.created < r.step < before and self._selects(r.crit, key)
        ]

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
            # (a step that puts and then loads, a handoff, commits before it loads)
            if v.committed is None or v.committed > at or v.aborted is not None:
                out.append(
                    self._finding(
                        "tentative",
                        s,
                        i,
                        f"put {v.vid} (on {v.host}) was not committed before the load",
                    )
                )
            rules = self.covering(v, key, s.step)
            if rules:
                r = rules[0]
                what = "wipe of the index" if r.kind == "wipe" else f"rule {r.crit.to_json()}"  # type: ignore[union-attr]
                out.append(
                    self._finding(
                        "stale",
                        s,
                        i,
                        f"put {v.vid} by {v.host} created at step {v.created} (committed "
                        f"{v.committed}) served from {s.tiers[i]}, covered by the {what} of "
                        f"step {r.step}",
                        v,
                        r,
                    )
                )
            if v.host in self.misconfigured and s.host != v.host:
                out.append(
                    self._finding(
                        "mismatch-published",
                        s,
                        i,
                        f"put {v.vid} by {v.host}, a host configured with another bucket "
                        f"count, reached {s.host} from {s.tiers[i]}",
                    )
                )
            for rv in self.revocations:
                if (
                    rv.ban_ms > 0
                    and v.host == rv.target
                    and v.created > rv.step
                    and (s.load_t or s.t) < rv.t_returned + rv.ban_ms / 1000 - 0.05
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

    def durable(self, host: str, prompt: int, keys: Iterable[bytes], step: int) -> Version | None:
        """The version of ``prompt`` that ``host`` (a host with a disk tier) must serve
        at ``step``, if any: put there with every chunk stored, made durable by a flush,
        and nothing since the host last surely read the index before the put (a rule or
        a wipe after that read, an invalidation of unknown outcome) may cover any chunk
        of it. (The put's creation stamp is at least that read's state, so no rule
        before it covers the put.)"""
        keys = list(keys)
        best: Version | None = None
        for v in self.versions:
            if v.host != host or v.prompt != prompt or v.durable is None or v.durable >= step:
                continue
            reads = [r for r in self.reads.get((host, v.incarnation), []) if r < v.created]
            if not reads:
                continue
            since = max(reads)
            if any(
                since < r.step < step and any(self._selects(r.crit, k) for k in keys)
                for r in self.rules
            ):
                continue
            if best is None or v.created > best.created:
                best = v
        return best

    def raised(self, step: int, host: str, prompt: int, what: str, exc: BaseException) -> Finding:
        name = type(exc).__name__
        label = "item5" if self.bad_rules_tried and name == "InvalidArgument" else "raised"
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
          lookup (reads never compared the record with the replica the lookup adopted);
        - item5: a lookup that raised InvalidArgument after a malformed rule was tried;
        - item4: a stale version covered by a wipe of the index (a rule lost with it, an
          epoch reused, an old incarnation's objects kept);
        - item2: a stale version whose put was in flight across the rule;
        - item1: a stale version published after the rule (its epoch was read when it
          was published, not when its KV was created);
        - the kind itself for anything else (a new hole)."""
        if kind == "wrong-bytes":
            return "item3" if frame or not s.lossy else kind
        if kind != "stale" or v is None or r is None:
            return kind
        if r.kind == "wipe":
            return "item4"
        if v.committed is not None and v.created < r.step < v.committed:
            return "item2"
        pub = self.published(v)
        if pub is not None and pub > r.step:
            return "item1"
        return "stale"

"""The model test of the whole public store API: one hypothesis state machine (and a seeded
stress driver over the same rules) that drives a :class:`~tests.helpers.oracle_targets.Target`
and checks every answer with the :class:`~tests.helpers.oracle.Oracle`.

Rules interleave puts (one call, and prepare / commit / commit in the background /
abort), lookups and loads (at once or later, synchronous or ``load_async`` with
``chunk(i)``, into new arrays, fresh buffers or a reused buffer pool), scribbles into
every array a call returned or was given (after the call, right after a load while its
promotion is pending, while a demotion runs), invalidations of every kind (racing puts
in flight), evictions, flushes, drains, audits, reopens with and without flush, and
damage to a replica's frame. ``c`` in a rule names the client process of a served
target (an embedded target has one store and ignores it).
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    multiple,
    precondition,
    rule,
)

from kvlife.core.errors import KVLifeError
from kvlife.core.identity import ChunkKey
from tests.helpers.oracle import (
    ADAPTER,
    CHUNK,
    FINDING_KINDS,
    HOLE_KINDS,
    MAX_CHUNKS,
    NAMESPACES,
    SEQS,
    Oracle,
    PromptSpec,
    Universe,
    Violation,
    rules_off,
)
from tests.helpers.oracle_targets import DRAM_CHUNKS, AsyncOut, LoadOut, Target, prefix_audit

INVALIDATIONS = (
    "prefix",
    "namespace",
    "weights",
    "adapter",
    "prefix+namespace",
    "prefix+weights",
    "namespace+weights",
    "adapter+namespace",
)
MODES = ("new", "outs", "pool")
"""Loads into new arrays, into fresh caller buffers, into a reused buffer pool."""
FORMS = ("whole", "chunks")
"""KV of a put: one array of the whole prompt, or one array per chunk."""

CLIENT = st.integers(0, 1)
FRESH = st.builds(
    PromptSpec,
    seq=st.integers(0, SEQS - 1),
    ident=st.integers(0, 2),
    ns=st.integers(0, len(NAMESPACES) - 1),
    length=st.integers(1, MAX_CHUNKS),
    tail=st.booleans(),
)
"""A prompt of the universe (rules that put one add it to ``prompts``)."""


@dataclass(slots=True)
class PendingRef:
    c: int
    hid: int
    pid: int
    spec: PromptSpec
    epoch: int

    def __repr__(self) -> str:
        return f"<pending put {self.pid} of {self.spec}>"


@dataclass(slots=True)
class CommitRef:
    c: int
    fid: int
    pid: int
    start: int
    write_through: bool
    """The store's setting when the commit ran."""
    done: bool = False

    def __repr__(self) -> str:
        return f"<background commit of put {self.pid}>"


@dataclass(slots=True)
class LookupRef:
    c: int
    lid: int
    spec: PromptSpec
    keys: list[ChunkKey]
    epoch: int

    def __repr__(self) -> str:
        return f"<lookup of {self.spec}: {len(self.keys)} hits>"


@dataclass(slots=True)
class LoadRef:
    c: int
    aid: int
    keys: list[ChunkKey]
    start: int
    epoch: int

    def __repr__(self) -> str:
        return f"<load_async of {len(self.keys)} hits>"


def group(name: str) -> Callable[[Any], Any]:
    """Run the rule only while its group is switched on (``KVLIFE_ORACLE_RULES_OFF``)."""
    return precondition(lambda self: name not in self.off)


class OracleMachine(RuleBasedStateMachine):
    """Rules over a target; subclasses say which (``make_target``)."""

    prompts = Bundle("prompts")
    pendings = Bundle("pendings")
    commits = Bundle("commits")
    lookups = Bundle("lookups")
    loads = Bundle("loads")

    max_reopens = 3
    """Reopens (restarts of a served store) per example."""
    fixable = True
    """``check(fix=True)`` is offered (not through a server)."""

    def __init__(self) -> None:
        super().__init__()
        self.off = rules_off()
        self.u, self.t = self.make_target()
        self.o = Oracle(self.u)
        self.reopens = 0
        self.live_pendings = 0
        self.async_commits: dict[int, CommitRef] = {}

    def make_target(self) -> tuple[Universe, Target]:
        raise NotImplementedError

    def teardown(self) -> None:
        self.t.close()

    # ------------------------------------------------------------------ helpers

    def _sync(self) -> int:
        now = self.o.tick()
        self.t.sync(now)
        return now

    def _probe(self) -> None:
        """Every chunk the store holds for sure is found (or its loss was counted)."""
        self._sweep(sorted(self.o.held))

    def _sweep(self, keys: list[ChunkKey]) -> None:
        """Look up each chunk on its own (by its parent and position): one that may not be
        served must not be found, one the store holds for sure must be (or its loss was
        counted). Probing in key order also reorders the tiers' recency."""
        for key in keys:
            spec, i = self.u.chunk_ref(key)
            s = self.o.tick()
            hits, _ = self.t.lookup(0, spec, chunk=i, keep=False)
            e = self._sync()
            self.o.check_hits(spec, hits, s, e, first=i)
            if not hits:
                self._missing(key, "probe")

    def _missing(self, key: ChunkKey, what: str) -> None:
        """A lookup did not find ``key``. If the store held it for sure, its loss must be
        a counted event; a chunk being demoted stays served from its source until its
        copy lands, so a miss that a look after the background work ran does not repeat
        is a violation too (it was one, counted nowhere)."""
        if key not in self.o.held:
            return
        self.t.drain(0)
        spec, i = self.u.chunk_ref(key)
        s = self.o.tick()
        hits, _ = self.t.lookup(0, spec, chunk=i, keep=False)
        self.o.check_hits(spec, hits, s, self._sync(), first=i)
        if hits:
            self.o.fail(
                FINDING_KINDS["demoting-miss"],
                f"{what}: chunk {i} of {spec} ({key.hex()[:12]}), held, was missed while "
                "background work ran and found once it had",
            )
        else:
            self.o.check_missing(key, self.t.explained, what)

    def _check_load(self, keys: list[ChunkKey], out: LoadOut, start: int, end: int) -> bool:
        """Check a load's answer; False if it served fewer chunks than asked for with no
        corrupt replica among them."""
        self.o.check_served(keys, out.served, start, end)
        self.o.check_corrupt(out.corrupt)
        if out.read_errors:
            self.o.fail("read-error", f"{out.read_errors} read errors with no fault injected")
        return len(out.served) == len(keys) or bool(out.corrupt)

    def _stale(self, epoch: int) -> bool:
        return epoch != self.o.epoch

    # ------------------------------------------------------------------ prompts

    @initialize(
        target=prompts,
        dram_chunks=st.sampled_from(DRAM_CHUNKS),
        seq=st.integers(0, SEQS - 1),
        ident=st.integers(0, 2),
        ns=st.integers(0, len(NAMESPACES) - 1),
        length=st.integers(1, MAX_CHUNKS),
    )
    def setup(self, dram_chunks: int, seq: int, ident: int, ns: int, length: int) -> PromptSpec:
        """Size the DRAM tier (in chunks) and put a first prompt."""
        return self._setup(dram_chunks, PromptSpec(seq, ident, ns, length))

    def _setup(self, dram_chunks: int, p: PromptSpec) -> PromptSpec:
        self.t.configure(dram_chunks)
        return self._put(p, "chunks", 0)

    @rule(target=prompts, p=prompts, length=st.integers(1, MAX_CHUNKS))
    def resize(self, p: PromptSpec, length: int) -> PromptSpec:
        """The same prompt, cut or extended (its prefix chunks are shared)."""
        return PromptSpec(p.seq, p.ident, p.ns, length, p.tail)

    # ------------------------------------------------------------------ puts

    @rule(target=prompts, p=st.one_of(prompts, FRESH), form=st.sampled_from(FORMS), c=CLIENT)
    def put(self, p: PromptSpec, form: str, c: int) -> PromptSpec:
        """``put_prompt`` of a prompt seen before or a new one (which later rules see)."""
        return self._put(p, form, c)

    def _put(self, p: PromptSpec, form: str, c: int) -> PromptSpec:
        s = self.o.tick()
        out = self.t.put(c, p, form)
        e = self._sync()
        self.o.put_prompt(
            p, out.written, s, e, out.present, out.covered, out.dropped, self.t.write_through
        )
        return p

    @group("two_phase")
    @precondition(lambda self: self.live_pendings < 4)
    @rule(target=pendings, p=st.one_of(prompts, FRESH), form=st.sampled_from(FORMS), c=CLIENT)
    def prepare(self, p: PromptSpec, form: str, c: int) -> PendingRef:
        s = self.o.tick()
        out = self.t.prepare(c, p, form)
        e = self._sync()
        pid = len(self.o.pendings)
        self.o.prepared(pid, p, out.written, s, e)
        self.live_pendings += 1
        return PendingRef(c, out.hid, pid, p, self.o.epoch)

    @group("two_phase")
    @rule(
        target=commits,
        ref=consumes(pendings),
        how=st.sampled_from(["commit", "background", "abort"]),
    )
    def finish(self, ref: PendingRef, how: str) -> object:
        """``commit_put``, ``put_async`` (awaited by a later rule) or ``abort_put``; a put
        prepared before a reopen is gone (a typed error)."""
        self.live_pendings -= 1
        if how == "background" and "background" in self.off:
            how = "commit"
        s = self.o.tick()
        if self._stale(ref.epoch):
            try:
                if how == "abort":
                    self.t.abort(ref.c, ref.hid)
                elif how == "commit":
                    self.t.commit(ref.c, ref.hid)
                else:
                    self.t.await_commit(ref.c, self.t.commit_async(ref.c, ref.hid))
            except KVLifeError:
                pass
            else:
                self.o.fail("stale-put-finished", f"{ref} of an earlier session was finished")
            self.o.aborted(ref.pid)
            return multiple()
        if how == "abort":
            self.t.abort(ref.c, ref.hid)
            self._sync()
            self.o.aborted(ref.pid)
            return multiple()
        self.o.commit_started(ref.pid, s)
        if how == "commit":
            try:
                out = self.t.commit(ref.c, ref.hid)
            except KVLifeError:
                if not self.o.revoked(ref.pid):
                    raise
                self.o.aborted(ref.pid)  # refused: an invalidation covered it in flight
                return multiple()
            e = self._sync()
            self.o.committed(ref.pid, out.covered, out.dropped, self.t.write_through, s, e)
            return multiple()
        got = CommitRef(
            ref.c, self.t.commit_async(ref.c, ref.hid), ref.pid, s, self.t.write_through
        )
        self.async_commits[got.pid] = got
        return got

    def _resolve(self, ref: CommitRef, ended_by_close: bool = False) -> None:
        if ref.done:
            return
        ref.done = True
        del self.async_commits[ref.pid]
        try:
            out = self.t.await_commit(ref.c, ref.fid)
        except KVLifeError as exc:
            if not ended_by_close and not self.o.revoked(ref.pid):
                raise Violation("background-commit-failed", f"{ref}: {exc!r}") from exc
            self.o.aborted(ref.pid)
            return
        e = self._sync()
        self.o.committed(ref.pid, out.covered, out.dropped, ref.write_through, ref.start, e)

    @group("two_phase")
    @rule(ref=consumes(commits))
    def await_commit(self, ref: CommitRef) -> None:
        self._resolve(ref)

    # ------------------------------------------------------------------ reads

    def _lookup(self, p: PromptSpec, c: int, keep: bool) -> tuple[list[ChunkKey], int]:
        s = self.o.tick()
        hits, lid = self.t.lookup(c, p, keep=keep)
        e = self._sync()
        self.o.check_hits(p, hits, s, e)
        if len(hits) < p.length:
            self._missing(self.u.keys(p)[len(hits)], f"lookup of {p}")
        return hits, lid

    @rule(
        p=prompts,
        mode=st.sampled_from(MODES),
        scribble_now=st.booleans(),
        c=CLIENT,
    )
    def lookup_and_load(self, p: PromptSpec, mode: str, scribble_now: bool, c: int) -> None:
        """Look up and load at once; ``scribble_now`` writes into what the load handed out
        right away (its promotion may still be pending), lets the background work run
        and loads again."""
        scribble_now = scribble_now and "scribble" not in self.off
        for _ in range(2 if scribble_now else 1):
            if not self._lookup_load(p, mode, scribble_now, c):
                # a hit may leave service while background work moves it: once that ran,
                # a lookup's hits load
                self.t.drain(c)
                if not self._lookup_load(p, mode, False, c):
                    self.o.fail(
                        "hit-not-served", f"a load of {p} right after its lookup fell short"
                    )
            if scribble_now:
                self.t.drain(c)

    def _lookup_load(self, p: PromptSpec, mode: str, scribble_now: bool, c: int) -> bool:
        hits, lid = self._lookup(p, c, keep=True)
        s = self.o.tick()
        out = self.t.load(c, lid, mode, scribble_now)
        return self._check_load(hits, out, s, self._sync())

    @rule(target=lookups, p=prompts, c=CLIENT)
    def lookup_for_later(self, p: PromptSpec, c: int) -> LookupRef:
        hits, lid = self._lookup(p, c, keep=True)
        return LookupRef(c, lid, p, hits, self.o.epoch)

    @rule(
        target=loads,
        ref=consumes(lookups),
        how=st.sampled_from(["load", "async", "async_depth_1", "async_depth_2"]),
        mode=st.sampled_from(MODES),
        scribble_now=st.booleans(),
    )
    def load_later(self, ref: LookupRef, how: str, mode: str, scribble_now: bool) -> object:
        """Load a lookup after other rules ran (chunks may have gone meanwhile): ``load``
        now, or ``load_async`` (reads in flight at most ``depth``), whose chunks a later
        rule takes."""
        s = self.o.tick()
        if how == "load" or "async_load" in self.off:
            out = self.t.load(ref.c, ref.lid, mode, scribble_now and "scribble" not in self.off)
            self._check_load(ref.keys, out, s, self._sync())
            return multiple()
        depth = int(how.rpartition("_")[2]) if how != "async" else 0
        aid = self.t.load_async_start(ref.c, ref.lid, mode, depth)
        return LoadRef(ref.c, aid, ref.keys, s, self.o.epoch)

    @group("async_load")
    @rule(ref=consumes(loads), reverse=st.booleans(), scribble_now=st.booleans())
    def load_async_chunks(self, ref: LoadRef, reverse: bool, scribble_now: bool) -> None:
        """``chunk(i)`` for every hit (in order or last first), each checked as it comes
        and scribbled at once if asked (later chunks still in flight), then ``wait()``."""
        out: AsyncOut = self.t.load_async_finish(
            ref.c, ref.aid, reverse, scribble_now and "scribble" not in self.off
        )
        e = self._sync()
        served = [b for b in out.chunks if b is not None]
        if out.chunks[: len(served)] != served:
            self.o.fail("chunk-after-a-miss", f"chunk(i) served a chunk after a miss: {ref}")
        self.o.check_served(ref.keys, served, ref.start, e)
        if out.result is not None:
            self.o.check_corrupt(out.result.corrupt)
        elif not out.error_module.startswith("kvlife."):
            self.o.fail(FINDING_KINDS["async-close"], f"{ref}: wait() raised {out.error}")
        elif not self._stale(ref.epoch):
            self.o.fail("async-load-failed", f"{ref}: {out.error}")

    # ------------------------------------------------------------------ management

    def _criteria(self, kind: str, p: PromptSpec, i: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """The store's invalidate() arguments for ``kind`` of prompt ``p``, and the
        model's."""
        parts = kind.split("+")
        crit: dict[str, Any] = {}
        model: dict[str, Any] = {}
        if "weights" in parts:
            crit["weights_digest"] = model["weights"] = self.u.weights(p.ident)
        if "adapter" in parts:
            crit["adapter_id"] = model["adapter"] = ADAPTER
        if "namespace" in parts:
            crit["namespace"] = NAMESPACES[p.ns]
            model["namespace"] = p.ns
        if "prefix" in parts:
            crit["prefix"] = model["prefix"] = self.u.keys(p)[i % p.length]
        return crit, model

    def _invalidate(self, kind: str, p: PromptSpec, i: int, c: int) -> None:
        crit, model = self._criteria(kind, p, i)
        s = self.o.tick()
        self.t.invalidate(c, **crit)
        covered = self.o.invalidated(s, self._sync(), **model)
        self._sweep(sorted(covered))  # none of them may be found any more

    @group("invalidate")
    @rule(
        kind=st.sampled_from(INVALIDATIONS),
        of=st.one_of(prompts, pendings),
        i=st.integers(0, MAX_CHUNKS - 1),
        c=CLIENT,
    )
    def invalidate(self, kind: str, of: PromptSpec | PendingRef, i: int, c: int) -> None:
        """Invalidate by the weights, the adapter, the namespace or the chunk ``i`` (and
        what is chained after it) of a prompt, or of a pending put (one in flight), or by
        several of those at once; then no chunk it covers may be found."""
        self._invalidate(kind, of.spec if isinstance(of, PendingRef) else of, i, c)

    @group("two_phase")
    @group("invalidate")
    @group("background")
    @rule(
        ref=consumes(pendings),
        kind=st.sampled_from(INVALIDATIONS),
        i=st.integers(0, MAX_CHUNKS - 1),
    )
    def commit_racing_invalidation(self, ref: PendingRef, kind: str, i: int) -> None:
        """``commit_put`` of a pending put while its own chunks are invalidated at the
        same time (another thread; through a server, the other client process)."""
        if self._stale(ref.epoch):
            self.finish(ref, "commit")
            return
        self.live_pendings -= 1
        crit, model = self._criteria(kind, ref.spec, i)
        s = self.o.tick()
        self.o.commit_started(ref.pid, s)
        got, _ = self.t.race_commit_invalidate(ref.c, ref.hid, crit)
        e = self._sync()
        covered = self.o.invalidated(s, e, **model)
        if isinstance(got, KVLifeError):
            self.o.aborted(ref.pid)
        else:
            self.o.committed(ref.pid, got.covered, got.dropped, self.t.write_through, s, e)
        self._sweep(sorted(covered))

    @group("evict")
    @rule(
        tier=st.sampled_from(["dram", "disk"]),
        chunks=st.integers(1, 4),
        scribbling=st.booleans(),
        c=CLIENT,
    )
    def evict(self, tier: str, chunks: int, scribbling: bool, c: int) -> None:
        """Evict ``chunks`` chunks' worth (DRAM victims are demoted to disk), scribbling
        into every handed-out array while the demotions run if asked."""
        scribbling = scribbling and not {"scribble", "background"} & self.off
        self.t.evict(c, tier, chunks * CHUNK, scribbling)
        self._sync()
        if tier == "disk":
            self.o.disk_evicted()
            self._probe()

    @group("scribble")
    @rule(c=CLIENT)
    def scribble(self, c: int) -> None:
        """Write garbage into every array and buffer a call returned or was given."""
        self.t.scribble(c)

    @rule(flush=st.booleans(), c=CLIENT)
    def settle(self, flush: bool, c: int) -> None:
        """``drain()`` (background promotions run) or ``flush()`` (everything durable)."""
        if not flush:
            self.t.drain(c)
            self._sync()
            return
        self._probe()
        self.t.flush(c)
        self._sync()
        self.o.flushed()

    @group("check")
    @rule(fix=st.booleans(), c=CLIENT)
    def check(self, fix: bool, c: int) -> None:
        fix = fix and self.fixable
        out = self.t.check(c, fix)
        self._sync()
        stray = [k for k in out.bad_keys if k not in self.o.damaged]
        if stray:
            self.o.fail("check-blames-undamaged", f"check found {len(stray)} undamaged bad")
        if not self.o.damaged and (out.problems or out.quarantined):
            self.o.fail(
                "check-unclean",
                f"nothing was damaged, check says {out.problems + out.quarantined}",
            )
        if out.orphans:  # never damaged by a rule: a segment file the store left behind
            self.o.fail(
                FINDING_KINDS["orphan"],
                f"check lists segment files no row names: {out.orphans}",
            )
        if fix:
            for key in out.bad_keys:
                self.o.lose(key)

    @group("reopen")
    @precondition(lambda self: self.reopens < self.max_reopens)
    @rule(
        flush=st.booleans(),
        crash=st.booleans(),
        write_through=st.booleans(),
        put_first=st.none() | prompts,
    )
    def reopen(
        self, flush: bool, crash: bool, write_through: bool, put_first: PromptSpec | None
    ) -> None:
        """Close with or without flush (a served store: stop, or kill), right after a put
        if ``put_first``, open again (write-through or not); then every durable chunk is
        found, and every chain is reachable from its first chunk."""
        if put_first is not None:
            self._put(put_first, "chunks", 0)
        self.reopens += 1
        if flush and not crash:
            self._probe()
        image, flush = self.t.reopen(flush, crash, write_through)
        try:
            self._audit_prefixes(image)
        finally:
            shutil.rmtree(image, ignore_errors=True)
        for ref in list(self.async_commits.values()):
            self._resolve(ref, ended_by_close=True)
        self.o.closed(flush)
        self.live_pendings = 0
        self._sync()
        self._sweep(sorted(self.u.meta))  # nothing invalidated came back, nothing durable went

    def _audit_prefixes(self, image: Path) -> None:
        """On a copy of the closed store's files: invalidating each chain's first chunk
        by prefix reaches every chunk chained after it (issue 18, hole 4)."""
        roots = sorted(
            {
                m.ancestors[0]
                for k, m in self.u.meta.items()
                if m.ancestors and self.o.logs[k].writes
            }
        )
        for _root, key in prefix_audit(image, self.u, roots):
            spec, i = self.u.chunk_ref(key)
            self.o.fail(
                HOLE_KINDS["4"],
                f"after a reopen, invalidate(prefix=chunk 0) of {spec} left its chunk {i} "
                f"({key.hex()[:12]}) findable (on a copy of the closed store's files)",
            )

    @group("corrupt")
    @rule(p=prompts, i=st.integers(0, MAX_CHUNKS - 1), part=st.sampled_from(["payload", "header"]))
    def corrupt(self, p: PromptSpec, i: int, part: str) -> None:
        """Damage the disk frame of the prompt's chunk ``i`` in its segment file."""
        key = self.u.keys(p)[i % p.length]
        if self.t.corrupt(key, part):
            self.o.damage(key)
        self._sync()


# ---------------------------------------------------------------------------- stress


def stress(machine: OracleMachine, seed: int, steps: int, log: list[str]) -> None:
    """Run ``steps`` random rules on ``machine`` from ``seed``: the same rules, drawn by a
    seeded generator instead of hypothesis (no shrinking, far longer runs). Every step is
    appended to ``log`` as the call it made, so a failure can be read and replayed."""
    rng = random.Random(seed)
    m = machine
    prompts: list[PromptSpec] = []
    pools: dict[str, list[Any]] = {"pendings": [], "commits": [], "lookups": [], "loads": []}

    def prompt() -> PromptSpec:
        if prompts and rng.random() < 0.75:
            p = rng.choice(prompts[-8:])
            if rng.random() < 0.25:
                p = PromptSpec(p.seq, p.ident, p.ns, rng.randint(1, MAX_CHUNKS), p.tail)
            return p
        p = PromptSpec(
            rng.randrange(SEQS),
            rng.randrange(3),
            rng.randrange(len(NAMESPACES)),
            rng.randint(1, MAX_CHUNKS),
            rng.random() < 0.2,
        )
        prompts.append(p)
        return p

    def take(pool: str) -> Any:
        items = pools[pool]
        return items.pop(rng.randrange(len(items)))

    def c() -> int:
        return rng.randrange(2)

    def on(g: str) -> bool:
        return g not in m.off

    table: list[tuple[float, Callable[[], bool], str, Callable[[], dict[str, Any]], str]] = [
        (6, lambda: True, "put", lambda: {"p": prompt(), "form": rng.choice(FORMS), "c": c()}, ""),
        (
            3,
            lambda: on("two_phase") and m.live_pendings < 4,
            "prepare",
            lambda: {"p": prompt(), "form": rng.choice(FORMS), "c": c()},
            "pendings",
        ),
        (
            3,
            lambda: bool(pools["pendings"]),
            "finish",
            lambda: {
                "ref": take("pendings"),
                "how": rng.choice(["commit", "commit", "background", "abort"]),
            },
            "commits",
        ),
        (1, lambda: bool(pools["commits"]), "await_commit", lambda: {"ref": take("commits")}, ""),
        (
            6,
            lambda: True,
            "lookup_and_load",
            lambda: {
                "p": prompt(),
                "mode": rng.choice(MODES),
                "scribble_now": rng.random() < 0.4,
                "c": c(),
            },
            "",
        ),
        (
            2,
            lambda: len(pools["lookups"]) < 6,
            "lookup_for_later",
            lambda: {"p": prompt(), "c": c()},
            "lookups",
        ),
        (
            2,
            lambda: bool(pools["lookups"]),
            "load_later",
            lambda: {
                "ref": take("lookups"),
                "how": rng.choice(["load", "async", "async_depth_1", "async_depth_2"]),
                "mode": rng.choice(MODES),
                "scribble_now": rng.random() < 0.4,
            },
            "loads",
        ),
        (
            1,
            lambda: bool(pools["loads"]),
            "load_async_chunks",
            lambda: {
                "ref": take("loads"),
                "reverse": rng.random() < 0.5,
                "scribble_now": rng.random() < 0.5,
            },
            "",
        ),
        (
            3,
            lambda: on("invalidate"),
            "invalidate",
            lambda: {
                "kind": rng.choice(INVALIDATIONS),
                "of": rng.choice(pools["pendings"])
                if pools["pendings"] and rng.random() < 0.4
                else prompt(),
                "i": rng.randrange(MAX_CHUNKS),
                "c": c(),
            },
            "",
        ),
        (
            2,
            lambda: on("evict"),
            "evict",
            lambda: {
                "tier": rng.choice(["dram", "dram", "disk"]),
                "chunks": rng.randint(1, 4),
                "scribbling": rng.random() < 0.3,
                "c": c(),
            },
            "",
        ),
        (1, lambda: on("scribble"), "scribble", lambda: {"c": c()}, ""),
        (2, lambda: True, "settle", lambda: {"flush": rng.random() < 0.5, "c": c()}, ""),
        (0.3, lambda: on("check"), "check", lambda: {"fix": rng.random() < 0.5, "c": c()}, ""),
        (
            1,
            lambda: on("reopen") and m.reopens < m.max_reopens,
            "reopen",
            lambda: {
                "flush": rng.random() < 0.5,
                "crash": rng.random() < 0.3,
                "write_through": rng.random() < 0.3,
                "put_first": prompt() if rng.random() < 0.5 else None,
            },
            "",
        ),
        (
            0.3,
            lambda: on("corrupt"),
            "corrupt",
            lambda: {
                "p": prompt(),
                "i": rng.randrange(MAX_CHUNKS),
                "part": rng.choice(["payload", "header"]),
            },
            "",
        ),
    ]
    first = PromptSpec(
        rng.randrange(SEQS), rng.randrange(3), rng.randrange(len(NAMESPACES)), MAX_CHUNKS
    )
    dram = rng.choice(DRAM_CHUNKS)
    log.append(f"setup(dram_chunks={dram}, p={first!r})")
    prompts.append(m._setup(dram, first))
    for step in range(steps):
        ready = [row for row in table if row[1]()]
        x = rng.random() * sum(row[0] for row in ready)
        chosen = ready[-1]
        for row in ready:
            x -= row[0]
            if x <= 0:
                chosen = row
                break
        _, _, name, args, into = chosen
        kwargs = args()
        log.append(f"{step}: {name}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})")
        got = getattr(m, name)(**kwargs)
        if into and isinstance(got, (PendingRef, CommitRef, LookupRef, LoadRef)):
            pools[into].append(got)
    m._probe()

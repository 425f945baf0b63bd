"""The oracle of the model test of the public store API: a small universe of prompts whose
every payload is a pure function of its chunk key, and a model of what a store may serve,
must keep and must not serve, checked against every answer the store gives.

Used by the embedded and the served machines (:mod:`tests.helpers.oracle_machine`). The
model is a logical clock: every call gets a start and an end tick. Its invariants:

- **Bytes.** Every served chunk is bit-exact the payload of its key (no representation
  but the exact one is asked for), whatever the caller did to arrays it was handed.
- **Invalidation.** A chunk covered by an invalidation that ended before a lookup or a
  load started is not served, unless a put that wrote it was prepared after that
  invalidation started. A put prepared before the invalidation and committed after it
  (a put in flight) does not bring it back; neither does a put that found the chunk
  ``present``; and a prefix covers every chunk chained after it, across reopens.
- **Durability.** A chunk acknowledged durable (flushed, a write-through commit, a
  flushing close) and held since is found by a lookup, or its loss is a counted event
  (an event for that key, or a loss counter that moved).

A violation is a :class:`Violation` with a kind, and always fails the test. Some kinds
are the signatures of what the model found (:data:`HOLE_KINDS`, :data:`FINDING_KINDS`),
all fixed. ``KVLIFE_ORACLE_RULES_OFF`` (comma-separated rule groups, see
:data:`RULE_GROUPS`) switches rule groups off, to show a violation on its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvlife.core.identity import (
    PUBLIC,
    ChunkKey,
    KVLayout,
    ModelIdentity,
    Namespace,
    NamespaceKind,
    prompt_chunk_keys,
)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", tokens_per_chunk=16)
"""2 KiB of KV per chunk (one 8 KiB disk frame)."""
N = LAYOUT.tokens_per_chunk
CHUNK = LAYOUT.chunk_nbytes
SEQS = 3
"""Token sequences; sequence 1 shares its first chunk with sequence 0."""
MAX_CHUNKS = 3
TAIL = 5
"""Tokens of a trailing partial chunk (never stored)."""
ADAPTER = "lora-a"
NAMESPACES = (
    PUBLIC,
    Namespace(NamespaceKind.USER, "alice"),
    Namespace(NamespaceKind.ORGANISATION, "acme"),
)
SCRIBBLE = 0xA5
"""The byte a scribble writes into every array a caller was handed: served bytes made of
it are a caller's array served back (issue 18, hole 6)."""

HOLE_KINDS = {
    "4": "prefix-missed-after-reopen",
    "5": "put-in-flight-survived-invalidation",
    "6": "caller-array-became-replica",
}
"""Violation kinds that are the signatures of issue 18's holes, by hole number."""
FINDING_KINDS = {
    "orphan": "emptied-segment-left-behind",
    "async-close": "async-load-untyped-error",
    "demoting-miss": "held-chunk-missed-while-demoted",
}
"""Violation kinds of what this model found beyond issue 18's holes, by short name."""

RULE_GROUPS = (
    "two_phase",  # prepare_put / commit_put / put_async / abort_put
    "reopen",  # close (with or without flush) and reopen, crash of a server
    "scribble",  # writes into arrays and buffers a call returned or was given
    "corrupt",  # damage to a replica's frame in a segment file
    "evict",  # explicit evictions (and demotions while scribbling)
    "invalidate",  # every kind of invalidation
    "async_load",  # load_async with chunk(i)
    "check",  # audits
    "background",  # calls racing each other: background and racing commits, scribbles
    # while an eviction runs (off: results depend less on thread timing, for shrinking)
)


def rules_off() -> frozenset[str]:
    """Rule groups switched off (``KVLIFE_ORACLE_RULES_OFF``)."""
    raw = os.environ.get("KVLIFE_ORACLE_RULES_OFF", "")
    groups = {g.strip() for g in raw.split(",") if g.strip()}
    unknown = groups - set(RULE_GROUPS)
    if unknown:
        raise ValueError(f"KVLIFE_ORACLE_RULES_OFF names unknown groups {sorted(unknown)}")
    return frozenset(groups)


# ---------------------------------------------------------------------------- universe


@dataclass(frozen=True, slots=True)
class PromptSpec:
    """One prompt of the universe: token sequence, identity, namespace, length in chunks
    and whether a partial chunk follows."""

    seq: int
    ident: int
    """0: the base model; 1: the base model with an adapter; 2: other weights."""
    ns: int
    length: int
    tail: bool = False

    def __repr__(self) -> str:
        return (
            f"PromptSpec(seq={self.seq}, ident={self.ident}, ns={self.ns}, "
            f"length={self.length}, tail={self.tail})"
        )

    def wire(self) -> tuple[int, int, int, int, bool]:
        return (self.seq, self.ident, self.ns, self.length, self.tail)


@dataclass(frozen=True, slots=True)
class KeyMeta:
    """What an invalidation can select a chunk by."""

    ident: int
    ns: int
    ancestors: tuple[ChunkKey, ...]
    """Keys chained before it, root first."""


def _sequence(seq: int) -> np.ndarray:
    rng = np.random.default_rng([4242, seq])
    tokens = rng.integers(0, 50_000, MAX_CHUNKS * N + TAIL, dtype=np.uint32)
    if seq == 1:
        tokens[:N] = _sequence(0)[:N]
    return tokens


class Universe:
    """Every prompt and chunk key of one model family (a family name keeps the keys of
    several examples on one server apart)."""

    def __init__(self, family: str = "oracle") -> None:
        self.family = family
        self.identities = (
            self._identity("w0"),
            self._identity("w0", adapter=True),
            self._identity("w1"),
        )
        self.sequences = [_sequence(s) for s in range(SEQS)]
        self.meta: dict[ChunkKey, KeyMeta] = {}
        self._keys: dict[tuple[int, int, int], list[ChunkKey]] = {}
        for seq in range(SEQS):
            for ident in range(len(self.identities)):
                for ns in range(len(NAMESPACES)):
                    keys = prompt_chunk_keys(
                        self.identities[ident],
                        NAMESPACES[ns],
                        self.sequences[seq][: MAX_CHUNKS * N],
                    )
                    self._keys[(seq, ident, ns)] = keys
                    for i, key in enumerate(keys):
                        self.meta.setdefault(key, KeyMeta(ident, ns, tuple(keys[:i])))

    def _identity(self, weights: str, adapter: bool = False) -> ModelIdentity:
        return ModelIdentity(
            model_id=self.family,
            weights_digest=f"{self.family}-{weights}",
            tokenizer_digest="t0",
            layout=LAYOUT,
            adapter_id=ADAPTER if adapter else "",
            adapter_digest="ad0" if adapter else "",
        )

    def weights(self, ident: int) -> str:
        return self.identities[ident].weights_digest

    def all_weights(self) -> list[str]:
        return sorted({i.weights_digest for i in self.identities})

    def identity(self, spec: PromptSpec) -> ModelIdentity:
        return self.identities[spec.ident]

    def namespace(self, spec: PromptSpec) -> Namespace:
        return NAMESPACES[spec.ns]

    def tokens(self, spec: PromptSpec) -> np.ndarray:
        return self.sequences[spec.seq][: spec.length * N + (TAIL if spec.tail else 0)].copy()

    def keys(self, spec: PromptSpec) -> list[ChunkKey]:
        return self._keys[(spec.seq, spec.ident, spec.ns)][: spec.length]

    def chunk_ref(self, key: ChunkKey) -> tuple[PromptSpec, int]:
        """A prompt holding ``key`` and the key's chunk number in it."""
        meta = self.meta[key]
        i = len(meta.ancestors)
        for seq in range(SEQS):
            spec = PromptSpec(seq, meta.ident, meta.ns, MAX_CHUNKS)
            if self.keys(spec)[i] == key:
                return spec, i
        raise KeyError(key.hex())

    def kv(self, spec: PromptSpec, form: str) -> object:
        """The prompt's KV, fresh arrays every call: one array of the whole prompt
        (``whole``, chunk views of it are not contiguous) or one array per chunk."""
        chunks = [payload(k) for k in self.keys(spec)]
        if form == "chunks":
            return chunks
        total = spec.length * N + (TAIL if spec.tail else 0)
        arr = np.empty((*LAYOUT.chunk_shape[:3], total, LAYOUT.head_dim), np.float16)
        for i, c in enumerate(chunks):
            arr[:, :, :, i * N : (i + 1) * N] = c
        if spec.tail:
            arr[:, :, :, spec.length * N :] = 0
        return arr


def payload(key: bytes) -> np.ndarray:
    """The exact KV of a chunk: float16 bit patterns seeded by its key (NaNs included:
    compared as bytes)."""
    rng = np.random.default_rng(int.from_bytes(key[:16], "little"))
    bits = rng.integers(0, 1 << 16, size=LAYOUT.chunk_shape, dtype=np.uint16)
    return bits.view(np.float16)


def scribble(arr: np.ndarray) -> bool:
    """Write :data:`SCRIBBLE` into every byte of ``arr``; False if it is read-only (a
    write refused with ValueError, as numpy does)."""
    try:
        arr.view(np.uint8)[...] = SCRIBBLE
    except ValueError:
        if arr.flags.writeable:
            raise
        return False
    return True


# ---------------------------------------------------------------------------- model


class Violation(AssertionError):
    """An answer the store must not give."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"[{kind}] {message}")
        self.kind = kind


@dataclass(slots=True)
class Inv:
    start: int
    end: int
    criteria: str
    prefix: ChunkKey | None
    epoch: int
    """Sessions (opens) of the store before it."""


@dataclass(slots=True)
class Write:
    """A put that wrote a chunk (not one that found it present or in flight)."""

    prep_end: int
    commit_start: int
    epoch: int
    commit_end: int | None = None
    """When the commit was known to have returned (None: not yet)."""


@dataclass(slots=True)
class KeyLog:
    invs: list[Inv] = field(default_factory=list)
    writes: list[Write] = field(default_factory=list)


@dataclass(slots=True)
class Pending:
    """A prepared put as the model sees it."""

    spec: PromptSpec
    keys: list[ChunkKey]
    written: list[ChunkKey]
    prep_start: int
    prep_end: int
    epoch: int
    live: bool = True
    committing: bool = False
    """Its commit started (it may have finished: a background commit's end is seen late)."""


class Oracle:
    """What the store may serve, must not serve and must keep (see the module docstring)."""

    def __init__(self, universe: Universe) -> None:
        self.u = universe
        self.clock = 0
        self.epoch = 0
        self.logs: dict[ChunkKey, KeyLog] = {k: KeyLog() for k in universe.meta}
        self.pendings: dict[int, Pending] = {}
        self.held: dict[ChunkKey, int] = {}
        """Chunks the store holds for sure (committed, nothing since that may drop them),
        with the tick from which on it did."""
        self.durable: dict[ChunkKey, int] = {}
        """Chunks acknowledged durable, with the tick it was acknowledged."""
        self.damaged: set[ChunkKey] = set()
        """Chunks a replica of which was damaged (their loss is explained)."""

    # ------------------------------------------------------------------ clock

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    # ------------------------------------------------------------------ verdicts

    def fail(self, kind: str, message: str) -> None:
        raise Violation(kind, message)

    def _last_inv(self, key: ChunkKey, at: int) -> Inv | None:
        done = [i for i in self.logs[key].invs if i.end < at]
        return max(done, key=lambda i: i.start) if done else None

    def why_forbidden(self, key: ChunkKey, start: int, end: int) -> str | None:
        """None if ``key`` may be served by a call spanning [start, end]; else the
        violation kind serving it would be."""
        log = self.logs.get(key)
        if log is None:
            return "foreign-key-served"
        writes = [w for w in log.writes if w.commit_start <= end]
        if not writes:
            return "never-put-served"
        inv = self._last_inv(key, start)
        if inv is None or any(w.prep_end > inv.start for w in writes):
            return None
        last = max(writes, key=lambda w: w.prep_end)
        if last.commit_start > inv.start or last.commit_end is None or last.commit_end > inv.start:
            return HOLE_KINDS["5"]  # prepared before the invalidation, committed after it began
        if inv.prefix is not None and inv.prefix != key and last.epoch < inv.epoch:
            return HOLE_KINDS["4"]
        return "invalidated-chunk-served"

    def may_hold(self, key: ChunkKey) -> bool:
        """The store may hold ``key`` now."""
        return self.why_forbidden(key, self.clock + 1, self.clock + 1) is None

    def _explain(self, key: ChunkKey, why: str) -> str:
        spec, i = self.u.chunk_ref(key)
        log = self.logs[key]
        return (
            f"{why}: chunk {i} of {spec} ({key.hex()[:12]}) writes at "
            f"{[(w.prep_end, w.commit_start, w.epoch) for w in log.writes]} "
            f"invalidations at {[(v.start, v.end, v.criteria, v.epoch) for v in log.invs]}"
        )

    def check_hits(
        self, spec: PromptSpec, hits: Sequence[ChunkKey], start: int, end: int, first: int = 0
    ) -> None:
        """A lookup over [start, end] of ``spec`` from chunk ``first`` on answered ``hits``."""
        keys = self.u.keys(spec)
        if list(hits) != keys[first : first + len(hits)]:
            raise Violation("lookup-not-a-prefix", f"lookup of {spec} answered foreign keys")
        for key in hits:
            why = self.why_forbidden(key, start, end)
            if why is not None:
                self.fail(why, "lookup found " + self._explain(key, why))

    def check_served(
        self, keys: Sequence[ChunkKey], served: Sequence[bytes], start: int, end: int
    ) -> None:
        """A load spanning [start, end] served ``served[i]`` as chunk ``keys[i]``."""
        for key, got in zip(keys, served, strict=False):
            want = payload(key).tobytes()
            if got != want:
                diff = [b for a, b in zip(want, got, strict=True) if a != b]
                scribbled = sum(1 for b in diff if b == SCRIBBLE)
                kind = HOLE_KINDS["6"] if scribbled == len(diff) else "wrong-bytes"
                other = [k for k in self.u.meta if payload(k).tobytes() == got]
                self.fail(
                    kind,
                    f"served bytes differ ({len(diff)} of {len(want)} bytes, {scribbled} of "
                    f"them scribbles{', the payload of ' + other[0].hex()[:12] if other else ''}"
                    f"): {self._explain(key, kind)}",
                )
            why = self.why_forbidden(key, start, end)
            if why is not None:
                self.fail(why, "load served " + self._explain(key, why))

    def check_corrupt(self, corrupt: Iterable[ChunkKey]) -> None:
        for key in corrupt:
            if key not in self.damaged:
                self.fail("undamaged-replica-corrupt", f"{key.hex()[:12]} reported corrupt")
            self.lose(key)

    def check_missing(
        self, key: ChunkKey, explained: Callable[[ChunkKey, int], bool], what: str
    ) -> None:
        """``key`` was not found: if the store held it for sure, its loss must be a
        counted event (an event for the key, or a loss counter that moved since)."""
        since = self.held.get(key)
        if since is None:
            return
        durable = self.durable.get(key)
        if key in self.damaged or explained(key, since if durable is None else durable):
            self.lose(key)
            return
        spec, i = self.u.chunk_ref(key)
        kind = "durable-chunk-lost-silently" if durable is not None else "held-chunk-lost-silently"
        self.lose(key)
        self.fail(
            kind,
            f"{what}: chunk {i} of {spec} ({key.hex()[:12]}), held since tick {since}, "
            f"durable since {durable}, is gone with no event or counter for it",
        )

    # ------------------------------------------------------------------ puts

    def prepared(
        self, pid: int, spec: PromptSpec, written: list[ChunkKey], start: int, end: int
    ) -> None:
        self.pendings[pid] = Pending(spec, self.u.keys(spec), written, start, end, self.epoch)

    def writing(self) -> set[ChunkKey]:
        """Chunks a pending put holds TENTATIVE for sure (prepared, commit not started,
        and no invalidation since took them out of the index: another put then writes
        them anew)."""
        return {
            k
            for p in self.pendings.values()
            if p.live and not p.committing
            for k in p.written
            if not any(i.start > p.prep_end for i in self.logs[k].invs)
        }

    def commit_started(self, pid: int, at: int) -> None:
        p = self.pendings[pid]
        p.committing = True
        for key in p.written:
            self.logs[key].writes.append(Write(p.prep_end, at, self.epoch))

    def committed(
        self, pid: int, covered: int, dropped: int, write_through: bool, start: int, end: int
    ) -> None:
        """A commit that ran somewhere in [start, end] returned: ``covered`` leading chunks
        were indexed when it did, says the store."""
        p = self.pendings[pid]
        p.live = False
        for key in p.written:
            for w in self.logs[key].writes:
                if w.commit_end is None and w.prep_end == p.prep_end:
                    w.commit_end = end
        self._took(
            p.keys, p.written, covered, dropped, write_through, f"commit of {p.spec}", start, end
        )

    def revoked(self, pid: int) -> bool:
        """An invalidation that began after the put was prepared covers one of its chunks
        (a commit may then refuse, with a typed error)."""
        p = self.pendings[pid]
        return any(i.start > p.prep_end for k in p.keys for i in self.logs[k].invs)

    def aborted(self, pid: int) -> None:
        p = self.pendings[pid]
        p.live = False
        for key in p.written:  # a commit that failed (or never ran) wrote nothing
            self.logs[key].writes = [
                w
                for w in self.logs[key].writes
                if not (w.commit_end is None and w.prep_end == p.prep_end)
            ]

    def put_prompt(
        self,
        spec: PromptSpec,
        written: list[ChunkKey] | None,
        start: int,
        end: int,
        present: int,
        covered: int,
        dropped: int,
        write_through: bool,
    ) -> None:
        """A one-call put over [start, end]; ``written``: the chunks it wrote, None when
        the store does not say (then every chunk no live put holds counts as written,
        and ``present`` is bounded by the chunks the store may hold)."""
        keys = self.u.keys(spec)
        busy = self.writing()
        if written is None:
            may = [k for k in keys if k not in busy and self.may_hold(k)]
            if present > len(may):
                self.fail(
                    "invalidated-chunk-present",
                    f"put of {spec} found {present} chunks present; it may hold {len(may)}",
                )
            written = [k for k in keys if k not in busy]
        for key in written:
            self.logs[key].writes.append(Write(end, start, self.epoch, end))
        self._took(keys, written, covered, dropped, write_through, f"put of {spec}", start, end)

    def _took(
        self,
        keys: list[ChunkKey],
        written: list[ChunkKey],
        covered: int,
        dropped: int,
        write_through: bool,
        what: str,
        start: int,
        end: int,
    ) -> None:
        have = keys[:covered]
        for key in have:
            why = self.why_forbidden(key, start, end)
            if why is not None:
                self.fail(why, f"{what} says it holds " + self._explain(key, why))
        got = set(have)
        if dropped == 0:
            got |= set(written)
        now = self.clock + 1
        for key in got:
            if self.why_forbidden(key, now, now) is None:  # not invalidated since
                self.held.setdefault(key, start)
                if write_through:
                    self.durable.setdefault(key, start)

    # ------------------------------------------------------------------ management

    def invalidated(
        self,
        start: int,
        end: int,
        *,
        weights: str | None = None,
        adapter: str | None = None,
        namespace: int | None = None,
        prefix: ChunkKey | None = None,
    ) -> set[ChunkKey]:
        """An invalidation ran over [start, end]; the chunks it covers."""
        covered = set(self.u.meta)
        names = []
        if weights is not None:
            covered &= {
                k
                for k, m in self.u.meta.items()
                if self.u.identities[m.ident].weights_digest == weights
            }
            names.append("weights")
        if adapter is not None:
            covered &= {
                k
                for k, m in self.u.meta.items()
                if self.u.identities[m.ident].adapter_id == adapter
            }
            names.append("adapter")
        if namespace is not None:
            covered &= {k for k, m in self.u.meta.items() if m.ns == namespace}
            names.append("namespace")
        if prefix is not None:
            covered &= {k for k, m in self.u.meta.items() if k == prefix or prefix in m.ancestors}
            names.append("prefix")
        inv = Inv(start, end, "+".join(names), prefix, self.epoch)
        for key in covered:
            self.logs[key].invs.append(inv)
            self.lose(key)
        return covered

    def lose(self, key: ChunkKey) -> None:
        self.held.pop(key, None)
        self.durable.pop(key, None)

    def flushed(self) -> None:
        now = self.tick()
        for key in self.held:
            self.durable.setdefault(key, now)

    def disk_evicted(self) -> None:
        """Some disk replicas went (which, the model does not know): nothing is durable
        for sure any more; what is held is found again by probing."""
        self.durable.clear()

    def damage(self, key: ChunkKey) -> None:
        self.damaged.add(key)
        self.lose(key)

    def closed(self, flush: bool) -> None:
        """The store closed (or its server stopped or died): pending puts are gone, and
        without a flush only what was durable is held."""
        if flush:
            self.flushed()
        for p in self.pendings.values():
            p.live = False
        self.held = {k: t for k, t in self.held.items() if k in self.durable}
        self.epoch += 1

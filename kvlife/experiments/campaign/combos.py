"""Faults in combination: two or three faults hitting the same operation of the store.

The single kinds (:mod:`.embedded`) inject one fault at a time; here a put, a load, a
demotion, a compaction or a reopen meets several at once, at random points of it. Each
fault is a :class:`Fault`: the operations it can hit and the *channel* it occupies.

**Compatibility rule.** Faults combine when they can hit the same operation and occupy
different channels. A channel is one slot of the fault seam (:class:`CampaignIO`) or of
the store's files: ``read-bits`` (a bit flipped in a frame read), ``read-errno`` (EIO on
a segment read), ``write-drop`` (lost writes), ``write-errno`` (ENOSPC or EIO on a
segment write or its fdatasync), ``latency`` (every call slowed 10-1000x), ``catalog``
(an old catalog restored), ``disk-bytes`` (a frame's bytes damaged on a closed store).
Two faults on one channel would replace each other (the seam holds one armed fault per
channel), not combine, so a payload flip and a header flip never meet in one draw. And
at most one fault of the channels that end the operation (``read-errno``,
``write-errno``: the failing call stops it), or the second could never fire.

**Draws.** Each combined injection picks an operation and two or three compatible
faults by a seeded draw (:func:`draw`), each armed to fire at a random call of the
operation; :data:`NAMED` are combinations chosen on purpose (EIO on one chunk's read
while another chunk's header has a flipped bit; ENOSPC during a demotion whose frames
are also lost; a bit flip plus a stale catalog restore; ...), run first in every
campaign. A combination counts as an injection once every one of its faults fired
(a fault with nothing to hit is retried with a fresh operation, up to five times).

**Checks.** Every chunk served during or after the operation is held against the
oracle. What the store owes (every chunk of an acknowledged put on a disk-only store;
on the write-back demotion store, every chunk whose demotion to disk completed) must
load bit-exact afterwards or be explained (a drop event, a corrupt or read-error load);
anything else is acknowledged data lost. Nothing of a failed put may be served. A
detection is the store noticing: a typed error, a corrupt or failed read, a counted
drop (compaction finding a damaged frame, a failed demotion). A chunk
that is not served is recomputed (put again). Recovery time: from the faults' end to
every chunk of the operation's prompt served again. Rows of the tally are named
``combo:<fault>+<fault>[+<fault>]@<operation>``, deployment ``embedded``.
"""

from __future__ import annotations

import errno
import functools
import itertools
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvlife.core.errors import KVLifeError
from kvlife.core.events import EventSink, LifecycleEvent
from kvlife.core.identity import Namespace, NamespaceKind
from kvlife.core.lifecycle import Move
from kvlife.experiments.campaign import oracle
from kvlife.experiments.campaign.seams import CampaignIO
from kvlife.experiments.campaign.tally import Campaign, KindTally
from kvlife.experiments.campaign.workload import LAYOUT, Prompt, identity, make_prompt
from kvlife.faults import damage
from kvlife.faults.damage import catalog_file
from kvlife.store import KVStore

KiB = 1 << 10
MiB = 1 << 20

OPERATIONS = ("put", "load", "demotion", "compaction", "reopen")


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault of a combination: the operations it can hit, the channel it occupies."""

    name: str
    ops: frozenset[str]
    channel: str


def _f(name: str, ops: str, channel: str) -> Fault:
    return Fault(name, frozenset(ops.split()), channel)


FAULTS: dict[str, Fault] = {
    f.name: f
    for f in (
        _f("bitflip-payload", "load compaction", "read-bits"),
        _f("bitflip-header", "load compaction", "read-bits"),
        _f("eio-read", "load compaction", "read-errno"),
        _f("lost-write", "put demotion compaction", "write-drop"),
        _f("enospc", "put demotion compaction", "write-errno"),
        _f("eio-write", "put demotion compaction", "write-errno"),
        _f("slow-io", "put load demotion compaction", "latency"),
        _f("stale-catalog", "reopen", "catalog"),
        _f("file-bitflip", "reopen", "disk-bytes"),
        _f("file-truncated", "reopen", "disk-bytes"),
    )
}


ENDING = frozenset({"read-errno", "write-errno"})
"""Channels whose fault ends the operation it hits (the call fails, the operation
stops): at most one per combination, or the second could never fire."""


def compatible(faults: tuple[str, ...], op: str) -> bool:
    """The compatibility rule: every fault can hit ``op``, no two share a channel, at
    most one ends the operation."""
    fs = [FAULTS[n] for n in faults]
    channels = [f.channel for f in fs]
    return (
        all(op in f.ops for f in fs)
        and len(set(channels)) == len(fs)
        and sum(c in ENDING for c in channels) <= 1
    )


NAMED: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("load", ("eio-read", "bitflip-header")),
    ("load", ("eio-read", "bitflip-payload", "slow-io")),
    ("demotion", ("enospc", "lost-write")),
    ("put", ("lost-write", "eio-write")),
    ("compaction", ("bitflip-payload", "enospc")),
    ("compaction", ("eio-read", "lost-write", "slow-io")),
    ("reopen", ("stale-catalog", "file-bitflip")),
    ("reopen", ("stale-catalog", "file-truncated")),
)
"""Combinations run on purpose, before the drawn ones (each is compatible)."""


def draw(rng: random.Random) -> tuple[str, tuple[str, ...]]:
    """A seeded random combination: an operation, then two or three compatible faults
    (sorted by name, so a combination has one row whatever the order drawn)."""
    op = rng.choice(OPERATIONS)
    names = sorted(n for n, f in FAULTS.items() if op in f.ops)
    sizes = [k for k in (2, 3) if any(compatible(c, op) for c in itertools.combinations(names, k))]
    k = rng.choice(sizes)
    combos = [c for c in itertools.combinations(names, k) if compatible(c, op)]
    return op, rng.choice(combos)


def row_name(op: str, faults: tuple[str, ...]) -> str:
    return f"combo:{'+'.join(sorted(faults))}@{op}"


class Sink(EventSink):
    """Records what the store dropped and which chunks reached the disk tier."""

    def __init__(self) -> None:
        self.dropped: dict[bytes, str] = {}
        self.durable: set[bytes] = set()

    def emit(self, e: LifecycleEvent) -> None:
        key = bytes.fromhex(e.key) if e.key else b""
        if e.kind in (Move.DELETE.value, Move.INVALIDATE.value, Move.CORRUPT.value) or (
            e.kind == Move.EVICT.value and e.tier == "disk"
        ):
            self.dropped[key] = e.reason or e.kind
            self.durable.discard(key)
        elif e.kind == Move.OFFLOAD.value and e.dst_tier == "disk":
            self.durable.add(key)


def _open(shape: str, path: Path, io: CampaignIO | None, sink: EventSink) -> KVStore:
    if shape == "demotion":  # write-back: a put lands in a six-chunk DRAM, demotes to disk
        return KVStore.open(
            path,
            dram_bytes=6 * LAYOUT.chunk_nbytes,
            disk_bytes=64 * MiB,
            segment_bytes=1 * MiB,
            write_through=False,
            sink=sink,
            fileio=io,
            read_pool_bytes=4 * MiB,
        )
    if shape == "compaction":  # 32 frames in 8-frame segments: garbage builds up
        return KVStore.open(
            path,
            dram_bytes=0,
            disk_bytes=256 * KiB,
            segment_bytes=64 * KiB,
            sink=sink,
            fileio=io,
            read_pool_bytes=4 * MiB,
        )
    return KVStore.open(
        path,
        dram_bytes=0,
        disk_bytes=24 * MiB,
        segment_bytes=1 * MiB,
        sink=sink,
        fileio=io,
        read_pool_bytes=4 * MiB,
    )


COMPACTION_WINDOW = 15
"""Compaction rig: prompt n's namespace is invalidated after the put of n + this."""


@dataclass(slots=True)
class Rig:
    """A store of one shape behind the campaign's seam, and what it owes."""

    shape: str
    root: Path
    seed: int
    rng: random.Random
    io: CampaignIO
    sink: Sink
    store: KVStore
    owed: dict[bytes, tuple[Prompt, int]] = field(default_factory=dict)
    retired: set[bytes] = field(default_factory=set)
    number: int = 0

    @classmethod
    def make(cls, shape: str, root: Path, seed: int) -> Rig:
        io = CampaignIO(LAYOUT.chunk_nbytes, seed)
        sink = Sink()
        store = _open(shape, root / shape, io, sink)
        rig = cls(shape, root, seed, random.Random(seed), io, sink, store)
        # fill the store first: the DRAM of the demotion store, the disk of the
        # compaction store (so that its puts compact segments that still hold live frames)
        for _ in range({"demotion": 4, "compaction": 2 * COMPACTION_WINDOW}.get(shape, 0)):
            rig.put(rig.prompt())
        filled = range(1, rig.number + 1)
        rig.settle_durable([make_prompt(seed, n, shared_prefix=False) for n in filled])
        return rig

    def close(self) -> None:
        self.io.heal()
        self.store.close()

    def prompt(self, shared: bool = False) -> Prompt:
        """The next prompt (``shared``: with a shared prefix, put by earlier prompts,
        so its chunks lie in more than one place)."""
        self.number += 1
        if self.shape == "compaction":
            ns = Namespace(NamespaceKind.USER, f"p{self.number}")
            return make_prompt(self.seed, self.number, namespace=ns, shared_prefix=False)
        return make_prompt(self.seed, self.number, shared_prefix=shared)

    def put(self, p: Prompt) -> None:
        """Put ``p``; on a disk-only store its chunks are owed once acknowledged."""
        for k in p.keys:
            self.sink.dropped.pop(bytes(k), None)
            self.retired.discard(bytes(k))
        self.store.put_prompt(identity(), p.namespace, p.tokens, p.kv())
        if self.shape != "demotion":
            for i, k in enumerate(p.keys):
                self.owed[bytes(k)] = (p, i)
        if self.shape == "compaction" and p.number > COMPACTION_WINDOW:
            self.retire(p.number - COMPACTION_WINDOW)

    def retire(self, number: int) -> None:
        ns = Namespace(NamespaceKind.USER, f"p{number}")
        old = make_prompt(self.seed, number, namespace=ns, shared_prefix=False)
        self.store.invalidate(namespace=ns)
        for k in old.keys:
            self.owed.pop(bytes(k), None)
            self.retired.add(bytes(k))

    def check_retired(self, number: int, t: KindTally) -> None:
        """Compaction store: nothing of retired prompt ``number`` may be found again."""
        ns = Namespace(NamespaceKind.USER, f"p{number}")
        old = make_prompt(self.seed, number, namespace=ns, shared_prefix=False)
        for i in range(len(old.keys)):
            if self.load_chunk(old, i, t) != "miss":  # load_chunk counts a served one
                t.note("a retired chunk was found")

    def settle_durable(self, prompts: list[Prompt]) -> None:
        """Demotion store: a chunk is owed once its demotion to disk completed."""
        if self.shape != "demotion":
            return
        for p in prompts:
            for i, k in enumerate(p.keys):
                if bytes(k) in self.sink.durable:
                    self.owed[bytes(k)] = (p, i)

    def load_chunk(self, p: Prompt, i: int, t: KindTally) -> str:
        tokens, start, parent = p.chunk(i)
        found = self.store.lookup(identity(), p.namespace, tokens, start=start, parent=parent)
        if not found.hits:
            return "miss"
        res = self.store.load(found)
        t.served(oracle.check([p.keys[i]], res.arrays))
        if res.arrays and bytes(p.keys[i]) in self.retired:
            t.stale_served += 1
            t.note("a retired chunk was served")
        if res.corrupt:
            return "corrupt"
        if res.read_errors:
            return "read-error"
        return "hit" if res.arrays else "miss"

    def check_owed(self, keys: list[bytes], t: KindTally) -> set[bytes]:
        """Load every owed chunk of ``keys``: right, or explained, else acknowledged
        data lost. Returns the keys not served (to recompute)."""
        missing: set[bytes] = set()
        for key in keys:
            if key not in self.owed:
                continue
            p, i = self.owed[key]
            got = self.load_chunk(p, i, t)
            if got == "hit":
                continue
            missing.add(key)
            if got == "corrupt":
                t.lost_explained += 1
            elif got == "read-error":
                pass  # the replica is kept: a transient error, a miss this time
            elif key in self.sink.dropped:
                t.lost_explained += 1
            else:
                t.acked_lost += 1
                t.note(f"owed chunk {key.hex()[:12]} missing with no drop event ({got})")
            self.owed.pop(key, None)
        return missing


# ---------------------------------------------------------------------- arming


@dataclass(slots=True)
class Armed:
    """What was armed for one combined injection, and how to tell that each fired."""

    fired: dict[str, Callable[[], bool]] = field(default_factory=dict)


def _injected(io: CampaignIO, op: str) -> int:
    return io.injected.get(op, 0)


def _grew(count: Callable[[], float]) -> Callable[[], bool]:
    """Whether ``count`` grew since now (a fault's own counter: it fired)."""
    before = count()
    return lambda: count() > before


def _arm(rig: Rig, faults: tuple[str, ...], calls: int, gate: bool) -> Armed:
    """Arm ``faults`` on the rig's seam at random ones of the next ``calls`` segment
    calls; ``gate``: write faults wait for a segment read first (in a store that only
    puts, a read is compaction's).

    An errno fault ends the operation it hits, so a fault beside it on the same kind of
    call is placed at an earlier call: a flipped read before the EIO read; lost writes
    are followed by a failing fdatasync, and in a compaction (which reads a frame, then
    writes its copy) by the EIO read of a later frame (else they could never fire
    together)."""
    io, rng = rig.io, rig.rng
    a = Armed()
    span = max(1, calls)
    flip_at = rng.randrange(max(1, span - 1)) if "eio-read" in faults else rng.randrange(span)
    lose_n = rng.randint(1, 2)
    lose_at = rng.randrange(max(1, span - 1))
    for name in faults:
        if name in ("bitflip-payload", "bitflip-header"):
            a.fired[name] = _grew(lambda: io.flips)
            io.flip_next_read("header" if name == "bitflip-header" else "payload", flip_at)
        elif name == "eio-read":
            first = flip_at + 1 if {"bitflip-payload", "bitflip-header"} & set(faults) else 0
            if "lost-write" in faults:
                # compaction reads a frame, then writes its copy (a flipped frame is
                # dropped, not copied): the lost copy's read, and the flipped one's, first
                first += lose_at + 1
            after = first + rng.randrange(max(1, span - first))
            a.fired[name] = _grew(functools.partial(_injected, io, "preadv"))
            io.arm("preadv", errno.EIO, after=after, once=True, path="seg-*.kvs")
        elif name == "lost-write":
            a.fired[name] = _grew(lambda: io.lost)
            io.lose_writes(lose_n, after=lose_at, gated=gate)
        elif name in ("enospc", "eio-write"):
            err = errno.ENOSPC if name == "enospc" else errno.EIO
            if "lost-write" in faults:
                # a write that never landed, then the sync reports an error (fsync(2)
                # reports ENOSPC and EIO of writes it could not complete): one demotion
                # writes its batch with one pwritev, so this is how both meet in it
                op = "fdatasync"
            else:
                op = "pwritev" if err == errno.ENOSPC or rng.random() < 0.5 else "fdatasync"
            after = rng.randrange(span)
            a.fired[name] = _grew(functools.partial(_injected, io, op))
            # a put syncs its segment once: an fdatasync fault hits that one
            io.arm_gated(op, err, after=after if op == "pwritev" else 0, gated=gate)
        elif name == "slow-io":
            a.fired[name] = _grew(lambda: io.slowed_s)
            io.slow(10 ** rng.uniform(1.0, 3.0))
        else:
            raise ValueError(f"{name} is not a seam fault")
    return a


def _noticed(rig: Rig) -> int:
    """What the store counted noticing: corrupt replicas (found by a read or by
    compaction), dropped rows, read errors, failed demotions."""
    c = rig.store.counters
    return c.corrupt + c.recovery_dropped + c.read_errors + c.demote_failed


def _land(t: KindTally, armed: Armed, faults: tuple[str, ...]) -> bool:
    """Count the injection if every fault fired."""
    if all(armed.fired[n]() for n in faults):
        t.injections += 1
        return True
    return False


# ---------------------------------------------------------------------- the operations


def _after(rig: Rig, prompts: list[Prompt], t: KindTally, started: float) -> int:
    """Heal, check every owed chunk of the operation's prompts and recompute the last
    prompt if any of it is not served; returns how many owed chunks were found gone
    with a reason (corrupt, dropped)."""
    rig.io.heal()
    rig.settle_durable(prompts)
    keys = [bytes(k) for q in prompts for k in q.keys]
    explained = t.lost_explained
    rig.check_owed(keys, t)
    explained = t.lost_explained - explained
    # what is not owed (a write-back store's chunks still only in DRAM, a failed put's)
    # may be served or not, but what is served goes to the oracle too
    for q in prompts[:-1]:
        for i, k in enumerate(q.keys):
            if bytes(k) not in rig.owed:
                rig.load_chunk(q, i, t)
    p = prompts[-1]
    if any(bytes(k) not in rig.owed for k in p.keys):
        try:
            rig.put(p)
            t.recomputed += len(p.keys)
        except KVLifeError as exc:
            t.note(f"recompute put failed: {type(exc).__name__}")
        rig.settle_durable([p])
    t.recovery_s.append(time.perf_counter() - started)
    return explained


def _op_put(rig: Rig, faults: tuple[str, ...], t: KindTally, gate: bool = False) -> bool:
    """A put (on the demotion store: a put that demotes older chunks to disk; ``gate``:
    a put whose compaction the faults wait for) with the faults armed at random calls of
    it; ``gate`` also checks every owed chunk after (what compaction may have copied)."""
    p = rig.prompt()
    # a put writes each chunk's frame; a demotion writes its batch with one call
    armed = _arm(rig, faults, 1 if rig.shape == "demotion" else len(p.keys), gate)
    failed = False
    noticed = _noticed(rig)
    demote_failed = rig.store.counters.demote_failed
    dropped = set(rig.sink.dropped)
    try:
        rig.put(p)
    except KVLifeError as exc:
        failed = True
        t.typed_errors += 1
        t.note(f"put failed typed: {type(exc).__name__}")
    landed = _land(t, armed, faults)
    started = time.perf_counter()
    rig.io.heal()
    if failed and rig.shape != "demotion":
        # nothing of a failed put may be visible
        for i in range(len(p.keys)):
            if rig.load_chunk(p, i, t) == "hit":
                t.stale_served += 1
                t.note("a chunk of a failed put was served")
    if rig.store.counters.demote_failed > demote_failed:
        # a failed demotion drops what it was moving out of DRAM, with an event each
        gone = {bytes(k) for q in _recent(rig, p) for k in q.keys} & (
            set(rig.sink.dropped) - dropped
        )
        t.lost_explained += len(gone)
        failed = True
    explained = _after(rig, _recent(rig, p), t, started)
    if gate:
        before = t.lost_explained
        missing = rig.check_owed(list(rig.owed), t)
        explained += t.lost_explained - before
        t.recomputed += len(missing)
    if landed and (failed or explained or _noticed(rig) > noticed):
        t.detections += 1
    return landed


def _recent(rig: Rig, p: Prompt) -> list[Prompt]:
    """The prompts a demotion during ``p``'s put may have moved (a six-chunk DRAM holds
    at most the six before it)."""
    if rig.shape != "demotion":
        return [p]
    first = max(1, p.number - 6)
    return [make_prompt(rig.seed, n, shared_prefix=False) for n in range(first, p.number)] + [p]


def _op_load(rig: Rig, faults: tuple[str, ...], t: KindTally) -> bool:
    """One load of a prompt (3-5 chunks, one read each) with the faults armed."""
    p = rig.prompt(shared=True)
    rig.put(p)
    noticed = _noticed(rig)
    armed = _arm(rig, faults, len(p.keys), False)
    res = rig.store.load(rig.store.lookup(identity(), p.namespace, p.tokens))
    t.served(oracle.check(p.keys, res.arrays))
    landed = _land(t, armed, faults)
    started = time.perf_counter()
    explained = _after(rig, [p], t, started)
    if landed and (res.corrupt or res.read_errors or explained or _noticed(rig) > noticed):
        t.detections += 1
    return landed


def _op_compaction(rig: Rig, faults: tuple[str, ...], t: KindTally) -> bool:
    """A put on the compaction store (each put retires an old prompt, so garbage builds
    up) with the faults waiting for its compaction's first segment read."""
    reads = rig.io.calls.get("preadv", 0)
    landed = _op_put(rig, faults, t, gate=True)
    if rig.io.calls.get("preadv", 0) == reads:
        t.note("no compaction ran in a put")
    if rig.number > COMPACTION_WINDOW:  # the prompt this put's invalidation retired
        rig.check_retired(rig.number - COMPACTION_WINDOW, t)
    return landed


def _reopen(
    root: Path, seed: int, faults: tuple[str, ...], t: KindTally, rng: random.Random
) -> bool:
    """Close a store, snapshot its catalog, keep working, close, restore the old catalog
    and damage the bytes of a frame it names, reopen: nothing retired after the snapshot
    served, every served byte right, every chunk the old catalog names served or its
    damage reported."""
    path = root / f"reopen-{seed}"
    sink = Sink()
    store = _open("put", path, None, sink)
    first = [make_prompt(seed, i, shared_prefix=False) for i in range(4)]
    for p in first:
        store.put_prompt(identity(), p.namespace, p.tokens, p.kv())
    store.close()
    stale = "stale-catalog" in faults
    snap = root / f"reopen-{seed}.snap"
    cat = catalog_file(path)
    if stale:
        snap.mkdir(parents=True)
        for f in cat.parent.glob(cat.name + "*"):
            shutil.copy2(f, snap / f.name)
    store = _open("put", path, None, sink)
    # half the time an invalidation after the snapshot (the superblock then knows the
    # catalog lost a deletion and the open refuses it), else only puts after it (the old
    # catalog is accepted: the damaged frame must be caught on its own)
    gone = first[rng.randrange(len(first))] if rng.random() < 0.5 else None
    if gone is not None:
        store.invalidate(prefix=gone.keys[0])
    later = [make_prompt(seed, 10 + i, shared_prefix=False) for i in range(3)]
    for p in later:
        store.put_prompt(identity(), p.namespace, p.tokens, p.kv())
    store.close()
    if stale:
        for f in cat.parent.glob(cat.name + "*"):
            f.unlink()
        for f in snap.iterdir():
            shutil.copy2(f, cat.parent / f.name)
    frames = damage.scan_frames(path)
    if not frames:
        shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(snap, ignore_errors=True)
        return False
    named = {bytes(k) for q in first for k in q.keys}
    victims = [f for f in frames if bytes(f.key) in named] or frames
    victim = victims[rng.randrange(len(victims))]
    damaged = {bytes(victim.key)}
    if "file-truncated" in faults:
        damage.truncate(victim.segment, victim.payload_offset + victim.payload_len // 2)
        # and every frame after it in that segment
        damaged |= {
            bytes(f.key) for f in frames if f.segment == victim.segment and f.offset > victim.offset
        }
    elif "file-bitflip" in faults:
        damage.flip(victim.segment, victim.payload_offset + rng.randrange(victim.payload_len), 1)
    t.injections += 1
    started = time.perf_counter()
    sink = Sink()
    refused = False
    try:
        store = _open("put", path, None, sink)
    except KVLifeError as exc:
        # the store saw its catalog rolled back and refused it: everything it held is
        # lost, reported (an operator starts it afresh, as here)
        refused = True
        t.typed_errors += 1
        t.note(f"open refused: {type(exc).__name__}")
        shutil.rmtree(path)
        store = _open("put", path, None, sink)
    t.recovery_s.append(time.perf_counter() - started)
    detected = refused or store.counters.recovery_dropped > 0
    for p in (*first, *later):
        for i, key in enumerate(p.keys):
            tokens, start, parent = p.chunk(i)
            found = store.lookup(identity(), p.namespace, tokens, start=start, parent=parent)
            res = store.load(found)
            t.served(oracle.check([key], res.arrays))
            if p is gone and res.arrays:
                t.stale_served += 1
                t.note("a chunk invalidated after the snapshot came back")
            if res.corrupt:
                detected = True
            if not res.arrays and p is not gone:
                # an old catalog does not name what was written after it; a damaged
                # frame is a miss the store reported (recovery or a corrupt load)
                reported = bool(res.corrupt) or bytes(key) in sink.dropped
                reported = reported or store.counters.recovery_dropped > 0
                explained = refused or (stale and p in later) or bool(res.corrupt)
                explained = explained or (bytes(key) in damaged and reported)
                if explained:
                    t.lost_explained += 1
                else:
                    t.acked_lost += 1
                    t.note(f"chunk {key.hex()[:12]} missing with nothing reported")
                t.recomputed += 1
    t.detections += int(detected)
    store.close()
    shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(snap, ignore_errors=True)
    return True


# ---------------------------------------------------------------------- the part


def run(root: Path, seed: int, n: int, campaign: Campaign, probe: int = 3) -> None:
    """The named combinations, then ``n`` drawn ones, against one store per shape."""
    rng = random.Random(seed * 7919 + 25)
    plan = list(NAMED) + [draw(rng) for _ in range(n)]
    rigs: dict[str, Rig] = {}
    try:
        for j, (op, faults) in enumerate(plan):
            if not compatible(faults, op):
                raise ValueError(f"{faults} cannot combine in one {op}")
            t = campaign.tally(row_name(op, faults), "embedded")
            if op == "reopen":
                _reopen(root / "reopen", seed * 10_000 + j, faults, t, rng)
                continue
            shape = {"put": "put", "load": "put"}.get(op, op)
            if shape not in rigs:
                rigs[shape] = Rig.make(shape, root / "combos", seed)
            rig = rigs[shape]
            for _ in range(5):  # a combination that did not all fire is tried again
                if op == "load":
                    ok = _op_load(rig, faults, t)
                elif op == "compaction":
                    ok = _op_compaction(rig, faults, t)
                else:
                    ok = _op_put(rig, faults, t)
                if ok:
                    break
            else:
                t.note("a combination did not fire in five operations")
            # and a few owed chunks elsewhere in the store
            keys = list(rig.owed)
            rig.check_owed(rig.rng.sample(keys, min(probe, len(keys))), t)
    finally:
        for r in rigs.values():
            r.close()

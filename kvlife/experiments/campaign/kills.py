"""SIGKILLs of real writer processes at every step of the commit protocol, of demotion
and of compaction, each round checked by the next process to open the store.

A round forks a writer (:func:`writer`) from the driver process (which never opens a
store itself, so it forks with one thread and no open files of a store). The writer
opens the store (recovery: its time is the round's recovery time), verifies what the
rounds before it left (every owed chunk loads bit-exact, no retired chunk is served),
then puts prompts, logging each acknowledged put. A :class:`KillSwitch` (a file seam)
or a :class:`KillSink` (an event sink) stops the writer with SIGSTOP right after the
chosen step of the chosen operation; the driver sees it stopped and SIGKILLs it, so
the kill lands exactly there. The steps:

- ``commit``, a disk-only store: ``torn-frame`` (killed inside a segment write: its
  first pages landed, the rest not), ``frame-written`` (after a segment pwritev),
  ``fsynced`` (after its fdatasync), ``catalog-row`` (the disk tier committed its
  catalog transaction and published the rows: the ``write`` event), ``visible`` (the
  ``index`` event, before the put returns), and ``random`` (a seeded delay);
- ``demotion``, a write-back store with a six-chunk DRAM tier: the frame written, its
  fdatasync and the ``offload`` event of a demotion to disk;
- ``compaction``, a small disk where every put invalidates an old prompt's namespace so
  garbage builds up: a frame copied, the copies synced, the old segment unlinked.

In combination (:data:`COMBO_STEPS`, rows ``combo:lost-write+sigkill@commit:<step>``):
a ``commit`` writer whose seam also loses one of its segment writes (acknowledged, never
written) before it is killed at the step, e.g. a lost write and then a SIGKILL after the
frame's fdatasync, before its catalog row. The next writer's verification must find
the acknowledged chunk the lost write hit corrupt (reported, the object invalidated:
``lost_explained``), never serve it, and find everything else whole.

What a round owes the next: in ``commit`` and ``compaction`` every chunk of an
acknowledged put; in ``demotion`` every chunk whose demotion to disk completed (an
acknowledged put of a write-back store is in DRAM only); less every chunk the store
logged dropping (an event, as it is emitted) and every chunk an acknowledged
invalidation retired (which must never be served again). The operation in flight at
the kill may have been done or not: its chunks are owed neither way.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvlife.core.events import EventSink, LifecycleEvent
from kvlife.core.identity import ChunkKey, Namespace, NamespaceKind
from kvlife.core.lifecycle import Move
from kvlife.experiments.campaign import oracle
from kvlife.experiments.campaign.tally import KindTally
from kvlife.experiments.campaign.workload import Prompt, identity, make_prompt
from kvlife.faults.crash import AckLog, read_log
from kvlife.store import KVStore
from kvlife.tiers.disk.fileio import FileIO

KiB = 1 << 10
MiB = 1 << 20

STEPS: dict[str, tuple[str, ...]] = {
    "commit": ("torn-frame", "frame-written", "fsynced", "catalog-row", "visible", "random"),
    "demotion": ("frame-written", "fsynced", "offloaded"),
    "compaction": ("copy-written", "copies-synced", "old-segment-unlinked"),
}
"""Kill points of each shape."""

COMBO_STEPS = ("frame-written", "fsynced", "catalog-row", "visible")
"""Kill points of the ``commit`` shape combined with a lost write."""

COMPACTION_WINDOW = 6
"""Compaction shape: prompt n's namespace is invalidated after the put of n + this."""


def open_shape(shape: str, path: Path, io: FileIO | None, sink: EventSink | None) -> KVStore:
    if shape == "commit":
        return KVStore.open(
            path, dram_bytes=0, disk_bytes=256 * MiB, segment_bytes=1 * MiB, sink=sink, fileio=io
        )
    if shape == "demotion":
        return KVStore.open(
            path,
            dram_bytes=6 * 2 * KiB,
            disk_bytes=256 * MiB,
            segment_bytes=1 * MiB,
            write_through=False,
            sink=sink,
            fileio=io,
        )
    if shape == "compaction":
        # 32 frames of 8 KiB in 8-frame segments; the live set is at most 18 frames
        return KVStore.open(
            path, dram_bytes=0, disk_bytes=256 * KiB, segment_bytes=64 * KiB, sink=sink, fileio=io
        )
    raise ValueError(f"unknown kill shape {shape!r}")


def prompt_of(shape: str, seed: int, n: int) -> Prompt:
    """Prompt ``n`` of a shape's workload (compaction: a namespace per prompt, no shared
    prefix, so an invalidation retires exactly one prompt)."""
    if shape == "compaction":
        return make_prompt(
            seed, n, namespace=Namespace(NamespaceKind.USER, f"p{n}"), shared_prefix=False
        )
    return make_prompt(seed, n)


def _stop_here() -> None:
    """Freeze this process where it stands, for the driver to SIGKILL."""
    os.kill(os.getpid(), signal.SIGSTOP)


class KillSwitch(FileIO):
    """A file seam that stops the process right after the ``nth`` armed call of ``op``
    on a segment file (``during_compaction``: only calls made after a segment read in
    the same put, which in a writer that never loads is compaction). With ``lose``, the
    ``lose``-th armed segment write is acknowledged and never written (a lost write,
    logged ``lostw``: the fault combined with the kill)."""

    def __init__(
        self, op: str, nth: int, during_compaction: bool, lose: int = 0, log: AckLog | None = None
    ) -> None:
        super().__init__(direct=False)
        self.op = op
        self.nth = nth
        self.compaction = during_compaction
        self.lose = lose
        self.log = log
        self.armed = False
        self.read_seen = False
        self._paths: dict[int, Path] = {}

    def _lost(self, path: Path | None) -> bool:
        if not (self.armed and self.lose > 0 and path is not None and path.match("seg-*.kvs")):
            return False
        self.lose -= 1
        if self.lose > 0:
            return False
        if self.log is not None:
            self.log.line("lostw")
        return True

    def _hit(self, op: str, path: Path | None) -> None:
        if not self.armed or op != self.op or path is None or not path.match("seg-*.kvs"):
            return
        if self.compaction and not self.read_seen:
            return
        self.nth -= 1
        if self.nth <= 0:
            _stop_here()

    def open(self, path: Path, create: bool) -> int:
        fd = super().open(path, create)
        self._paths[fd] = path
        return fd

    def pwritev(self, fd: int, buffers: Sequence[np.ndarray], offset: int) -> int:
        path = self._paths.get(fd)
        if self._lost(path):
            n = sum(b.nbytes for b in buffers)
            self._hit("pwritev", path)
            return n
        if self.op == "torn" and self.armed and path is not None and path.match("seg-*.kvs"):
            self.nth -= 1
            if self.nth <= 0:
                self._torn(fd, buffers, offset)
        n = super().pwritev(fd, buffers, offset)
        self._hit("pwritev", path)
        return n

    def _torn(self, fd: int, buffers: Sequence[np.ndarray], offset: int) -> None:
        """Die inside this write: only its first pages land (whole 4 KiB pages, as a
        device writes them and as O_DIRECT needs; the slices keep the alignment)."""
        pages = [
            b.reshape(-1).view(np.uint8)[i : i + 4096]
            for b in buffers
            for i in range(0, b.nbytes, 4096)
        ]
        if len(pages) > 1:
            keep = random.Random(offset).randrange(1, len(pages))
            super().pwritev(fd, pages[:keep], offset)
        _stop_here()

    def preadv(self, fd: int, buffers: Sequence[np.ndarray], offset: int) -> int:
        n = super().preadv(fd, buffers, offset)
        if self.armed:
            self.read_seen = True
        return n

    def fdatasync(self, fd: int) -> None:
        super().fdatasync(fd)
        self._hit("fdatasync", self._paths.get(fd))

    def unlink(self, path: Path) -> None:
        super().unlink(path)
        self._hit("unlink", path)


class KillSink(EventSink):
    """Logs drops (``gone``) and completed demotions (``dur``) and stops the process
    after the ``nth`` armed event ``kind`` in tier ``tier``."""

    def __init__(self, log: AckLog, kind: str | None, tier: str, nth: int) -> None:
        self.log = log
        self.kind = kind
        self.tier = tier
        self.nth = nth
        self.armed = False

    def emit(self, e: LifecycleEvent) -> None:
        if e.kind in (Move.DELETE.value, Move.INVALIDATE.value, Move.CORRUPT.value) or (
            e.kind == Move.EVICT.value and e.tier == "disk"
        ):
            self.log.line(f"gone {e.key}")
        if e.kind == Move.OFFLOAD.value and e.dst_tier == "disk":
            self.log.line(f"dur {e.key}")
        if self.armed and e.kind == self.kind and (e.tier == self.tier or e.dst_tier == self.tier):
            self.nth -= 1
            if self.nth <= 0:
                _stop_here()


@dataclass(frozen=True, slots=True)
class Plan:
    """One round: the shape, the step, how many matching calls or events to let pass."""

    shape: str
    step: str
    nth: int
    seed: int
    first: int
    """First prompt number this writer puts."""
    max_puts: int = 12
    lose: int = 0
    """Lose the ``lose``-th armed segment write (0: none): a lost write, then the kill."""


def _seams(plan: Plan, log: AckLog) -> tuple[KillSwitch, KillSink]:
    op, kind, compaction = "", None, False
    s = plan.step
    if s == "torn-frame":
        op = "torn"
    elif s in ("frame-written", "copy-written"):
        op = "pwritev"
    elif s in ("fsynced", "copies-synced"):
        op = "fdatasync"
    elif s == "old-segment-unlinked":
        op = "unlink"
    elif s == "catalog-row":
        kind = Move.WRITE.value
    elif s == "visible":
        kind = Move.INDEX.value
    elif s == "offloaded":
        kind = Move.OFFLOAD.value
    compaction = plan.shape == "compaction"
    io = KillSwitch(op, plan.nth, compaction, plan.lose, log)
    return io, KillSink(log, kind, "disk", plan.nth)


def writer(store: Path, logp: Path, expect: Path, plan: Plan) -> None:
    """The forked writer: recover, verify, put until stopped (see the module doc)."""
    log = AckLog(logp)
    io, sink = _seams(plan, log)
    started = time.perf_counter()
    kv = open_shape(plan.shape, store, io, sink)
    log.line(f"ready {time.perf_counter() - started:.6f}")
    log.line(f"dropped {kv.counters.recovery_dropped}")
    verify(kv, plan, json.loads(expect.read_text()) if expect.exists() else {}, log)
    io.armed = sink.armed = True
    for n in range(plan.first, plan.first + plan.max_puts):
        io.read_seen = False
        p = prompt_of(plan.shape, plan.seed, n)
        kv.put_prompt(identity(), p.namespace, p.tokens, p.kv())
        log.line(f"put {n}")
        if plan.shape == "compaction" and n - COMPACTION_WINDOW >= 0:
            old = prompt_of(plan.shape, plan.seed, n - COMPACTION_WINDOW)
            kv.invalidate(namespace=old.namespace)
            log.line(f"inv {n - COMPACTION_WINDOW}")
    log.line("done")
    kv.close()


def verify(kv: KVStore, plan: Plan, expect: dict[str, list[list[int]]], log: AckLog) -> None:
    """Load every owed chunk alone and check it; look up every retired one."""
    ok = 0
    for n, i in expect.get("owed", []):
        p = prompt_of(plan.shape, plan.seed, n)
        tokens, start, parent = p.chunk(i)
        found = kv.lookup(identity(), p.namespace, tokens, start=start, parent=parent)
        res = kv.load(found)
        v = oracle.check([p.keys[i]], res.arrays)
        if v.wrong_bytes:
            log.line(f"wrong {p.keys[i].hex()} {v.wrong_bytes}")
        if res.arrays:
            ok += 1
        elif res.corrupt:  # found and reported: the object is invalidated as corrupt
            log.line(f"corrupt {p.keys[i].hex()}")
        else:
            log.line(f"miss {p.keys[i].hex()}")
    for n, i in expect.get("retired", []):
        p = prompt_of(plan.shape, plan.seed, n)
        tokens, start, parent = p.chunk(i)
        found = kv.lookup(identity(), p.namespace, tokens, start=start, parent=parent)
        if found.hits:
            res = kv.load(found)
            log.line(f"stale {p.keys[i].hex()} {len(res.arrays)}")
    log.line(f"verified {ok}")


def run_child(store: Path, logp: Path, expect: Path, plan: Plan) -> None:
    """The body of the forked process: never returns."""
    code = 0
    try:
        writer(store, logp, expect, plan)
    except BaseException:  # the driver reads this file to say why a writer failed
        (logp.parent / (logp.name + ".err")).write_text(traceback.format_exc())
        code = 3
    finally:
        sys.stdout.flush()
        os._exit(code)


@dataclass(slots=True)
class Ledger:
    """What one store directory owes, across rounds (the driver's side)."""

    shape: str
    seed: int
    owed: dict[ChunkKey, tuple[int, int]] = field(default_factory=dict)
    retired: dict[ChunkKey, tuple[int, int]] = field(default_factory=dict)
    next_first: int = 0

    def expectation(self) -> dict[str, list[tuple[int, int]]]:
        return {"owed": sorted(self.owed.values()), "retired": sorted(self.retired.values())}

    def absorb(self, lines: list[tuple[str, tuple[str, ...]]], plan: Plan) -> None:
        """Fold a killed round's log into what is owed."""
        puts = [int(a[0]) for k, a in lines if k == "put"]
        last = max(puts, default=plan.first - 1)
        inflight = prompt_of(self.shape, self.seed, last + 1)
        inflight_keys = set(inflight.keys)
        durable: set[bytes] = set()
        for kind, args in lines:
            if kind == "put" and self.shape != "demotion":
                p = prompt_of(self.shape, self.seed, int(args[0]))
                for i, k in enumerate(p.keys):
                    self.owed[k] = (p.number, i)
                    self.retired.pop(k, None)
            elif kind == "dur":
                durable.add(bytes.fromhex(args[0]))
            elif kind in ("gone", "miss", "corrupt"):
                self.owed.pop(ChunkKey(bytes.fromhex(args[0])), None)
            elif kind == "inv":
                p = prompt_of(self.shape, self.seed, int(args[0]))
                for i, k in enumerate(p.keys):
                    self.owed.pop(k, None)
                    self.retired[k] = (p.number, i)
        if self.shape == "demotion":
            for n in range(plan.first, last + 2):
                p = prompt_of(self.shape, self.seed, n)
                for i, k in enumerate(p.keys):
                    if k in durable:
                        self.owed[k] = (n, i)
        # the operation in flight: its chunks may or may not be there
        for k in inflight_keys:
            self.owed.pop(k, None)
        if self.shape == "compaction" and last + 1 - COMPACTION_WINDOW >= 0:
            gone_maybe = prompt_of(self.shape, self.seed, last + 1 - COMPACTION_WINDOW)
            for k in gone_maybe.keys:
                self.owed.pop(k, None)
        self.next_first = last + 2


def parse(logp: Path) -> list[tuple[str, tuple[str, ...]]]:
    return [(line.kind, line.args) for line in read_log(logp)]


def tally_verification(
    lines: list[tuple[str, tuple[str, ...]]], t: KindTally, lost_writes: bool = False
) -> bool:
    """Fold a round's verification lines into ``t``; True if the round got that far.
    A chunk found corrupt is acknowledged data lost, unless the rounds before lost
    writes on purpose (``lost_writes``): then it is the lost write, found and reported
    (so is a missing chunk, as many as the frames recovery counted dropping)."""
    done = False
    dropped = 0  # frames recovery dropped (torn or unreadable), reported as counted
    for kind, args in lines:
        if kind == "ready":
            t.recovery_s.append(float(args[0]))
        elif kind == "dropped":
            dropped = int(args[0])
        elif kind == "wrong":
            t.wrong_chunks += 1
            t.wrong_bytes += int(args[1])
        elif lost_writes and (kind == "corrupt" or (kind == "miss" and dropped > 0)):
            # the lost write's chunk: found corrupt at read, or dropped by recovery
            dropped -= kind == "miss"
            t.lost_explained += 1
            t.recomputed += 1
        elif kind in ("miss", "corrupt"):
            t.acked_lost += 1
            t.recomputed += 1
            t.note(f"owed chunk {args[0][:12]} missing after recovery")
        elif kind == "stale":
            t.stale_served += 1
        elif kind == "verified":
            t.served_chunks += int(args[0])
            done = True
    return done


def choose(rng: random.Random, shapes: Sequence[str]) -> tuple[str, str, int]:
    shape = rng.choice(list(shapes))
    step = rng.choice(STEPS[shape])
    nth = rng.randint(1, 12 if shape == "commit" else 6)
    return shape, step, nth

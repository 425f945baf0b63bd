"""The in-process fault kinds, against an embedded store with a disk tier.

One :class:`EmbeddedRig` holds a store (disk tier only, so every byte goes through the
fault seam :class:`~kvlife.experiments.campaign.seams.CampaignIO`) and the model of what it
owes: every acknowledged chunk, minus those the store reported dropping (an event:
evicted, invalidated, corrupt, deleted). Each ``inject_*`` method injects one fault,
drives the workload through it, heals, and probes: a served chunk is checked against
the oracle, an owed chunk that is gone with no event is acknowledged data lost, and a
miss is recomputed (the prompt put again).

Kinds: bit flips in payloads and headers (on read), lost writes, ENOSPC, EIO on read
and on write, slow I/O, speculative rollback, model upgrade mid-flight; and
:func:`stale_catalog_round` (an old copy of the catalog restored under a closed store).
"""

from __future__ import annotations

import errno
import random
import shutil
import time
from collections.abc import Container
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvlife.core.errors import KVLifeError
from kvlife.core.events import EventSink, LifecycleEvent
from kvlife.core.identity import ChunkKey, prompt_chunk_keys
from kvlife.core.lifecycle import Move
from kvlife.experiments.campaign import oracle
from kvlife.experiments.campaign.payload import payload
from kvlife.experiments.campaign.seams import CampaignIO
from kvlife.experiments.campaign.tally import KindTally
from kvlife.experiments.campaign.workload import (
    LAYOUT,
    WEIGHTS_V1,
    WEIGHTS_V2,
    Prompt,
    identity,
    make_prompt,
)
from kvlife.faults import damage
from kvlife.faults.damage import catalog_file
from kvlife.store import KVStore

MiB = 1 << 20

DROPS = {Move.EVICT.value, Move.DELETE.value, Move.CORRUPT.value, Move.INVALIDATE.value}


class DropSink(EventSink):
    """Records every key the store dropped (and why), as the event is emitted."""

    def __init__(self) -> None:
        self.dropped: dict[bytes, str] = {}

    def emit(self, event: LifecycleEvent) -> None:
        if event.kind in DROPS:
            self.dropped[bytes.fromhex(event.key)] = event.reason or event.kind


@dataclass(slots=True)
class Owed:
    """Acknowledged chunks the store must still serve (unless it reports a drop)."""

    chunks: dict[ChunkKey, tuple[Prompt, int]] = field(default_factory=dict)

    def add(self, prompt: Prompt, upto: int | None = None) -> None:
        for i, k in enumerate(prompt.keys[:upto]):
            self.chunks[k] = (prompt, i)

    def forget(self, keys: Container[bytes]) -> None:
        for k in list(self.chunks):
            if k in keys:
                del self.chunks[k]


def open_store(path: Path, io: CampaignIO | None, sink: EventSink, disk_bytes: int) -> KVStore:
    return KVStore.open(
        path,
        dram_bytes=0,
        disk_bytes=disk_bytes,
        segment_bytes=1 * MiB,
        sink=sink,
        fileio=io,
        read_pool_bytes=4 * MiB,
    )


class EmbeddedRig:
    """An embedded store behind the campaign's file seam, and what it owes."""

    def __init__(self, root: Path, seed: int, disk_bytes: int = 24 * MiB) -> None:
        self.root = root
        self.seed = seed
        self.rng = random.Random(seed)
        self.io = CampaignIO(LAYOUT.chunk_nbytes, seed)
        self.sink = DropSink()
        self.store = open_store(root / "store", self.io, self.sink, disk_bytes)
        self.owed = Owed()
        self.retired: set[bytes] = set()
        """Keys an acknowledged invalidation or abort took out of service."""
        self.next_prompt = 0

    def close(self) -> None:
        self.io.heal()
        self.store.close()

    # ------------------------------------------------------------------ workload steps

    def fresh(self, weights: str = WEIGHTS_V1, shared: bool = False) -> Prompt:
        self.next_prompt += 1
        return make_prompt(
            self.seed, self.next_prompt, weights_digest=weights, shared_prefix=shared
        )

    def put(self, p: Prompt) -> None:
        """Put and acknowledge ``p`` (raises what the store raises)."""
        self.store.put_prompt(identity(p.weights_digest), p.namespace, p.tokens, p.kv())
        self.owed.add(p)
        self.retired.difference_update(p.keys)
        for k in p.keys:
            self.sink.dropped.pop(k, None)

    def load_chunk(self, p: Prompt, i: int, t: KindTally) -> str:
        """Look up and load chunk ``i`` of ``p`` alone; check what is served. Returns
        ``hit``, ``miss``, ``corrupt`` or ``read-error``."""
        tokens, start, parent = p.chunk(i)
        ident = identity(p.weights_digest)
        found = self.store.lookup(ident, p.namespace, tokens, start=start, parent=parent)
        if not found.hits:
            return "miss"
        res = self.store.load(found)
        key = p.keys[i]
        v = oracle.check([key], res.arrays)
        t.served(v)
        if res.arrays and key in self.retired:
            t.stale_served += 1
        if res.corrupt:
            return "corrupt"
        if res.read_errors:
            return "read-error"
        return "hit" if res.arrays else "miss"

    def probe(self, t: KindTally, n: int) -> None:
        """Check ``n`` owed chunks: right bytes, or a reported drop; recompute misses."""
        keys = list(self.owed.chunks)
        for key in self.rng.sample(keys, min(n, len(keys))):
            p, i = self.owed.chunks[key]
            got = self.load_chunk(p, i, t)
            if got == "hit":
                continue
            reason = self.sink.dropped.get(key)
            if reason is None and got != "read-error":
                t.acked_lost += 1
                t.note(f"owed chunk {key.hex()[:12]} missing with no drop event ({got})")
            self.owed.chunks.pop(key, None)
            self.recompute(p, t)

    def recompute(self, p: Prompt, t: KindTally) -> None:
        """The engine recomputes a missed prompt and puts it back."""
        try:
            self.put(p)
            t.recomputed += len(p.keys)
        except KVLifeError as exc:
            t.note(f"recompute put failed: {type(exc).__name__}")

    # ------------------------------------------------------------------ the kinds

    def inject_bitflip(self, t: KindTally, region: str) -> None:
        p = self.fresh()
        self.put(p)
        i = self.rng.randrange(len(p.keys))
        self.io.flip_next_read("header" if region == "header" else "payload")
        before = self.io.flips
        got = self.load_chunk(p, i, t)
        self.io.heal()
        if self.io.flips == before:
            return
        t.injections += 1
        if got == "corrupt":
            t.detections += 1
            t.lost_explained += 1
        elif got == "hit":
            # the flip landed on bytes the check does not cover: the oracle decides
            t.note("a flipped read served (oracle checked it)")
        self.owed.chunks.pop(p.keys[i], None)
        started = time.perf_counter()
        self.recompute(p, t)
        self.load_chunk(p, i, t)
        t.recovery_s.append(time.perf_counter() - started)

    def inject_lost_write(self, t: KindTally) -> None:
        p = self.fresh()
        n = self.rng.randint(1, len(p.keys))
        self.io.lose_writes(n)
        before = self.io.lost
        self.put(p)  # the device acknowledges: so does the store
        self.io.heal()
        if self.io.lost == before:
            return
        t.injections += 1
        started = time.perf_counter()
        detected = False
        for i in range(len(p.keys)):
            got = self.load_chunk(p, i, t)
            if got == "corrupt":
                detected = True
                t.lost_explained += 1
                self.owed.chunks.pop(p.keys[i], None)
        t.detections += int(detected)
        if detected:
            self.recompute(p, t)
        t.recovery_s.append(time.perf_counter() - started)

    def inject_errno_write(self, t: KindTally, err: int) -> None:
        p = self.fresh()
        op = "pwritev" if err == errno.ENOSPC or self.rng.random() < 0.5 else "fdatasync"
        self.io.arm(op, err, after=self.rng.randrange(len(p.keys)), path="seg-*.kvs")
        before = self.io.injected.get(op, 0)
        try:
            self.put(p)
            failed = False
        except KVLifeError:
            failed = True
        fired = self.io.injected.get(op, 0) > before
        self.io.heal()
        if not fired:
            return
        t.injections += 1
        if failed:
            t.detections += 1
            t.typed_errors += 1
            # nothing of a failed put may be visible
            for i in range(len(p.keys)):
                if self.load_chunk(p, i, t) == "hit":
                    t.stale_served += 1
                    t.note("a chunk of a failed put was served")
        started = time.perf_counter()
        self.recompute(p, t)
        t.recovery_s.append(time.perf_counter() - started)

    def inject_eio_read(self, t: KindTally) -> None:
        p = self.fresh()
        self.put(p)
        i = self.rng.randrange(len(p.keys))
        self.io.arm("preadv", errno.EIO, once=True, path="seg-*.kvs")
        before = self.io.injected.get("preadv", 0)
        got = self.load_chunk(p, i, t)
        fired = self.io.injected.get("preadv", 0) > before
        self.io.heal()
        if not fired:
            return
        t.injections += 1
        if got == "read-error":
            t.detections += 1
        started = time.perf_counter()
        if self.load_chunk(p, i, t) != "hit":  # a transient error keeps the replica
            t.note("chunk not served again after a transient EIO")
            self.recompute(p, t)
        t.recovery_s.append(time.perf_counter() - started)

    def inject_slow(self, t: KindTally) -> None:
        factor = 10 ** self.rng.uniform(1.0, 3.0)
        p = self.fresh()
        self.io.slow(factor)
        started = time.perf_counter()
        self.put(p)
        for i in range(len(p.keys)):
            self.load_chunk(p, i, t)
        self.io.heal()
        t.injections += 1
        t.recovery_s.append(time.perf_counter() - started)

    def inject_spec_rollback(self, t: KindTally) -> None:
        """A draft's KV is put, then the draft is rejected: abort it (still pending) or
        invalidate it (committed); the accepted continuation must never get it."""
        base = self.fresh()
        self.put(base)
        n = LAYOUT.tokens_per_chunk
        rng = np.random.default_rng([self.seed, base.number, 99])
        draft_tail = rng.integers(0, 32_000, size=n, dtype=np.uint32)
        full = len(base.keys) * n
        draft_tokens = np.concatenate([base.tokens[:full], draft_tail])
        ident = identity()
        draft_keys = prompt_chunk_keys(ident, base.namespace, draft_tokens)
        draft_kv = [payload(k) for k in draft_keys]
        t.injections += 1
        if self.rng.random() < 0.5:
            pending = self.store.prepare_put(ident, base.namespace, draft_tokens, draft_kv)
            self.store.abort_put(pending, "speculative draft rejected")
        else:
            self.store.put_prompt(ident, base.namespace, draft_tokens, draft_kv)
            self.store.invalidate(prefix=draft_keys[-1])
        t.detections += 1
        self.retired.add(bytes(draft_keys[-1]))
        # the accepted continuation: the same prefix, other tokens
        accepted_tail = draft_tail.copy()
        accepted_tail[self.rng.randrange(n) :] ^= np.uint32(1)
        accepted = np.concatenate([base.tokens[:full], accepted_tail])
        acc_keys = prompt_chunk_keys(ident, base.namespace, accepted)
        found = self.store.lookup(ident, base.namespace, accepted)
        res = self.store.load(found)
        t.served(oracle.check(acc_keys, res.arrays))
        # and the draft itself is out of service
        found = self.store.lookup(ident, base.namespace, draft_tokens)
        if len(found.hits) > len(base.keys):
            t.stale_served += 1
            t.note("a rejected draft chunk was served")

    def inject_model_upgrade(self, t: KindTally) -> None:
        """Puts and loads of v1 in flight while the weights change to v2."""
        old = self.fresh()
        self.put(old)
        v1 = identity(WEIGHTS_V1)
        inflight = self.fresh()
        pending = self.store.prepare_put(v1, inflight.namespace, inflight.tokens, inflight.kv())
        found = self.store.lookup(v1, old.namespace, old.tokens)
        handle = self.store.load_async(found)
        t.injections += 1
        self.store.invalidate(weights_digest=WEIGHTS_V1)
        self.retired.update(old.keys)
        self.retired.update(inflight.keys)
        self.owed.forget(set(old.keys) | set(inflight.keys))
        res = self.store.commit_put(pending)
        if res.stored == 0:
            t.detections += 1
        loaded = handle.wait()
        # a load that was already in flight may finish: its bytes are still checked
        t.served(oracle.check(old.keys, loaded.arrays))
        for p in (old, inflight):
            for i in range(len(p.keys)):
                self.load_chunk(p, i, t)  # any hit is stale_served
        started = time.perf_counter()
        new = make_prompt(self.seed, old.number, weights_digest=WEIGHTS_V2, shared_prefix=False)
        self.recompute(new, t)
        for i in range(len(new.keys)):
            self.load_chunk(new, i, t)
        t.recovery_s.append(time.perf_counter() - started)
        # v2 is now current; the next v1 prompts are a fresh deployment of v1 again
        self.store.invalidate(weights_digest=WEIGHTS_V2)
        self.owed.forget(set(new.keys))
        self.retired.update(new.keys)


def stale_catalog_round(root: Path, seed: int, t: KindTally) -> None:
    """Snapshot the catalog of a closed store, keep working (puts, invalidations), close,
    put the old catalog back, reopen: nothing invalidated after the snapshot may be
    served, and everything served must be right."""
    rng = random.Random(seed)
    path = root / f"stale-{seed}"
    sink = DropSink()
    store = open_store(path, None, sink, 8 * MiB)
    first = [make_prompt(seed, i, shared_prefix=False) for i in range(4)]
    for p in first:
        store.put_prompt(identity(), p.namespace, p.tokens, p.kv())
    store.close()
    cat = catalog_file(path)
    snap = root / f"stale-{seed}.snap"
    snap.mkdir()
    for f in cat.parent.glob(cat.name + "*"):
        shutil.copy2(f, snap / f.name)
    store = open_store(path, None, sink, 8 * MiB)
    gone = first[rng.randrange(len(first))]
    store.invalidate(prefix=gone.keys[0])
    later = [make_prompt(seed, 10 + i, shared_prefix=False) for i in range(4)]
    for p in later:
        store.put_prompt(identity(), p.namespace, p.tokens, p.kv())
    store.close()
    for f in cat.parent.glob(cat.name + "*"):
        f.unlink()
    for f in snap.iterdir():
        shutil.copy2(f, cat.parent / f.name)
    t.injections += 1
    started = time.perf_counter()
    try:
        store = open_store(path, None, DropSink(), 8 * MiB)
    except KVLifeError as exc:
        t.detections += 1
        t.typed_errors += 1
        t.note(f"open refused a stale catalog: {type(exc).__name__}")
        shutil.rmtree(path)
        store = open_store(path, None, DropSink(), 8 * MiB)
    t.recovery_s.append(time.perf_counter() - started)
    before = store.counters.recovery_dropped
    for p in (*first, *later):
        ident = identity()
        res = store.load(store.lookup(ident, p.namespace, p.tokens))
        t.served(oracle.check(p.keys, res.arrays))
        if p is gone and res.arrays:
            t.stale_served += 1
            t.note("a chunk invalidated after the snapshot came back")
        if p in later and res.loaded < len(p.keys):
            # written after the snapshot: the old catalog does not name them
            t.lost_explained += len(p.keys) - res.loaded
            t.recomputed += len(p.keys) - res.loaded
    if store.counters.recovery_dropped > before or store.counters.recovery_dropped:
        t.detections += 1
    store.close()
    shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(snap, ignore_errors=True)


DAMAGE_KINDS = ("file-truncated", "file-bitflip", "restart")
"""On-disk damage to a closed store (the kinds LMCache's disk backend meets too)."""


def damage_round(root: Path, seed: int, kind: str, t: KindTally) -> None:
    """Put prompts, close the store, damage one frame's file (truncate the segment in
    the middle of the frame, or flip a byte of its payload; ``restart``: nothing), reopen
    and load everything: the damaged chunk is a miss (detected), the rest right."""
    rng = random.Random(seed)
    path = root / f"damage-{seed}"
    prompts = [make_prompt(seed, i, shared_prefix=False) for i in range(3)]
    store = open_store(path, None, DropSink(), 8 * MiB)
    for p in prompts:
        store.put_prompt(identity(), p.namespace, p.tokens, p.kv())
    store.close()
    frames = damage.scan_frames(path)
    victim = frames[rng.randrange(len(frames))]
    if kind == "file-truncated":
        # cut the segment inside the victim's payload (and so every frame after it)
        damage.truncate(victim.segment, victim.payload_offset + victim.payload_len // 2)
    elif kind == "file-bitflip":
        damage.flip(victim.segment, victim.payload_offset + rng.randrange(victim.payload_len), 1)
    t.injections += 1
    started = time.perf_counter()
    sink = DropSink()
    store = open_store(path, None, sink, 8 * MiB)
    t.recovery_s.append(time.perf_counter() - started)
    dropped = store.counters.recovery_dropped
    lost = 0
    for p in prompts:
        for i in range(len(p.keys)):
            tokens, start, parent = p.chunk(i)
            found = store.lookup(identity(), p.namespace, tokens, start=start, parent=parent)
            res = store.load(found)
            t.served(oracle.check([p.keys[i]], res.arrays))
            if not res.arrays:
                lost += 1
                if p.keys[i] not in sink.dropped and not res.corrupt and not dropped:
                    t.acked_lost += 1
                    t.note(f"{kind}: chunk missing with nothing reported")
    if kind != "restart" and (lost or dropped):
        t.detections += 1
    t.lost_explained += lost
    t.recomputed += lost
    store.close()
    shutil.rmtree(path, ignore_errors=True)

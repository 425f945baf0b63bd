"""Random put / commit / abort / lookup / load / invalidate / evict / corrupt-a-replica /
crash-and-reopen sequences against a plain model of what the store must and may serve.

The model keeps, per chunk key, the bytes that were committed. ``must`` holds keys the
store is obliged to serve (committed, durable, not invalidated, not possibly evicted);
``maybe`` holds keys it may serve (committed, but a disk eviction may have dropped them).
Checked after every step: only INDEXED objects are served, served bytes equal what was
put, lookups find every ``must`` chunk of a prompt's prefix, and the event stream obeys
the transition table.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    rule,
    run_state_machine_as_test,
)

from kvlife.core.events import MemorySink
from kvlife.core.identity import (
    PUBLIC,
    ChunkKey,
    ModelIdentity,
    Namespace,
    NamespaceKind,
    prompt_chunk_keys,
)
from kvlife.core.lifecycle import Move, ObjectState, check_move
from kvlife.faults.damage import flip, scan_frames
from kvlife.store import Accept, KVStore, PendingPut, TierSpec
from kvlife.tiers.disk.fileio import FileIO
from kvlife.transforms import make_transform
from tests.conftest import TINY, budget, prompt_kv, tiny_identity

N = TINY.tokens_per_chunk
ALICE = Namespace(NamespaceKind.USER, "alice")
IDENTITIES = [tiny_identity(), tiny_identity(weights_digest="w1")]
NAMESPACES = [PUBLIC, ALICE]


@dataclass
class Prompt:
    identity: ModelIdentity
    namespace: Namespace
    tokens: np.ndarray
    kv: np.ndarray
    keys: list[ChunkKey]
    number: int = 0

    def __repr__(self) -> str:
        return f"PROMPTS[{self.number}]"


def _prompts() -> list[Prompt]:
    out: list[Prompt] = []
    base_tokens, base_kv = prompt_kv(1, 4 * N)
    for p in range(6):
        tokens, kv = prompt_kv(50 + p, 3 * N + 5)
        if p % 2 == 0:  # share the first two chunks with the base prompt
            tokens = np.concatenate([base_tokens[: 2 * N], tokens[2 * N :]])
            kv = np.concatenate([base_kv[:, :, :, : 2 * N], kv[:, :, :, 2 * N :]], axis=3)
        for ident in IDENTITIES:
            for ns in NAMESPACES:
                keys = prompt_chunk_keys(ident, ns, tokens)
                out.append(Prompt(ident, ns, tokens, kv, keys, len(out)))
    return out


PROMPTS = _prompts()


class StoreMachine(RuleBasedStateMachine):
    dram_chunks = 6
    disk_bytes = 64 << 20
    write_through = True

    pendings = Bundle("pendings")

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvlife-sm-"))
        self.sink = MemorySink()
        self.store = self._open()
        self.expected: dict[ChunkKey, np.ndarray] = {}
        self.must: set[ChunkKey] = set()
        self.maybe: set[ChunkKey] = set()
        self.damaged: set[ChunkKey] = set()
        self.states: dict[str, ObjectState | None] = {}

    def _open(self) -> KVStore:
        return KVStore.open(
            self.dir,
            dram_bytes=self.dram_chunks * TINY.chunk_nbytes,
            disk_bytes=self.disk_bytes,
            segment_bytes=64 << 10,
            write_through=self.write_through,
            sink=self.sink,
            fileio=self._fileio(),
        )

    def _fileio(self) -> FileIO | None:
        """The file seam of the next session (a subclass may put a fault seam there)."""
        return None

    def teardown(self) -> None:
        self.store.close(flush=False)
        shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ rules

    def _record_put(self, p: Prompt, stored_or_present: int) -> None:
        covered = stored_or_present // N
        for i, key in enumerate(p.keys):
            self.expected[key] = np.ascontiguousarray(p.kv[:, :, :, i * N : (i + 1) * N])
            if i < covered and self.write_through:
                self.must.add(key)
                self.maybe.discard(key)
            elif key not in self.must:
                # past the covered prefix a chunk may still have been stored (its
                # predecessor was being written by another pending put), so it may be
                # served once that predecessor lands
                self.maybe.add(key)

    @rule(p=st.sampled_from(PROMPTS))
    def put(self, p: Prompt) -> None:
        allowed = sum(1 for k in p.keys if k in self.must or k in self.maybe)
        res = self.store.put_prompt(p.identity, p.namespace, p.tokens, p.kv)
        assert res.chunks == 3
        assert res.already_present <= allowed, "a chunk invalidated or never put is present"
        self._record_put(p, res.tokens_stored_or_present)

    @rule(target=pendings, p=st.sampled_from(PROMPTS))
    def prepare(self, p: Prompt) -> tuple[Prompt, PendingPut]:
        return p, self.store.prepare_put(p.identity, p.namespace, p.tokens, p.kv)

    @rule(item=consumes(pendings))
    def commit(self, item: tuple[Prompt, PendingPut]) -> None:
        p, pending = item
        if pending.done:  # lost in a crash
            return
        res = self.store.commit_put(pending)
        self._record_put(p, res.tokens_stored_or_present)

    @rule(item=consumes(pendings))
    def abort(self, item: tuple[Prompt, PendingPut]) -> None:
        _, pending = item
        if pending.done:
            return
        self.store.abort_put(pending)

    @rule(p=st.sampled_from(PROMPTS))
    def lookup(self, p: Prompt) -> None:
        hit = self.store.lookup(p.identity, p.namespace, p.tokens)
        found = len(hit.hits)
        for h in hit.hits:
            assert h.key in self.must or h.key in self.maybe, "served a chunk never committed"
        if found < len(p.keys):
            assert p.keys[found] not in self.must, "a chunk the store must hold was missed"

    @rule(p=st.sampled_from(PROMPTS), into_buffers=st.booleans())
    def load(self, p: Prompt, into_buffers: bool) -> None:
        hit = self.store.lookup(p.identity, p.namespace, p.tokens)
        outs = [np.empty(TINY.chunk_shape, np.float16) for _ in hit.hits] if into_buffers else None
        res = self.store.load(hit, outs)
        assert all(k in self.damaged for k in res.corrupt), "an undamaged replica failed"
        assert res.loaded == len(hit.hits) or res.corrupt
        for h, arr in zip(hit.hits, res.arrays, strict=False):
            assert np.array_equal(arr, self.expected[h.key]), "served bytes differ from the put"

    @rule(p=st.sampled_from(PROMPTS), i=st.integers(0, 2))
    def corrupt_replica(self, p: Prompt, i: int) -> None:
        """Flip payload bytes of a chunk's disk frame: never served, at most a miss."""
        self.store.drain()
        frames = [f for f in scan_frames(self.dir) if f.key == p.keys[i]]
        for f in frames:
            flip(f.segment, f.payload_offset + 3, 2)
        if frames:
            self.damaged.add(p.keys[i])
            if p.keys[i] in self.must:
                self.must.discard(p.keys[i])
                self.maybe.add(p.keys[i])

    @rule(
        which=st.sampled_from(["weights", "namespace", "prefix"]),
        p=st.sampled_from(PROMPTS),
        root=st.integers(0, 1),
    )
    def invalidate(self, which: str, p: Prompt, root: int) -> None:
        if which == "weights":
            self.store.invalidate(weights_digest=p.identity.weights_digest)
            gone = {k for q in PROMPTS if q.identity == p.identity for k in q.keys}
        elif which == "namespace":
            self.store.invalidate(namespace=p.namespace)
            gone = {k for q in PROMPTS if q.namespace == p.namespace for k in q.keys}
        else:
            first = p.keys[root]
            self.store.invalidate(prefix=first)
            # that chunk and everything chained after it, in any prompt, present or not
            gone = {k for q in PROMPTS if first in q.keys for k in q.keys[q.keys.index(first) :]}
        self.must -= gone
        self.maybe -= gone

    @rule(chunks=st.integers(1, 8))
    def evict_dram(self, chunks: int) -> None:
        self.store.evict("dram", chunks * TINY.chunk_nbytes)
        if not self.write_through:
            self.maybe |= self.must
            self.must.clear()

    @rule(chunks=st.integers(1, 8))
    def evict_disk(self, chunks: int) -> None:
        self.store.evict("disk", chunks * TINY.chunk_nbytes)
        self.maybe |= self.must
        self.must.clear()

    @rule()
    def crash_and_reopen(self) -> None:
        self.store.drain()
        self.store.close(flush=False)
        self._check_events()
        self.states.clear()  # a new process: every object starts from the catalog
        self.store = self._open()
        if not self.write_through:
            self.maybe |= self.must
            self.must.clear()

    # ------------------------------------------------------------------ invariants

    def _check_events(self) -> None:
        for e in self.sink.take():
            before = self.states.get(e.key)
            if before is ObjectState.DELETED:
                before = None  # the key may be stored again as a new object
            after = check_move(e.key, before, Move(e.kind))
            assert after is not None and after.value == e.state, e
            self.states[e.key] = after

    @invariant()
    def events_obey_the_table(self) -> None:
        self._check_events()

    @invariant()
    def only_indexed_objects_are_served(self) -> None:
        for key in self.store.indexed_keys():
            state = self.states.get(key.hex())
            assert state is ObjectState.INDEXED, (key.hex(), state)


class WriteBackMachine(StoreMachine):
    """Write-back, small disk: eviction everywhere; the model only knows what may be served."""

    dram_chunks = 4
    disk_bytes = 12 * 8192
    write_through = False


class ThreeTierMachine(WriteBackMachine):
    """A third tier (a second memory tier standing in for a remote one) in the chain."""

    def _open(self) -> KVStore:
        chunk = TINY.chunk_nbytes
        chain = (
            TierSpec("memory", "dram", 3 * chunk),
            TierSpec("memory", "remote", 5 * chunk),
            TierSpec("disk", "disk", self.disk_bytes, options=(("segment_bytes", 64 << 10),)),
        )
        return KVStore.open(self.dir, tiers=chain, sink=self.sink)


class TransformedTierMachine(WriteBackMachine):
    """Tiers that transform on the way down: DRAM (exact) -> a remote stand-in that
    stores int8 -> a disk that stores lossless frames. Exact lookups are served bit-exact
    bytes only; lossless and lossy lookups are served what their class allows, and a
    lossy replica is always within int8's declared bound."""

    INT8 = make_transform("int8")

    def _open(self) -> KVStore:
        chunk = TINY.chunk_nbytes
        chain = (
            TierSpec("memory", "dram", 3 * chunk),
            TierSpec("memory", "remote", 5 * chunk, transform="int8"),
            TierSpec(
                "disk",
                "disk",
                self.disk_bytes,
                options=(("segment_bytes", 64 << 10),),
                transform="lossless",
            ),
        )
        return KVStore.open(self.dir, tiers=chain, sink=self.sink)

    @rule(p=st.sampled_from(PROMPTS), lossy=st.booleans())
    def load_accepting(self, p: Prompt, lossy: bool) -> None:
        self.store.drain()  # promotions of an earlier load may change the serving tier
        accept = Accept.lossy() if lossy else Accept.LOSSLESS
        hit = self.store.lookup(p.identity, p.namespace, p.tokens, accept=accept)
        for h in hit.hits:
            assert h.key in self.must or h.key in self.maybe, "served a chunk never committed"
            assert lossy or h.exactness in ("exact", "lossless"), h
        res = self.store.load(hit)
        assert all(k in self.damaged for k in res.corrupt), "an undamaged replica failed"
        for h, arr in zip(hit.hits, res.arrays, strict=False):
            want = self.expected[h.key]
            if h.exactness != "lossy":
                assert np.array_equal(arr, want), "an exact or lossless replica is not exact"
                continue
            assert h.transform == "int8", h
            bound = self.INT8.element_bounds(want)
            assert bound is not None
            err = np.abs(arr.astype(np.float64) - want.astype(np.float64))
            assert np.all(err <= bound), "a lossy replica is outside its declared bound"


# The default suite runs a short budget of each machine (the long one under the slow
# profile, see tests/conftest.py); test_store_machines_long runs them for longer.
TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(
    max_examples=budget(20, 40), stateful_step_count=30, deadline=None
)
TestWriteBackMachine = WriteBackMachine.TestCase
TestWriteBackMachine.settings = settings(
    max_examples=budget(20, 40), stateful_step_count=30, deadline=None
)
TestThreeTierMachine = ThreeTierMachine.TestCase
TestThreeTierMachine.settings = settings(
    max_examples=budget(15, 30), stateful_step_count=30, deadline=None
)
TestTransformedTierMachine = TransformedTierMachine.TestCase
TestTransformedTierMachine.settings = settings(
    max_examples=budget(15, 30), stateful_step_count=30, deadline=None
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "machine", [StoreMachine, WriteBackMachine, ThreeTierMachine, TransformedTierMachine]
)
def test_store_machines_long(machine: type[StoreMachine]) -> None:
    run_state_machine_as_test(
        machine, settings=settings(max_examples=200, stateful_step_count=50, deadline=None)
    )

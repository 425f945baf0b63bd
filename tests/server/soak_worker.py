"""Client processes of the soak test (``tests/server/test_soak.py``):
``python -m tests.server.soak_worker ROLE SOCKET SEED STATS STOP``.

Each runs until the file ``STOP`` exists (or it is SIGKILLed), then closes its
connections and exits 0. Every second, and at the end, it writes a JSON summary of what
it did to ``STATS`` (replaced atomically: a SIGKILL leaves the last whole one). Wrong
bytes served, or an error the server must never send to an ordinary client, end it with
a traceback on stderr and a non-zero status: the test fails on that.

Roles:

- ``hot``: the first half of issue 19's deadlock: puts 32 chunks (8 prompts of 4), then
  loops "evict dram by 2**40, then a streamed ``load_async`` of each prompt, chunk by
  chunk, its grants released". The loads read from disk into arena extents that the
  server's reader closures hold in a reference cycle until the collector runs.
- ``abort``: the other half: loops "``prepare_put`` of 8 new one-token chunks (8 arena
  extents), then ``abort_put``".
- ``mixed``: an engine-like client on a few connections (one ``RemoteStore`` each, each
  with a shared output buffer): every put path (``put_prompt`` two-phase and staged,
  ``prepare_put`` then ``commit_put`` or ``abort_put``, a prepare held across other
  calls), every load path (no buffers, ordinary buffers (hinted when every hit is in
  DRAM), shared buffers, ``load_async`` streamed, a ``sub`` of a lookup, ``get``),
  invalidations by prefix and by namespace, evictions of DRAM (some, all), flushes,
  and reconnects.
- ``burst``: every few seconds, ``KVLIFE_SOAK_BURST`` (72) connections at once, each
  loading one prompt of the pool, as an engine starting its workers does (not while
  the file ``hold`` beside ``STOP`` exists).

The payload of chunk ``i`` of prompt ``seed`` is a pure function of ``(seed, i)``
(:func:`chunk_kv`), and so are its tokens: a prompt put with any number of chunks has
the same leading chunks, and every chunk loaded is compared with what it must be.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from kvlife.client import RemoteStore
from kvlife.core import errors
from kvlife.core.identity import KVLayout, ModelIdentity, Namespace, NamespaceKind
from kvlife.results import LoadResult, LookupResult
from tests.conftest import TINY, tiny_identity

N = TINY.tokens_per_chunk
CHUNKS = 4
"""Chunks of a whole prompt (puts may store fewer: a prefix)."""
POOL = 24
"""Prompts the ``mixed`` clients share."""
HOT = 8
"""Prompts of the ``hot`` client: 8 x 4 = 32 chunks."""
ONE = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", tokens_per_chunk=1)
"""One-token chunks: the ``abort`` client's 8-chunk prepares reserve 8 extents each."""
BURST = int(os.environ.get("KVLIFE_SOAK_BURST", "72"))
"""Connections the ``burst`` client opens at once: more than a listen backlog of 64, and
few enough that the server's threads (about 27 besides) fit the 100 stacks faulthandler
dumps when the test finds it hung."""
CALL_TIMEOUT_S = 60.0
"""Socket timeout of every client call: far beyond the watchdog's deadline, so a hung
server is reported by the watchdog, not by a client."""

POOL_NS = Namespace(NamespaceKind.ORGANISATION, "soak-pool")
HOT_NS = Namespace(NamespaceKind.ORGANISATION, "soak-hot")
ABORT_NS = Namespace(NamespaceKind.ORGANISATION, "soak-abort")

FORBIDDEN: tuple[type[BaseException], ...] = (
    errors.RemoteError,  # the server's internal error: a bug, logged with its traceback
    errors.ProtocolError,  # this client speaks the protocol as RemoteStore does
    errors.IllegalTransition,
    errors.InvalidArgument,
    errors.LayoutMismatch,
    errors.PartialChunkError,
)
"""Errors an ordinary client must never see: one ends the worker (the test fails).
Every other typed error (``StoreUnavailable``, ``StorageFullError``, a budget's refusal)
is a refusal the client takes as a miss: counted by class, and the client goes on."""


class WrongBytes(AssertionError):
    """A loaded chunk differs from the bytes its key was put with."""


@functools.cache
def prompt_tokens(seed: int) -> np.ndarray:
    rng = np.random.default_rng([7919, seed])
    return rng.integers(0, 50_000, CHUNKS * N)


@functools.cache
def chunk_kv(seed: int, i: int) -> np.ndarray:
    """The KV of chunk ``i`` of prompt ``seed``: (layers, 2, heads, N, dim)."""
    rng = np.random.default_rng([104729, seed, i])
    out = rng.standard_normal(TINY.chunk_shape).astype(np.float16)
    out.flags.writeable = False
    return out


def prompt(seed: int, nchunks: int = CHUNKS) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and KV of the first ``nchunks`` chunks of prompt ``seed``."""
    kv = np.concatenate([chunk_kv(seed, i) for i in range(nchunks)], axis=3)
    return prompt_tokens(seed)[: nchunks * N], kv


def check(seed: int, arrays: Sequence[np.ndarray | None], what: str) -> int:
    """Compare each loaded chunk with its expected bytes; how many were loaded."""
    n = 0
    for i, arr in enumerate(arrays):
        if arr is None:
            break
        if not np.array_equal(arr, chunk_kv(seed, i)):
            raise WrongBytes(
                f"wrong bytes served: prompt {seed} chunk {i} ({what}); the bytes: "
                f"{identify(np.array(arr), seed, i)}"
            )
        n += 1
    return n


def identify(arr: np.ndarray, seed: int, i: int) -> str:
    """What wrong bytes are (a diagnosis for the report): zeros, another chunk, or how
    much of the expected chunk they hold."""
    want = chunk_kv(seed, i)
    flat, exp = arr.reshape(-1).view(np.uint16), want.reshape(-1).view(np.uint16)
    differ = np.flatnonzero(flat != exp)
    what = [f"{len(differ)} of {flat.size} elements differ, from {differ[0]} to {differ[-1]}"]
    if not flat.any():
        what.append("all zeros")
    for s in [*range(POOL), *range(1000, 1000 + HOT)]:
        for j in range(CHUNKS):
            other = chunk_kv(s, j).reshape(-1).view(np.uint16)
            same = int((flat == other).sum())
            if same > flat.size // 8:
                what.append(f"{same} elements equal prompt {s} chunk {j}")
    return "; ".join(what)


def where(lk: LookupResult) -> str:
    """``dram`` when every hit is a DRAM replica (a hinted load), else ``disk``."""
    return "dram" if all(h.tier == "dram" for h in lk.hits) else "disk"


class Stats:
    """Counts of what this worker did, written to its stats file."""

    def __init__(self, path: Path, role: str, seed: int) -> None:
        self.path = path
        self.role = role
        self.seed = seed
        self.ops: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.chunks_verified = 0
        self._written = 0.0

    def flush(self, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self._written < 1.0:
            return
        self._written = now
        body = {
            "role": self.role,
            "seed": self.seed,
            "pid": os.getpid(),
            "final": final,
            "ops": dict(self.ops),
            "refused": dict(self.refused),
            "chunks_verified": self.chunks_verified,
        }
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body), encoding="utf-8")
        os.replace(tmp, self.path)


class Client:
    """One worker: its connections, its shared buffers, its random choices."""

    def __init__(self, sock: str, seed: int, stats: Stats, conns: int = 1) -> None:
        self.sock = sock
        self.rng = np.random.default_rng(seed)
        self.stats = stats
        self.ident = tiny_identity(model_id="soak")
        self.one = ModelIdentity(
            model_id="soak-one", weights_digest="w0", tokenizer_digest="t0", layout=ONE
        )
        self.stores = [self._connect() for _ in range(conns)]
        self.buffers: dict[int, list[np.ndarray]] = {}

    def _connect(self) -> RemoteStore:
        return RemoteStore(self.sock, timeout=CALL_TIMEOUT_S, lazy=True)

    def pick(self) -> RemoteStore:
        return self.stores[int(self.rng.integers(len(self.stores)))]

    def shared_outs(self, store: RemoteStore, n: int) -> list[np.ndarray] | None:
        """``n`` chunk buffers in this connection's shared buffer (made on first use);
        None when the server refused one (then the caller uses ordinary buffers)."""
        outs = self.buffers.get(id(store))
        if outs is None:
            try:
                raw = store.alloc_buffer(CHUNKS * 4096)
            except errors.KVLifeError as exc:
                self.refuse(exc)
                return None
            outs = [
                raw[i * 4096 : i * 4096 + TINY.chunk_nbytes]
                .view(np.float16)
                .reshape(TINY.chunk_shape)
                for i in range(CHUNKS)
            ]
            self.buffers[id(store)] = outs
        return outs[:n]

    def reconnect(self) -> None:
        i = int(self.rng.integers(len(self.stores)))
        old = self.stores[i]
        self.buffers.pop(id(old), None)
        old.close()
        self.stores[i] = self._connect()
        self.stats.ops["reconnect"] += 1

    def refuse(self, exc: BaseException) -> None:
        if isinstance(exc, FORBIDDEN):
            raise exc
        self.stats.refused[type(exc).__name__] += 1

    def close(self) -> None:
        for store in self.stores:
            store.close()

    # ------------------------------------------------------------------ puts

    def put(self, store: RemoteStore, ns: Namespace, seed: int, nchunks: int = CHUNKS) -> None:
        tokens, kv = prompt(seed, nchunks)
        store.put_prompt(self.ident, ns, tokens, kv)

    def put_two_phase(self, store: RemoteStore, seed: int, commit: bool) -> None:
        tokens, kv = prompt(seed, int(self.rng.integers(1, CHUNKS + 1)))
        pending = store.prepare_put(self.ident, POOL_NS, tokens, kv)
        if commit:
            store.commit_put(pending)
        else:
            store.abort_put(pending, "soak: aborted")

    def put_held(self, store: RemoteStore, seed: int) -> None:
        """A prepare held across other calls (a client killed meanwhile leaves it to the
        server to abort), then committed or aborted."""
        tokens, kv = prompt(seed, CHUNKS)
        pending = store.prepare_put(self.ident, POOL_NS, tokens, kv)
        for _ in range(int(self.rng.integers(1, 4))):
            self.load_plain(store, int(self.rng.integers(POOL)))
        if self.rng.random() < 0.7:
            store.commit_put(pending)
        else:
            store.abort_put(pending, "soak: held, then aborted")

    def prepare_one_token(self, store: RemoteStore) -> None:
        """8 new one-token chunks prepared, then aborted."""
        tokens = self.rng.integers(0, 2**31, 8)
        kv = np.zeros((ONE.num_layers, 2, ONE.num_kv_heads, 8, ONE.head_dim), np.float16)
        pending = store.prepare_put(self.one, ABORT_NS, tokens, kv)
        store.abort_put(pending, "soak: one-token prepare aborted")

    # ------------------------------------------------------------------ loads

    def lookup(self, store: RemoteStore, ns: Namespace, seed: int) -> LookupResult:
        return store.lookup(self.ident, ns, prompt_tokens(seed))

    def verified(self, seed: int, res: LoadResult, what: str) -> None:
        n = check(seed, res.arrays, what)
        if n != res.loaded:
            raise WrongBytes(f"prompt {seed}: {res.loaded} loaded, {n} arrays ({what})")
        self.stats.chunks_verified += n

    def load_plain(self, store: RemoteStore, seed: int) -> None:
        lk = self.lookup(store, POOL_NS, seed)
        res = store.load(lk)
        self.verified(seed, res, "load without buffers")
        self.stats.ops[f"load_none_{where(lk)}"] += 1

    def load_outs(self, store: RemoteStore, seed: int) -> None:
        lk = self.lookup(store, POOL_NS, seed)
        outs = [np.zeros(TINY.chunk_shape, np.float16) for _ in lk.hits]
        res = store.load(lk, outs)
        self.verified(seed, res, "load into buffers")
        check(seed, outs[: res.loaded], "load into buffers, the buffers")
        # every hit in DRAM with its place named by the lookup: the hinted copy
        self.stats.ops[f"load_outs_{where(lk)}"] += 1

    def load_shared(self, store: RemoteStore, seed: int) -> None:
        lk = self.lookup(store, POOL_NS, seed)
        outs = self.shared_outs(store, len(lk.hits))
        if outs is None:
            return
        for o in outs:
            o[...] = 0
        res = store.load(lk, outs)
        self.verified(seed, res, "load into shared buffers")
        check(seed, outs[: res.loaded], "load into shared buffers, the buffers")
        self.stats.ops[f"load_shared_{where(lk)}"] += 1

    def load_async(self, store: RemoteStore, ns: Namespace, seed: int, shared: bool) -> int:
        """A streamed ``load_async``, chunk by chunk; how many chunks were loaded."""
        lk = self.lookup(store, ns, seed)
        outs = self.shared_outs(store, len(lk.hits)) if shared else None
        handle = store.load_async(lk, outs)
        got = [handle.chunk(i, timeout=CALL_TIMEOUT_S) for i in range(len(handle))]
        res = handle.wait(timeout=CALL_TIMEOUT_S)
        for i, arr in enumerate(got):
            # a chunk handed out is that chunk, even one the load then counts as a miss
            # (invalidated while it was streamed)
            if arr is not None and not np.array_equal(arr, chunk_kv(seed, i)):
                now = np.array(arr)  # the buffer as it is now (the load has ended)
                raise WrongBytes(
                    f"wrong bytes served: prompt {seed} chunk {i} (load_async, "
                    f"{'shared' if shared else 'new'} buffers, hits {where(lk)}, "
                    f"{len(lk.hits)} hits, tiers {[h.tier for h in lk.hits]}, hinted "
                    f"{bool(getattr(lk, 'hints', None))}, result {res}); the bytes: "
                    f"{identify(now, seed, i)}"
                )
        self.verified(seed, res, "load_async")
        self.stats.ops[f"load_async_{where(lk)}"] += 1
        return res.loaded

    def load_sub(self, store: RemoteStore, seed: int) -> None:
        lk = self.lookup(store, POOL_NS, seed)
        if len(lk.hits) < 2:
            return
        part = lk.sub(0, len(lk.hits) - 1)
        outs = [np.zeros(TINY.chunk_shape, np.float16) for _ in part.hits]
        res = store.load(part, outs)
        self.verified(seed, res, "load of a sub-lookup")
        self.stats.ops["load_sub"] += 1

    def get(self, store: RemoteStore, seed: int) -> None:
        res = store.get(self.ident, POOL_NS, prompt_tokens(seed))
        self.verified(seed, res, "get")
        self.stats.ops["get"] += 1

    # ------------------------------------------------------------------ management

    def invalidate_prefix(self, store: RemoteStore, seed: int) -> None:
        hits = self.lookup(store, POOL_NS, seed).hits
        if hits:
            store.invalidate(prefix=hits[int(self.rng.integers(len(hits)))].key)
            self.stats.ops["invalidate_prefix"] += 1


def run_mixed(client: Client, stop: Path) -> None:
    """A weighted random mix of every call (see the module docstring)."""
    c = client
    steps: list[tuple[float, str, Callable[[RemoteStore, int], object]]] = [
        (14, "put_prompt", lambda s, p: c.put(s, POOL_NS, p, int(c.rng.integers(1, CHUNKS + 1)))),
        (8, "prepare_commit", lambda s, p: c.put_two_phase(s, p, commit=True)),
        (4, "prepare_abort", lambda s, p: c.put_two_phase(s, p, commit=False)),
        (4, "prepare_held", c.put_held),
        (3, "prepare_one_token", lambda s, p: c.prepare_one_token(s)),
        (10, "", c.load_plain),
        (12, "", c.load_outs),
        (10, "", c.load_shared),
        (6, "", lambda s, p: c.load_async(s, POOL_NS, p, shared=False)),
        (6, "", lambda s, p: c.load_async(s, POOL_NS, p, shared=True)),
        (4, "", c.load_sub),
        (3, "", c.get),
        (3, "", c.invalidate_prefix),
        (0.3, "invalidate_namespace", lambda s, p: s.invalidate(namespace=POOL_NS)),
        (3, "evict_some", lambda s, p: s.evict("dram", int(c.rng.integers(1, 64)) * 4096)),
        (1.5, "evict_all", lambda s, p: s.evict("dram", 2**40)),
        (1.5, "flush", lambda s, p: s.flush()),
        (0.5, "", lambda s, p: c.reconnect()),
    ]
    weights = np.array([w for w, _, _ in steps])
    weights /= weights.sum()
    while not stop.exists():
        k = int(c.rng.choice(len(steps), p=weights))
        _, name, step = steps[k]
        try:
            step(c.pick(), int(c.rng.integers(POOL)))
        except errors.KVLifeError as exc:
            c.refuse(exc)
            time.sleep(0.005)
        else:
            if name:
                c.stats.ops[name] += 1
        c.stats.flush()


def run_hot(client: Client, stop: Path) -> None:
    """32 chunks; then "evict all of DRAM, streamed loads of each prompt" in a loop."""
    store = client.stores[0]
    c = client
    while not stop.exists():
        try:
            for p in range(HOT):
                c.put(store, HOT_NS, 1000 + p)
            break
        except errors.KVLifeError as exc:
            c.refuse(exc)
            time.sleep(0.05)
    while not stop.exists():
        try:
            store.evict("dram", 2**40)
            c.stats.ops["evict_all"] += 1
            for p in range(HOT):
                if c.load_async(store, HOT_NS, 1000 + p, shared=False) < CHUNKS:
                    c.put(store, HOT_NS, 1000 + p)  # invalidated or evicted: put again
                    c.stats.ops["put_prompt"] += 1
        except errors.KVLifeError as exc:
            c.refuse(exc)
            time.sleep(0.005)
        c.stats.flush()


def run_abort(client: Client, stop: Path) -> None:
    """8 new one-token chunks prepared, then aborted, in a loop."""
    store = client.stores[0]
    while not stop.exists():
        try:
            client.prepare_one_token(store)
            client.stats.ops["prepare_one_token"] += 1
        except errors.KVLifeError as exc:
            client.refuse(exc)
            time.sleep(0.005)
        client.stats.flush()


def _burst_one(
    sock: str, ident: ModelIdentity, together: threading.Barrier, seed: int
) -> tuple[int, errors.KVLifeError | None]:
    """One connection of a burst: a verified load, then a wait for the others; the
    chunks verified, or the typed error it got."""
    store = RemoteStore(sock, timeout=CALL_TIMEOUT_S, lazy=True)
    try:
        res = store.load(store.lookup(ident, POOL_NS, prompt_tokens(seed)))
        return check(seed, res.arrays, "load of a burst connection"), None
    except errors.KVLifeError as exc:
        return 0, exc
    finally:
        with contextlib.suppress(threading.BrokenBarrierError):
            together.wait()
        store.close()


def run_burst(client: Client, stop: Path) -> None:
    """Every few seconds, ``BURST`` connections at once (an engine starting its workers):
    each connects, loads a prompt of the pool (verified), waits until all are
    connected, and closes."""
    c = client
    hold = stop.with_name("hold")
    while not stop.exists():
        time.sleep(float(c.rng.uniform(2, 8)))
        if stop.exists():
            break
        if hold.exists():
            continue  # the test suspects a hang: no new threads to hide the culprit's stack
        together = threading.Barrier(BURST, timeout=CALL_TIMEOUT_S)
        one = functools.partial(_burst_one, c.sock, c.ident, together)
        with ThreadPoolExecutor(BURST) as pool:
            done = list(pool.map(one, [int(s) for s in c.rng.integers(POOL, size=BURST)]))
        for verified, error in done:
            c.stats.chunks_verified += verified
            if error is not None:
                c.refuse(error)
            else:
                c.stats.ops["burst_connections"] += 1
        c.stats.ops["burst"] += 1
        c.stats.flush()


ROLES = {
    "mixed": (run_mixed, 3),
    "hot": (run_hot, 1),
    "abort": (run_abort, 1),
    "burst": (run_burst, 1),
}
"""Each role's loop and how many connections it holds."""


def main(argv: list[str]) -> int:
    role, sock, seed, stats_path, stop_path = argv
    loop, conns = ROLES[role]
    stats = Stats(Path(stats_path), role, int(seed))
    client = Client(sock, int(seed), stats, conns)
    try:
        loop(client, Path(stop_path))
    except BaseException:
        stats.flush(final=True)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(3)  # at once: no interpreter shutdown waiting on a hung connection
    client.close()
    stats.flush(final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

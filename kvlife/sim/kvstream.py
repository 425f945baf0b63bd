"""KV-cache write/read/delete streams for the device models: synthetic, and from Mooncake traces.

Why: whether lifetime hints reduce SSD write amplification depends on when KV objects
die, and a KV cache kills objects for two reasons: the workload ends them (a one-off
prompt is answered, a conversation closes, a system prompt is replaced) and the cache
evicts them when it is full. A stream here is the sequence of object writes, reads and
deletes (deletes become TRIMs on an SSD) that a KV cache of a given capacity issues.
The replay engine of a later issue will produce such streams from lifecycle traces; until
then two sources exist:

- :func:`synthetic_stream`: a seeded generator of three KV classes with very different
  lifetimes: shared system prompts (long-lived, rarely rewritten), conversation history
  (lives until the conversation closes, grows turn by turn) and fresh one-off prompts
  (die seconds after they are written). Objects span several pages.
- :func:`mooncake_stream`: a Mooncake JSON-lines trace (``timestamp`` ms,
  ``input_length``, ``output_length``, ``hash_ids``: one id per 512-token prefix-chained
  block) run through an LRU cache of blocks: write on miss, read on hit, delete on
  eviction.

Both return a :class:`KVStream` of flat numpy arrays, in (time, sequence) order, whose
live pages never exceed the capacity it was generated for. Each object also carries its
class and a small integer *feature* (known when it is written) for online predictors.
"""

from __future__ import annotations

import heapq
import json
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from kvlife.sim.errors import DeviceConfigError, TraceFormatError
from kvlife.sim.ftl_kernels import OP_DELETE, OP_READ, OP_WRITE


class KVClass(IntEnum):
    """Kind of KV object, as an engine knows it when it writes the object."""

    SYSTEM = 0
    """Shared system prompt (or another prefix shared by many requests)."""
    HISTORY = 1
    """Conversation history that later turns of the same conversation reuse."""
    FRESH = 2
    """A one-off prompt's KV, reused by nothing (or nothing soon)."""


@dataclass(frozen=True, slots=True)
class KVStream:
    """An object-level KV stream: each object is written once, maybe read, maybe deleted."""

    name: str
    """Where the stream came from."""
    capacity_pages: int
    """Logical pages the cache may hold; live pages never exceed it."""
    op_kind: NDArray[np.int8]
    """Per op: OP_WRITE, OP_READ or OP_DELETE (``kvlife.sim.ftl_kernels``)."""
    op_time: NDArray[np.float64]
    """Per op: virtual time (seconds), non-decreasing."""
    op_obj: NDArray[np.int64]
    """Per op: object id (index into the obj_* arrays)."""
    obj_npages: NDArray[np.int64]
    """Per object: pages it occupies (>= 1)."""
    obj_class: NDArray[np.int8]
    """Per object: its KVClass."""
    obj_feature: NDArray[np.int64]
    """Per object: a small feature id known at write time (class, turn, position bucket)."""
    info: dict[str, float] = field(default_factory=dict)
    """Summary figures of the generator (hit ratio, evictions, ...)."""

    def __post_init__(self) -> None:
        n = self.op_kind.shape[0]
        if self.op_time.shape[0] != n or self.op_obj.shape[0] != n:
            raise TraceFormatError(f"KVStream {self.name}: op arrays differ in length")
        m = self.obj_npages.shape[0]
        if self.obj_class.shape[0] != m or self.obj_feature.shape[0] != m:
            raise TraceFormatError(f"KVStream {self.name}: object arrays differ in length")
        if n and np.any(np.diff(self.op_time) < 0):
            raise TraceFormatError(f"KVStream {self.name}: op times must be non-decreasing")
        if m and np.any(self.obj_npages < 1):
            raise TraceFormatError(f"KVStream {self.name}: every object needs >= 1 page")

    def check(self) -> None:
        """Raise TraceFormatError unless every object is written at most once, read and
        deleted only while stored, and deleted at most once."""
        n = self.n_ops
        if n and (self.op_obj.min() < 0 or self.op_obj.max() >= self.n_objects):
            raise TraceFormatError(f"KVStream {self.name}: op refers to an unknown object")
        idx = np.arange(n)
        big = np.iinfo(np.int64).max
        for kind, what in ((OP_WRITE, "written"), (OP_DELETE, "deleted")):
            m = self.op_kind == kind
            counts = np.bincount(self.op_obj[m], minlength=self.n_objects)
            if np.any(counts > 1):
                o = int(np.flatnonzero(counts > 1)[0])
                raise TraceFormatError(f"KVStream {self.name}: object {o} {what} twice")
        w_at = np.full(self.n_objects, big, dtype=np.int64)
        d_at = np.full(self.n_objects, big, dtype=np.int64)
        w = self.op_kind == OP_WRITE
        d = self.op_kind == OP_DELETE
        w_at[self.op_obj[w]] = idx[w]
        d_at[self.op_obj[d]] = idx[d]
        use = ~w
        bad = use & ((w_at[self.op_obj] > idx) | (d_at[self.op_obj] < idx))
        if np.any(bad):
            i = int(np.flatnonzero(bad)[0])
            raise TraceFormatError(
                f"KVStream {self.name}: op {i} uses object {int(self.op_obj[i])} while it is "
                "not stored"
            )

    @property
    def n_ops(self) -> int:
        return int(self.op_kind.shape[0])

    @property
    def n_objects(self) -> int:
        return int(self.obj_npages.shape[0])

    def write_clock(self) -> NDArray[np.int64]:
        """Per op: host pages written by all ops before it (the clock lifetimes are measured in)."""
        w = np.where(self.op_kind == OP_WRITE, self.obj_npages[self.op_obj], 0)
        clock = np.zeros(self.n_ops, dtype=np.int64)
        clock[1:] = np.cumsum(w)[:-1]
        return clock

    @property
    def host_pages_written(self) -> int:
        return int(self.obj_npages[self.op_obj[self.op_kind == OP_WRITE]].sum())

    def lifetimes_pages(self) -> NDArray[np.float64]:
        """Per object: host pages written from its write to its delete (inf if never deleted)."""
        clock = self.write_clock()
        birth = np.full(self.n_objects, np.nan)
        death = np.full(self.n_objects, np.inf)
        wr = self.op_kind == OP_WRITE
        birth[self.op_obj[wr]] = clock[wr]
        de = self.op_kind == OP_DELETE
        death[self.op_obj[de]] = clock[de]
        out: NDArray[np.float64] = death - birth
        return out

    def max_live_pages(self) -> int:
        """Largest number of pages live at once (a check that the capacity holds)."""
        sign = np.where(self.op_kind == OP_WRITE, 1, np.where(self.op_kind == OP_DELETE, -1, 0))
        live = np.cumsum(sign * self.obj_npages[self.op_obj])
        return int(live.max()) if live.size else 0


class _Builder:
    """Accumulates ops and objects, and the LRU of cache owners, while a generator runs."""

    def __init__(self, capacity_pages: int) -> None:
        self.capacity = capacity_pages
        self.kind: list[int] = []
        self.time: list[float] = []
        self.obj: list[int] = []
        self.npages: list[int] = []
        self.cls: list[int] = []
        self.feature: list[int] = []
        self.owner_of: list[int] = []
        self.live_pages = 0
        self.pages_written = 0
        self.evictions = 0
        # owner -> live objects; LRU order of owners (least recent first).
        self.owned: dict[int, list[int]] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()
        self._next_owner = 0

    def new_owner(self) -> int:
        self._next_owner += 1
        return self._next_owner - 1

    def touch(self, owner: int) -> None:
        if owner in self.lru:
            self.lru.move_to_end(owner)

    def live(self, owner: int) -> list[int]:
        return self.owned.get(owner, [])

    def read(self, t: float, obj: int) -> None:
        self.kind.append(OP_READ)
        self.time.append(t)
        self.obj.append(obj)

    def delete_owner(self, t: float, owner: int) -> None:
        for o in self.owned.pop(owner, []):
            self.kind.append(OP_DELETE)
            self.time.append(t)
            self.obj.append(o)
            self.live_pages -= self.npages[o]
        self.lru.pop(owner, None)

    def delete_object(self, t: float, owner: int, obj: int) -> None:
        objs = self.owned.get(owner)
        if objs is None or obj not in objs:
            return
        objs.remove(obj)
        self.kind.append(OP_DELETE)
        self.time.append(t)
        self.obj.append(obj)
        self.live_pages -= self.npages[obj]
        if not objs:
            del self.owned[owner]
            self.lru.pop(owner, None)

    def write(self, t: float, owner: int, npages: int, cls: KVClass, feature: int) -> int:
        if npages > self.capacity:
            raise DeviceConfigError(
                f"an object of {npages} pages cannot fit a cache of {self.capacity} pages"
            )
        # The owner being written becomes most recent first, so it is evicted only when it
        # is the last owner left.
        self.touch(owner)
        while self.live_pages + npages > self.capacity:
            victim = next(iter(self.lru))
            self.evictions += 1
            self.delete_owner(t, victim)
        o = len(self.npages)
        self.npages.append(npages)
        self.cls.append(int(cls))
        self.feature.append(feature)
        self.owner_of.append(owner)
        self.kind.append(OP_WRITE)
        self.time.append(t)
        self.obj.append(o)
        self.live_pages += npages
        self.pages_written += npages
        self.owned.setdefault(owner, []).append(o)
        if owner not in self.lru:
            self.lru[owner] = None
        return o

    def build(self, name: str, info: dict[str, float]) -> KVStream:
        return KVStream(
            name=name,
            capacity_pages=self.capacity,
            op_kind=np.array(self.kind, dtype=np.int8),
            op_time=np.array(self.time, dtype=np.float64),
            op_obj=np.array(self.obj, dtype=np.int64),
            obj_npages=np.array(self.npages, dtype=np.int64),
            obj_class=np.array(self.cls, dtype=np.int8),
            obj_feature=np.array(self.feature, dtype=np.int64),
            info=info,
        )


@dataclass(frozen=True, slots=True)
class SyntheticKVConfig:
    """Parameters of :func:`synthetic_stream` (times in seconds, sizes in pages)."""

    capacity_pages: int = 65536
    """Logical pages the KV cache may hold at once (normally the SSD's logical capacity)."""
    total_write_pages: int = 655360
    """Generation stops once this many pages have been written."""
    request_rate_per_s: float = 200.0
    """Poisson rate of new requests (one-off prompts and new conversations)."""
    fresh_fraction: float = 0.6
    """Share of new requests that are one-off prompts; the rest open conversations."""
    n_system_prompts: int = 16
    """Distinct shared system prompts."""
    system_prompt_pages: int = 64
    """Pages of one system prompt's KV."""
    system_rewrite_mean_s: float = 600.0
    """Mean time between rewrites of one system prompt (a new version replaces the old)."""
    turns_mean: float = 6.0
    """Mean turns per conversation (geometric)."""
    think_time_mean_s: float = 20.0
    """Mean time between turns of a conversation (exponential)."""
    idle_timeout_s: float = 60.0
    """A conversation's history is deleted this long after its last turn."""
    turn_pages_mean: float = 6.0
    """Mean pages of KV a turn appends to the history (log-normal, sigma 0.5)."""
    fresh_pages_mean: float = 12.0
    """Mean pages of a one-off prompt's KV (log-normal, sigma 0.5)."""
    fresh_lifetime_mean_s: float = 2.0
    """Mean time a one-off prompt's KV lives before it is deleted (exponential)."""
    seed: int = 0
    """Seed of the generator."""

    def __post_init__(self) -> None:
        for name in (
            "capacity_pages",
            "total_write_pages",
            "n_system_prompts",
            "system_prompt_pages",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise DeviceConfigError(
                    f"SyntheticKVConfig.{name} must be an integer >= 1, got {v!r}"
                )
        for name in (
            "request_rate_per_s",
            "system_rewrite_mean_s",
            "think_time_mean_s",
            "idle_timeout_s",
            "turn_pages_mean",
            "fresh_pages_mean",
            "fresh_lifetime_mean_s",
        ):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise DeviceConfigError(
                    f"SyntheticKVConfig.{name} must be a finite number > 0, got {v!r}"
                )
        if not (isinstance(self.turns_mean, int | float) and self.turns_mean >= 1):
            raise DeviceConfigError(
                f"SyntheticKVConfig.turns_mean must be >= 1, got {self.turns_mean!r}"
            )
        if not 0.0 <= self.fresh_fraction <= 1.0:
            raise DeviceConfigError(
                f"SyntheticKVConfig.fresh_fraction must be in [0, 1], got {self.fresh_fraction!r}"
            )
        if self.n_system_prompts * self.system_prompt_pages * 4 > self.capacity_pages:
            raise DeviceConfigError(
                "SyntheticKVConfig: system prompts take more than a quarter of the capacity "
                f"({self.n_system_prompts} x {self.system_prompt_pages} pages vs "
                f"{self.capacity_pages})"
            )


# Event kinds of the synthetic generator.
_EV_ARRIVAL = 0
_EV_TURN = 1
_EV_CONV_END = 2
_EV_FRESH_END = 3
_EV_SYS_REWRITE = 4

SYSTEM_FEATURE = 0
"""Feature id of system prompt objects."""
HISTORY_FEATURE_BASE = 1
"""History objects: HISTORY_FEATURE_BASE + min(turn, 7); a rewrite after eviction uses +8."""
FRESH_FEATURE = 10
"""Feature id of one-off prompt objects."""


def synthetic_stream(config: SyntheticKVConfig | None = None) -> KVStream:
    """Generate a seeded KV stream of system prompts, conversations and one-off prompts.

    The cache holds at most ``capacity_pages``; when a write does not fit, whole owners
    (a conversation's history, a one-off prompt, a system prompt version) are evicted in
    LRU order. A conversation whose history was evicted recomputes it on its next turn and
    writes it again as one object.
    """
    cfg = config or SyntheticKVConfig()
    rng = np.random.default_rng(cfg.seed)
    b = _Builder(cfg.capacity_pages)
    # Events ordered by (time, sequence): ties keep the order they were scheduled in.
    heap: list[tuple[float, int, int, int]] = []
    seq = 0

    def push(t: float, kind: int, arg: int) -> None:
        nonlocal seq
        heapq.heappush(heap, (t, seq, kind, arg))
        seq += 1

    def lognormal_pages(mean: float) -> int:
        sigma = 0.5
        mu = math.log(mean) - sigma * sigma / 2
        return max(1, round(float(rng.lognormal(mu, sigma))))

    # System prompts: owner per prompt version; prompt -> (owner, object).
    sys_owner: list[int] = []
    sys_obj: list[int] = []

    def write_system(t: float, p: int) -> None:
        owner = b.new_owner()
        obj = b.write(t, owner, cfg.system_prompt_pages, KVClass.SYSTEM, SYSTEM_FEATURE)
        if p < len(sys_owner):
            old_owner = sys_owner[p]
            sys_owner[p], sys_obj[p] = owner, obj
            b.delete_owner(t, old_owner)
        else:
            sys_owner.append(owner)
            sys_obj.append(obj)

    def use_system(t: float, p: int) -> None:
        if b.live(sys_owner[p]):
            b.touch(sys_owner[p])
            b.read(t, sys_obj[p])
        else:  # evicted: recompute and store again
            write_system(t, p)

    for p in range(cfg.n_system_prompts):
        write_system(0.0, p)
        push(float(rng.exponential(cfg.system_rewrite_mean_s)), _EV_SYS_REWRITE, p)

    # Conversations: id -> [owner, prompt, turns_left, turn_index, history_pages].
    convs: dict[int, list[int]] = {}
    next_conv = 0
    push(float(rng.exponential(1.0 / cfg.request_rate_per_s)), _EV_ARRIVAL, 0)
    p_end = 1.0 / cfg.turns_mean

    def conv_turn(t: float, c: int) -> None:
        owner, prompt, turns_left, turn, hist_pages = convs[c]
        use_system(t, prompt)
        b.touch(owner)
        live = b.live(owner)
        if turn > 0 and not live:
            # History evicted: recompute it and store it again as one object.
            b.write(t, owner, hist_pages, KVClass.HISTORY, HISTORY_FEATURE_BASE + 8)
        else:
            for o in list(live):
                b.read(t, o)
        n = lognormal_pages(cfg.turn_pages_mean)
        b.write(t, owner, n, KVClass.HISTORY, HISTORY_FEATURE_BASE + min(turn, 7))
        convs[c] = [owner, prompt, turns_left - 1, turn + 1, hist_pages + n]
        if turns_left - 1 > 0:
            push(t + float(rng.exponential(cfg.think_time_mean_s)), _EV_TURN, c)
        else:
            push(t + cfg.idle_timeout_s, _EV_CONV_END, c)

    while heap and b.pages_written < cfg.total_write_pages:
        t, _, kind, arg = heapq.heappop(heap)
        if kind == _EV_ARRIVAL:
            push(t + float(rng.exponential(1.0 / cfg.request_rate_per_s)), _EV_ARRIVAL, 0)
            prompt = int(rng.integers(cfg.n_system_prompts))
            if rng.random() < cfg.fresh_fraction:
                use_system(t, prompt)
                owner = b.new_owner()
                n = lognormal_pages(cfg.fresh_pages_mean)
                b.write(t, owner, n, KVClass.FRESH, FRESH_FEATURE)
                push(t + float(rng.exponential(cfg.fresh_lifetime_mean_s)), _EV_FRESH_END, owner)
            else:
                turns = int(rng.geometric(p_end))
                convs[next_conv] = [b.new_owner(), prompt, turns, 0, 0]
                conv_turn(t, next_conv)
                next_conv += 1
        elif kind == _EV_TURN:
            conv_turn(t, arg)
        elif kind == _EV_CONV_END:
            b.delete_owner(t, convs.pop(arg)[0])
        elif kind == _EV_FRESH_END:
            b.delete_owner(t, arg)
        else:
            write_system(t, arg)
            push(t + float(rng.exponential(cfg.system_rewrite_mean_s)), _EV_SYS_REWRITE, arg)

    info = {
        "conversations": float(next_conv),
        "evictions": float(b.evictions),
        "pages_written": float(b.pages_written),
    }
    return b.build(f"synthetic(seed={cfg.seed})", info)


@dataclass(frozen=True, slots=True)
class MooncakeRequest:
    """One request of a Mooncake trace."""

    timestamp_ms: int
    """Arrival, milliseconds from the trace start."""
    input_length: int
    """Prompt tokens."""
    output_length: int
    """Generated tokens."""
    hash_ids: tuple[int, ...]
    """One id per 512-token block of the prompt, prefix-chained."""


def read_mooncake(path: str | Path, max_requests: int | None = None) -> list[MooncakeRequest]:
    """Parse a Mooncake JSON-lines trace; a malformed line raises :class:`TraceFormatError`."""
    p = Path(path)
    out: list[MooncakeRequest] = []
    try:
        fh = p.open("r", encoding="utf-8")
    except OSError as e:
        raise TraceFormatError(f"cannot open trace {p}: {e}") from e
    with fh:
        for lineno, line in enumerate(fh, start=1):
            if max_requests is not None and len(out) >= max_requests:
                break
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceFormatError(f"{p}:{lineno}: not JSON: {e.msg}") from e
            if not isinstance(rec, dict):
                raise TraceFormatError(f"{p}:{lineno}: expected a JSON object")
            for fname in ("timestamp", "input_length", "output_length"):
                v = rec.get(fname)
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise TraceFormatError(
                        f"{p}:{lineno}: field {fname!r} must be an integer >= 0, got {v!r}"
                    )
            ids = rec.get("hash_ids")
            if not isinstance(ids, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) for h in ids
            ):
                raise TraceFormatError(f"{p}:{lineno}: field 'hash_ids' must be a list of integers")
            if out and rec["timestamp"] < out[-1].timestamp_ms:
                raise TraceFormatError(f"{p}:{lineno}: timestamp goes backwards")
            out.append(
                MooncakeRequest(
                    rec["timestamp"], rec["input_length"], rec["output_length"], tuple(ids)
                )
            )
    return out


def mooncake_stream(
    requests: list[MooncakeRequest],
    capacity_pages: int,
    pages_per_block: int = 4,
    tokens_per_block: int = 512,
    time_scale: float = 1.0,
    name: str = "mooncake",
) -> KVStream:
    """Turn Mooncake requests into a KV stream through an LRU cache of prompt blocks.

    Each prompt block is one object of ``pages_per_block`` pages (fewer for a last, partial
    block: pages proportional to its tokens). A block found in the cache is read; a missing
    one is written, evicting least recently used blocks (deletes) until it fits. Classes:
    position 0 (the prefix every request shares) is SYSTEM; blocks written by a request
    that reused a prefix beyond position 0 are HISTORY (a continuing conversation); blocks
    of a request with no such reuse are FRESH. Feature: class x 16 + log2 position bucket.
    Times are ``timestamp_ms / 1000 / time_scale`` (a ``time_scale`` of 10 replays 10x faster).
    """
    if (
        isinstance(capacity_pages, bool)
        or not isinstance(capacity_pages, int)
        or capacity_pages < 1
    ):
        raise DeviceConfigError(f"capacity_pages must be an integer >= 1, got {capacity_pages!r}")
    if pages_per_block < 1 or tokens_per_block < 1:
        raise DeviceConfigError("pages_per_block and tokens_per_block must be >= 1")
    if not (math.isfinite(time_scale) and time_scale > 0):
        raise DeviceConfigError(f"time_scale must be a finite number > 0, got {time_scale!r}")
    b = _Builder(capacity_pages)
    # Each cached block is its own cache owner: (position, hash id) <-> owner.
    block_owner: dict[tuple[int, int], int] = {}
    owner_key: dict[int, tuple[int, int]] = {}
    touches = hits = 0
    for req in requests:
        t = req.timestamp_ms / 1000.0 / time_scale
        n_blocks = len(req.hash_ids)
        reused = n_blocks > 1 and (1, req.hash_ids[1]) in block_owner
        for pos, h in enumerate(req.hash_ids):
            touches += 1
            k = (pos, h)
            cached = block_owner.get(k)
            if cached is not None:
                hits += 1
                b.touch(cached)
                b.read(t, b.live(cached)[0])
                continue
            tokens = req.input_length - pos * tokens_per_block
            frac = 1.0 if tokens >= tokens_per_block else max(tokens, 1) / tokens_per_block
            npages = max(1, math.ceil(pages_per_block * frac))
            cls = KVClass.SYSTEM if pos == 0 else (KVClass.HISTORY if reused else KVClass.FRESH)
            feature = int(cls) * 16 + min(int(math.log2(pos + 1)), 15)
            owner = b.new_owner()
            before = len(b.kind)
            b.write(t, owner, npages, cls, feature)
            # Forget the blocks whose objects this write evicted.
            for i in range(before, len(b.kind)):
                if b.kind[i] == OP_DELETE:
                    key = owner_key.pop(b.owner_of[b.obj[i]], None)
                    if key is not None:
                        del block_owner[key]
            block_owner[k] = owner
            owner_key[owner] = k
    info = {
        "requests": float(len(requests)),
        "block_touches": float(touches),
        "block_hits": float(hits),
        "hit_ratio": hits / touches if touches else math.nan,
        "evictions": float(b.evictions),
        "pages_written": float(b.pages_written),
    }
    return b.build(name, info)


__all__ = [
    "FRESH_FEATURE",
    "HISTORY_FEATURE_BASE",
    "SYSTEM_FEATURE",
    "KVClass",
    "KVStream",
    "MooncakeRequest",
    "SyntheticKVConfig",
    "mooncake_stream",
    "read_mooncake",
    "synthetic_stream",
]

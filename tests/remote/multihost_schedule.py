"""Schedules of the multi-host model: the prompts every host works on, the steps a
schedule is made of (as JSON-able data, so that a failing schedule can be printed,
replayed and shrunk), and the seeded generator of random schedules.

The prompts are few and overlap on purpose (two share their first two chunks, one
repeats another's tokens in a second tenant, one uses an adapter, one other weights),
so that every invalidation selector (namespace, adapter, weights, prefix, and pairs of
them) covers some chunks and spares others, and hosts keep meeting on the same keys.
Beside them, *fresh* prompts (numbers from :data:`FRESH`, never reused in a run, in a
tenant and under weights no invalidation names) carry the liveness checks: a handoff
between two hosts, and the puts that race a revocation.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import cache
from typing import Any

import numpy as np

from kvlife.core.identity import ModelIdentity, prompt_chunk_keys
from tests.conftest import TINY, tiny_identity
from tests.remote.multihost_api import Criteria, org

CHUNKS = 4
NTOKENS = CHUNKS * TINY.tokens_per_chunk


@dataclass(frozen=True, slots=True)
class Prompt:
    ns: str
    adapter: str
    weights: str
    family: int
    """Seed of the first two chunks' tokens (prompts of one family share them)."""
    tail: int
    """Seed of the last two chunks' tokens."""

    def identity(self) -> ModelIdentity:
        changes = {"weights_digest": self.weights}
        if self.adapter:
            changes.update(adapter_id=self.adapter, adapter_digest="d-" + self.adapter)
        return tiny_identity(**changes)

    def tokens(self) -> np.ndarray:
        half = NTOKENS // 2
        head = np.random.default_rng(1000 + self.family).integers(0, 50_000, half)
        tail = np.random.default_rng(2000 + self.tail).integers(0, 50_000, NTOKENS - half)
        return np.concatenate([head, tail])


FRESH = 1000
"""Prompt numbers from here on are fresh prompts (:func:`prompt_of`)."""

PROMPTS: tuple[Prompt, ...] = (
    Prompt("acme", "", "w0", 0, 0),
    Prompt("acme", "", "w0", 0, 1),  # shares its first two chunks with prompt 0
    Prompt("acme", "lora-1", "w0", 1, 2),
    Prompt("globex", "", "w0", 0, 0),  # prompt 0's tokens, another tenant
    Prompt("acme", "", "w1", 2, 3),
    Prompt("globex", "lora-1", "w1", 1, 4),
)


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """What an invalidation can select a chunk by."""

    ns: str
    adapter: str
    weights: str
    lineage: tuple[bytes, ...]
    """The chunk's key and every key chained before it."""


def prompt_of(p: int) -> Prompt:
    """Prompt ``p``: one of :data:`PROMPTS`, or from :data:`FRESH` on a fresh one (tenant
    ``fresh``, weights ``wf``: no generated invalidation selects it, and its tokens are
    its own)."""
    if p < FRESH:
        return PROMPTS[p]
    return Prompt("fresh", "", "wf", p, p)


@cache
def prompt_keys(p: int) -> tuple[bytes, ...]:
    pr = prompt_of(p)
    return tuple(bytes(k) for k in prompt_chunk_keys(pr.identity(), org(pr.ns), pr.tokens()))


def key_infos(prompts: Sequence[int] = range(len(PROMPTS))) -> dict[bytes, KeyInfo]:
    out: dict[bytes, KeyInfo] = {}
    for p in prompts:
        pr = prompt_of(p)
        keys = prompt_keys(p)
        for i, k in enumerate(keys):
            out[k] = KeyInfo(pr.ns, pr.adapter, pr.weights, keys[: i + 1])
    return out


def version_kv(vid: int) -> np.ndarray:
    """The KV of put ``vid``: every put computes different bytes, so a served chunk
    names the put it came from (and so that put's creation time)."""
    rng = np.random.default_rng([vid, 7919])
    shape = (TINY.num_layers, 2, TINY.num_kv_heads, NTOKENS, TINY.head_dim)
    return rng.standard_normal(shape).astype(np.float16)


def chunk_of(kv: np.ndarray, i: int) -> np.ndarray:
    n = TINY.tokens_per_chunk
    return np.ascontiguousarray(kv[:, :, :, i * n : (i + 1) * n, :])


# ---------------------------------------------------------------------- steps

KINDS = (
    "put",  # host, prompt: put_prompt (a new version of the prompt's KV)
    "begin",  # host, prompt: prepare_put (the KV is computed now, committed later)
    "commit",  # host: commit_put of its pending put
    "abort",  # host: abort_put of its pending put
    "flush",  # host
    "lookup",  # host, prompt, lossy: kept for a later "load"
    "load",  # host: load what its last lookup answered
    "get",  # host, prompt, lossy, must: lookup and load at once
    "request",  # host, prompt, lossy: what an engine does: get, then put what was missing
    "recall",  # host (with a disk tier): get the prompt it last made durable
    "inv_global",  # host, crit: KVStore.invalidate (global on a store with a shared tier)
    "inv_index",  # host (in-process), crit: GlobalIndex.invalidate (records, applies nowhere)
    "revoke",  # host (in-process issuer), target, ban_ms
    "revoke_race",  # host, target, ban_ms, ms: revoke (after ms) while target publishes
    "expire",  # host: sleep past its lease
    "restart",  # host, clean: close (flush or not) and reopen
    "redis_restart",  # persist: with its data (SHUTDOWN SAVE) or empty
    "flushall",  # every key of every node gone
    "fault",  # host, fault, span: a partition or delays between that host and Redis
    "handoff",  # host, target: host publishes a fresh prompt, target must serve it
    "mismatch",  # host, prompt: a host configured with other buckets tries everything
    "wait",  # ms: let time pass (leases run down, backoffs end); not generated
)


@dataclass(slots=True)
class Step:
    kind: str
    host: str = ""
    prompt: int = 0
    lossy: bool = False
    crit: dict[str, Any] = field(default_factory=dict)
    target: str = ""
    ban_ms: int = 0
    clean: bool = True
    persist: bool = False
    fault: str = ""
    span: int = 0
    """A fault's length in steps (it heals after them)."""
    ms: int = 0
    must: bool = False
    """A get that must serve every chunk of the prompt (a liveness check of a minimal
    schedule; retried for a few seconds: an index backoff is no loss)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown step kind {self.kind!r}")

    def criteria(self) -> Criteria:
        return Criteria.from_json(self.crit)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        default = Step(self.kind)
        return {k: v for k, v in d.items() if k == "kind" or v != getattr(default, k)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Step:
        return cls(**d)

    def __str__(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))


def dumps(steps: Sequence[Step]) -> str:
    return json.dumps([s.to_json() for s in steps], separators=(",", ":"))


def loads(text: str) -> list[Step]:
    return [Step.from_json(d) for d in json.loads(text)]


# ---------------------------------------------------------------------- generator


@dataclass(frozen=True, slots=True)
class Cast:
    """Who takes part: host names by kind, and what the backend can do."""

    in_process: tuple[str, ...]
    served: tuple[str, ...]
    faults: bool
    """Partitions and delays through a fault proxy (single Redis only)."""
    redis_restarts: bool = True
    disk: tuple[str, ...] = ()
    """In-process hosts whose chain has a disk tier between DRAM and the shared tier
    (what they flushed survives their restarts: issue 29 item 6)."""

    @property
    def hosts(self) -> tuple[str, ...]:
        return self.in_process + self.served


WEIGHTS: dict[str, float] = {
    "put": 6,
    "request": 14,
    "begin": 4,
    "commit": 5,
    "abort": 0.5,
    "flush": 12,
    "lookup": 8,
    "load": 8,
    "get": 10,
    "inv_global": 3,
    "inv_index": 1.2,
    "inv_bad": 0.15,
    "revoke": 1.2,
    "revoke_race": 0.4,
    "expire": 0.7,
    "restart": 2.5,
    "restart_disk": 1.5,
    "recall": 3,
    "redis_restart": 1.2,
    "flushall": 0.6,
    "fault": 3,
    "handoff": 1.5,
    "mismatch": 0.2,
}


PROMPT_WEIGHTS = (4, 2, 2, 1.5, 1, 1)
"""Prompt 0 and its relatives come up most: hosts meet on the same keys often."""


def random_criteria(rng: random.Random, bad: bool = False) -> dict[str, Any]:
    """Selectors of one invalidation: one criterion or two intersected."""
    if bad:  # a namespace that is no Namespace (issue 29 item 5)
        return {"raw_namespace": rng.choice(["acme", "globex"])}
    p = rng.randrange(len(PROMPTS))
    pr = PROMPTS[p]
    one = rng.choice(["namespace", "adapter_id", "weights_digest", "prefix"])
    picks = {one}
    if rng.random() < 0.3:
        picks.add(rng.choice(["namespace", "adapter_id", "weights_digest", "prefix"]))
    out: dict[str, Any] = {}
    for c in picks:
        if c == "namespace":
            out[c] = pr.ns
        elif c == "adapter_id":
            out[c] = pr.adapter or "lora-1"
        elif c == "weights_digest":
            out[c] = pr.weights
        else:
            out[c] = prompt_keys(p)[rng.randrange(CHUNKS)].hex()
    return out


def generate(seed: int, n: int, cast: Cast, without: Sequence[str] = ()) -> list[Step]:
    """A random schedule of ``n`` steps (the same for the same seed and cast), with no
    step of the kinds in ``without`` (``inv_bad`` for the malformed rules)."""
    rng = random.Random(seed)
    kinds = {k: w for k, w in WEIGHTS.items() if k not in without}
    if not cast.faults:
        kinds.pop("fault", None)
    if not cast.redis_restarts:
        kinds.pop("redis_restart", None)
    if len(set(cast.in_process) - set(cast.disk)) < 2:
        kinds.pop("revoke_race", None)
    if not cast.disk:
        kinds.pop("restart_disk", None)
        kinds.pop("recall", None)
    names, weights = list(kinds), list(kinds.values())
    steps: list[Step] = []
    while len(steps) < n:
        kind = rng.choices(names, weights)[0]
        host = rng.choice(cast.hosts)
        issuer = rng.choice(cast.in_process)
        prompt = rng.choices(range(len(PROMPTS)), PROMPT_WEIGHTS)[0]
        lossy = rng.random() < 0.3
        if kind in ("put", "begin"):
            steps.append(Step(kind, host, prompt))
        elif kind in ("commit", "abort", "flush", "load", "expire"):
            steps.append(Step(kind, host))
        elif kind in ("lookup", "get", "request"):
            steps.append(Step(kind, host, prompt, lossy=lossy))
        elif kind == "inv_global":
            steps.append(Step(kind, host, crit=random_criteria(rng)))
        elif kind == "inv_index":
            steps.append(Step(kind, issuer, crit=random_criteria(rng)))
        elif kind == "inv_bad":  # refused when written, by either way in
            way = rng.choice(["inv_global", "inv_index"])
            who = host if way == "inv_global" else issuer
            steps.append(Step(way, who, crit=random_criteria(rng, True)))
        elif kind == "revoke":
            ban = rng.choice([0, 0, 300, 1500])
            steps.append(Step(kind, issuer, target=host, ban_ms=ban))
        elif kind == "revoke_race":  # the target publishes: no disk tier in between
            target = rng.choice([h for h in cast.in_process if h not in (issuer, *cast.disk)])
            ban = rng.choice([800, 1500])
            steps.append(Step(kind, issuer, target=target, ban_ms=ban, ms=rng.choice([0, 20, 60])))
        elif kind == "restart":
            if host in cast.served and rng.random() < 0.7:
                continue  # a server process takes a second or two to start: fewer
            steps.append(Step(kind, host, clean=rng.random() < 0.6))
        elif kind == "restart_disk":  # what it flushed must survive (item 6)
            steps.append(Step("restart", rng.choice(cast.disk), clean=rng.random() < 0.5))
        elif kind == "recall":
            steps.append(Step(kind, rng.choice(cast.disk), lossy=lossy))
        elif kind == "redis_restart":
            steps.append(Step(kind, persist=rng.random() < 0.5))
        elif kind == "flushall":
            steps.append(Step(kind))
        elif kind == "fault":
            f = rng.choice(["partition", "delay"])
            steps.append(Step(kind, host, fault=f, span=rng.randint(1, 8)))
        elif kind == "handoff":  # from a host that publishes when it flushes
            source = rng.choice([h for h in cast.hosts if h not in cast.disk])
            target = rng.choice([h for h in cast.hosts if h != source])
            steps.append(Step(kind, source, target=target))
        elif kind == "mismatch":
            steps.append(Step(kind, issuer, prompt))
    return steps

"""Schedules of the multi-host model: the prompts every host works on, the steps a
schedule is made of (as JSON-able data, so that a failing schedule can be printed,
replayed and shrunk), and the seeded generator of random schedules.

The prompts are few and overlap on purpose (two share their first two chunks, one
repeats another's tokens in a second tenant, one uses an adapter, one other weights),
so that every invalidation selector (namespace, adapter, weights, prefix, and pairs of
them) covers some chunks and spares others, and hosts keep meeting on the same keys.
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


@cache
def prompt_keys(p: int) -> tuple[bytes, ...]:
    pr = PROMPTS[p]
    return tuple(bytes(k) for k in prompt_chunk_keys(pr.identity(), org(pr.ns), pr.tokens()))


def key_infos() -> dict[bytes, KeyInfo]:
    out: dict[bytes, KeyInfo] = {}
    for p, pr in enumerate(PROMPTS):
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
    "get",  # host, prompt, lossy: lookup and load at once
    "inv_local",  # host, crit: the store's own invalidate
    "inv_global",  # host (an in-process issuer), crit
    "revoke",  # host (issuer), target, ban_ms
    "expire",  # host: sleep past its lease
    "restart",  # host, clean: close (flush or not) and reopen
    "redis_restart",  # persist: with its data (SHUTDOWN SAVE) or empty
    "flushall",  # every key of every node gone
    "fault",  # host, fault, span: a partition or delays between that host and Redis
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

    @property
    def hosts(self) -> tuple[str, ...]:
        return self.in_process + self.served


WEIGHTS: dict[str, float] = {
    "put": 12,
    "begin": 4,
    "commit": 5,
    "abort": 0.5,
    "flush": 12,
    "lookup": 8,
    "load": 8,
    "get": 18,
    "inv_local": 2,
    "inv_global": 4,
    "inv_bad": 0.15,
    "revoke": 1.5,
    "expire": 0.7,
    "restart": 2,
    "redis_restart": 1.2,
    "flushall": 0.6,
    "fault": 3,
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
        kinds.pop("fault")
    if not cast.redis_restarts:
        kinds.pop("redis_restart")
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
        elif kind in ("lookup", "get"):
            steps.append(Step(kind, host, prompt, lossy=lossy))
        elif kind == "inv_local":
            steps.append(Step(kind, host, crit=random_criteria(rng)))
        elif kind in ("inv_global", "inv_bad"):
            bad = kind == "inv_bad"
            steps.append(Step("inv_global", issuer, crit=random_criteria(rng, bad)))
        elif kind == "revoke":
            ban = rng.choice([0, 0, 300, 1500])
            steps.append(Step(kind, issuer, target=host, ban_ms=ban))
        elif kind == "restart":
            if host in cast.served and rng.random() < 0.7:
                continue  # a server process takes a second or two to start: fewer
            steps.append(Step(kind, host, clean=rng.random() < 0.6))
        elif kind == "redis_restart":
            steps.append(Step(kind, persist=rng.random() < 0.5))
        elif kind == "flushall":
            steps.append(Step(kind))
        elif kind == "fault":
            f = rng.choice(["partition", "delay"])
            steps.append(Step(kind, host, fault=f, span=rng.randint(1, 8)))
    return steps

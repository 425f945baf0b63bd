"""The multi-host model's one adapter to kvlife: every call the model test makes on a
store, a served store or the global index is in this module, so that an API change is
one edit here and nowhere else.

The calls (docs/remote.md):

- in-process host: ``KVStore.open(path, tiers=(memory dram, [disk disk,] <shared kind>
  shared))``, ``put_prompt``, ``prepare_put``/``commit_put``/``abort_put``,
  ``lookup(accept=)`` then ``drain`` (the deletes a lookup's rules planned settle before
  the next step), ``load`` then ``drain`` (promotions settle), ``flush``, ``close(flush=)``;
- global invalidation, the public way: ``KVStore.invalidate(...)`` on a store whose chain
  has a shared tier records a rule in the index and applies it on this host before it
  returns (``IndexUnreachable``: applied here only); through ``kvlife serve``,
  ``RemoteStore.invalidate`` is the server store's. ``GlobalIndex.invalidate(...)`` (the
  shared tier's index, ``store.tier("shared").index``) records a rule without applying it
  on this host; it is how issue 29 found items 1-5, and how a rule reaches the index from
  somewhere that is no store;
- revocation: ``GlobalIndex.revoke(host, ban_ms)``;
- ``kvlife serve`` host: the server's own code (``kvlife.server.server.run``) in a
  process of its own, with a chain of [shm dram, shared] (``tests.remote.multihost_serve``:
  ``kvlife serve`` has no option for a shared tier), driven through
  ``kvlife.connect(socket)`` (``RemoteStore``: the same calls).

Whether a lookup read the index is told by the tier's own count of lookups that could
not (``details()["unreachable"]``, in-process hosts) or by a hit (a host that cannot
read the index answers none, docs/remote.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import kvlife
from kvlife.client.remote import RemoteStore
from kvlife.core.errors import KVLifeError
from kvlife.core.identity import ChunkKey, ModelIdentity, Namespace, NamespaceKind
from kvlife.globalindex import GlobalIndex
from kvlife.results import LookupResult
from kvlife.store import KVStore, TierSpec
from kvlife.tiers.redis.published import PublishedTier
from kvlife.transforms.contract import Accept

ROOT = Path(__file__).resolve().parents[2]
DRAM_BYTES = 8 << 20
DISK_BYTES = 16 << 20
SHARED_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class Criteria:
    """The selectors of one invalidation (they intersect); ``namespace`` is an
    organisation's name, ``raw_namespace`` a string passed as it is (a malformed rule)."""

    namespace: str | None = None
    adapter_id: str | None = None
    weights_digest: str | None = None
    prefix: bytes | None = None
    raw_namespace: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k in ("namespace", "adapter_id", "weights_digest", "raw_namespace"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        if self.prefix is not None:
            out["prefix"] = self.prefix.hex()
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Criteria:
        p = d.get("prefix")
        return cls(
            d.get("namespace"),
            d.get("adapter_id"),
            d.get("weights_digest"),
            bytes.fromhex(p) if p is not None else None,
            d.get("raw_namespace"),
        )

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``KVStore.invalidate`` / ``GlobalIndex.invalidate``."""
        out: dict[str, Any] = {}
        if self.namespace is not None:
            out["namespace"] = org(self.namespace)
        if self.raw_namespace is not None:
            out["namespace"] = self.raw_namespace
        if self.adapter_id is not None:
            out["adapter_id"] = self.adapter_id
        if self.weights_digest is not None:
            out["weights_digest"] = self.weights_digest
        if self.prefix is not None:
            out["prefix"] = ChunkKey(self.prefix)
        return out


def org(name: str) -> Namespace:
    return Namespace(NamespaceKind.ORGANISATION, name)


@dataclass(frozen=True, slots=True)
class SharedSpec:
    """How a host reaches the shared tier: a tier kind and its options."""

    kind: str
    """``redis`` or ``mooncake``."""
    options: tuple[tuple[str, object], ...]
    transform: str = ""
    """Transform the host's shared tier stores replicas with (``int8``: lossy)."""

    def tier(self) -> TierSpec:
        return TierSpec(
            self.kind, "shared", SHARED_BYTES, options=self.options, transform=self.transform
        )


@dataclass(slots=True)
class Hit:
    """One chunk a lookup answered: its key, tier and the representation it claims."""

    key: bytes
    tier: str
    transform: str
    exactness: str


@dataclass(slots=True)
class Looked:
    """A lookup's answer, kept for a later load on the same store incarnation."""

    hits: list[Hit]
    result: LookupResult
    incarnation: int
    read_index: bool
    """The lookup read the index (so the host's creation stamps are at least as new as
    the lookup's start); False where that is not known."""


class Host:
    """One host of the model: a store opened on demand, closed and reopened by the
    schedule. Subclasses say how (in-process ``KVStore`` or a ``kvlife serve`` process)."""

    def __init__(self, name: str, path: Path, shared: SharedSpec) -> None:
        self.name = name
        self.path = path
        self.shared = shared
        self.incarnation = 0
        self.pending: Any = None
        """A prepared put not committed yet (a ``PendingPut`` or ``RemotePendingPut``)."""
        self.store: KVStore | RemoteStore | None = None

    @property
    def is_open(self) -> bool:
        return self.store is not None

    def open(self) -> None:
        raise NotImplementedError

    def close(self, clean: bool) -> None:
        raise NotImplementedError

    @property
    def s(self) -> KVStore | RemoteStore:
        assert self.store is not None, f"host {self.name} is not open"
        return self.store

    def put(self, ident: ModelIdentity, ns: str, tokens: np.ndarray, kv: np.ndarray) -> int:
        return self.s.put_prompt(ident, org(ns), tokens, kv).stored

    def begin(self, ident: ModelIdentity, ns: str, tokens: np.ndarray, kv: np.ndarray) -> None:
        self.pending = self.s.prepare_put(ident, org(ns), tokens, kv)

    def commit(self) -> int:
        pending, self.pending = self.pending, None
        return self.s.commit_put(pending).stored

    def abort(self) -> None:
        pending, self.pending = self.pending, None
        self.s.abort_put(pending)

    def flush(self) -> int:
        return self.s.flush()

    def lookup(self, ident: ModelIdentity, ns: str, tokens: np.ndarray, lossy: bool) -> Looked:
        accept = Accept.lossy() if lossy else Accept.EXACT
        before = self.unreachable()
        res = self.s.lookup(ident, org(ns), tokens, accept=accept)
        self.s.drain()  # the deletes its rules planned are done before the next step
        after = self.unreachable()
        read = bool(res.hits) or (before is not None and after == before)
        hits = [Hit(bytes(h.key), str(h.tier), h.transform, h.exactness) for h in res.hits]
        return Looked(hits, res, self.incarnation, read)

    def unreachable(self) -> int | None:
        """Lookups so far that could not read the index (None: not known here)."""
        return None

    def load(self, looked: Looked) -> list[np.ndarray]:
        res = self.s.load(looked.result)
        arrays = [np.array(a, copy=True) for a in res.arrays[: res.loaded]]
        self.s.drain()  # promotions settle: the next step sees a settled store
        return arrays

    def invalidate(self, crit: Criteria) -> int:
        """``KVStore.invalidate``: a global rule, applied here before it returns."""
        return self.s.invalidate(**crit.kwargs())


class InProcessHost(Host):
    """A ``KVStore`` in this process with the chain [memory dram, shared], or with
    ``disk`` [memory dram, disk disk, shared]."""

    def __init__(self, name: str, path: Path, shared: SharedSpec, disk: bool = False) -> None:
        super().__init__(name, path, shared)
        self.disk = disk

    def open(self) -> None:
        chain = [TierSpec("memory", "dram", DRAM_BYTES)]
        if self.disk:
            chain.append(TierSpec("disk", "disk", DISK_BYTES))
        chain.append(self.shared.tier())
        self.store = KVStore.open(self.path, tiers=tuple(chain))
        self.incarnation += 1

    def close(self, clean: bool) -> None:
        store, self.store, self.pending = self.store, None, None
        if store is not None:
            store.close(flush=clean)

    def index(self) -> GlobalIndex:
        assert isinstance(self.store, KVStore), f"host {self.name} is not open"
        tier = self.store.tier("shared")
        assert isinstance(tier, PublishedTier), "the shared tier publishes under an index"
        return tier.index

    def unreachable(self) -> int | None:
        if not isinstance(self.store, KVStore):
            return None
        return int(self.store.tier("shared").details()["unreachable"])

    def record_rule(self, crit: Criteria) -> int:
        """``GlobalIndex.invalidate``: a rule recorded, applied nowhere yet (this host
        too applies it at its next lookup); returns its epoch."""
        return int(self.index().invalidate(**crit.kwargs()).epoch)

    def revoke(self, host_id: str, ban_ms: int) -> int:
        return int(self.index().revoke(host_id, ban_ms))


class ServedHost(Host):
    """A ``kvlife serve`` process (the server's own code, see
    ``tests.remote.multihost_serve``) with the chain [shm dram, shared], and this
    process's ``RemoteStore`` client of it."""

    def __init__(self, name: str, path: Path, shared: SharedSpec, shm_dir: Path) -> None:
        super().__init__(name, path, shared)
        self.shm_dir = shm_dir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def socket(self) -> Path:
        return self.path / "s.sock"

    def open(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()
        spec = {"kind": self.shared.kind, "options": list(self.shared.options)}
        spec["transform"] = self.shared.transform
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        log = (self.path / "serve.log").open("ab")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.remote.multihost_serve",
                str(self.path / "store"),
                str(self.socket),
                str(self.shm_dir),
                str(DRAM_BYTES),
                json.dumps(spec),
            ],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
        log.close()
        deadline = time.monotonic() + 60
        while not self.socket.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve host {self.name} exited: see {self.path}/serve.log")
            if time.monotonic() > deadline:
                raise RuntimeError(f"serve host {self.name} did not start")
            time.sleep(0.02)
        self.store = kvlife.connect(self.socket, timeout=30.0)
        self.incarnation += 1

    def close(self, clean: bool) -> None:
        store, self.store, self.pending = self.store, None, None
        if store is not None:
            with contextlib.suppress(KVLifeError, OSError):
                store.close()
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        # SIGTERM: the server flushes (publishes) and closes; SIGKILL: a crash
        os.kill(proc.pid, signal.SIGTERM if clean else signal.SIGKILL)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

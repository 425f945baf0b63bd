"""Redis as a shared remote tier behind the loopback fault proxy: time-outs, partitions,
and a host fenced while it publishes.

Host ``a`` stores through a :class:`~kvlife.faults.proxy.FaultProxy` in front of a real
``redis-server``; host ``b`` reads the same index directly. Each injection:

- ``remote-timeout``: the proxy delays every byte past the tier's socket time-out while
  ``a`` puts and loads; ``remote-partition``: the proxy swallows every byte. Calls fail
  typed or miss; nothing served is wrong; after the fault is lifted the time until
  ``a`` stores and serves again is its recovery time.
- ``fenced-publish``: ``a`` prepares a put, an admin revokes ``a``'s lease (a fenced,
  stale host), ``a`` commits: the publish must be refused and nothing of it visible to
  ``b``; once the ban ends ``a`` takes a new lease and publishes again.

Every chunk either host serves is checked against the oracle; every prompt ``a``
acknowledged must be served to ``b`` bit-exact (the shared tier is durable).
"""

from __future__ import annotations

import random
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from kvlife.core.errors import KVLifeError
from kvlife.experiments.campaign import oracle
from kvlife.experiments.campaign.tally import Campaign, KindTally
from kvlife.experiments.campaign.workload import Prompt, identity, make_prompt
from kvlife.faults.proxy import Fault, FaultProxy
from kvlife.store import KVStore, TierSpec
from kvlife.tiers.redis import RedisTier
from kvlife.tiers.redis.server import RedisServer

MiB = 1 << 20
TIMEOUT_S = 0.2
BAN_MS = 300


@dataclass(frozen=True, slots=True)
class Backend:
    """Where the shared tier lives: Redis alone, or a Mooncake master with its index on
    Redis (the proxy then stands in front of the index, where leases and publishes go)."""

    kind: str
    master: str = ""
    metadata: str = ""

    def store(
        self, path: Path, url: str, ns: str, host: str, timeout_s: float = TIMEOUT_S
    ) -> KVStore:
        common = (
            ("index_namespace", ns),
            ("host", host),
            ("socket_timeout_s", timeout_s),
            ("lease_ttl_ms", 5_000),
        )
        if self.kind == "redis":
            opts: tuple[tuple[str, object], ...] = (("url", url), *common)
        else:
            opts = (
                ("master", self.master),
                ("metadata", self.metadata),
                ("index", url),
                ("segment_bytes", 64 * MiB),
                *common,
            )
        spec = TierSpec(self.kind, "shared", 256 * MiB, options=opts)
        return KVStore.open(path, tiers=(spec,))


def _served(store: KVStore, p: Prompt, t: KindTally) -> int:
    """Load ``p`` from ``store``, check it; the chunks served (0 on a typed failure)."""
    try:
        res = store.get(identity(), p.namespace, p.tokens)
    except KVLifeError:
        t.typed_errors += 1
        return 0
    t.served(oracle.check(p.keys, res.arrays))
    return res.loaded


def _put(store: KVStore, p: Prompt) -> bool:
    try:
        store.put_prompt(identity(), p.namespace, p.tokens, p.kv())
        return True
    except KVLifeError:
        return False


def _until_back(store: KVStore, p: Prompt, t: KindTally, limit_s: float = 20.0) -> float:
    """Seconds until ``store`` stores and serves ``p`` again."""
    started = time.perf_counter()
    while time.perf_counter() - started < limit_s:
        if _put(store, p) and _served(store, p, t) == len(p.keys):
            return time.perf_counter() - started
        time.sleep(0.02)
    t.note("did not come back within the limit")
    return time.perf_counter() - started


def run(root: Path, seed: int, n: int, campaign: Campaign, backend: str = "redis") -> None:
    """``n`` injections of each remote kind against a real redis-server (and, for
    ``mooncake``, a real Mooncake master: only inside a private network namespace)."""
    if shutil.which("redis-server") is None:
        campaign.skipped.append("redis: redis-server is not installed")
        return
    root.mkdir(parents=True, exist_ok=True)
    server = RedisServer(root).start()
    master = None
    try:
        if backend == "mooncake":
            from kvlife.tiers.mooncake.server import MooncakeMaster

            master = MooncakeMaster(root).start()
            b = Backend("mooncake", master.master, master.metadata)
        else:
            b = Backend("redis")
        _campaign(root, seed, n, campaign, server, b)
    finally:
        if master is not None:
            master.stop()
        server.stop()


def _campaign(
    root: Path, seed: int, n: int, campaign: Campaign, server: RedisServer, backend: Backend
) -> None:
    rng = random.Random(seed)
    dep = backend.kind
    ns = "f" + uuid.uuid4().hex[:10]
    acked: list[Prompt] = []
    number = 10_000
    with FaultProxy(("127.0.0.1", server.port)) as proxy:
        a = backend.store(root / "a", f"redis://127.0.0.1:{proxy.port}/0", ns, "a")
        # b and admin are not behind the proxy: a generous time-out, so that a loaded
        # machine's slow reply is not mistaken for a chunk gone
        b = backend.store(root / "b", server.url, ns, "b", timeout_s=5.0)
        admin = backend.store(root / "admin", server.url, ns, "admin", timeout_s=5.0)
        try:
            kinds = ["remote-timeout", "remote-partition", "fenced-publish"] * n
            rng.shuffle(kinds)
            for kind in kinds:
                t = campaign.tally(kind, dep)
                number += 1
                p = make_prompt(seed, number, shared_prefix=False)
                if kind == "fenced-publish":
                    pending = a.prepare_put(identity(), p.namespace, p.tokens, p.kv())
                    # both shared kinds keep their leases in the same global index
                    index = cast(RedisTier, admin.tier("shared")).index
                    index.revoke("a", ban_ms=BAN_MS)
                    t.injections += 1
                    try:
                        res = a.commit_put(pending)
                        refused = res.stored == 0
                    except KVLifeError:
                        refused = True
                        t.typed_errors += 1
                    t.detections += int(refused)
                    if _served(b, p, t):
                        t.stale_served += 1
                        t.note("a fenced host's publish became visible")
                    time.sleep(BAN_MS / 1000)
                else:
                    proxy.set(
                        Fault.delay(TIMEOUT_S * 5)
                        if kind == "remote-timeout"
                        else Fault.partition()
                    )
                    t.injections += 1
                    ok = _put(a, p)
                    _served(a, p, t)
                    if not ok:
                        t.detections += 1
                        t.typed_errors += 1
                    proxy.set(Fault.none())
                nxt = make_prompt(seed, number + 500_000, shared_prefix=False)
                t.recovery_s.append(_until_back(a, nxt, t))
                acked.append(nxt)
                # the shared tier is durable: what a acknowledged, b serves
                for q in rng.sample(acked, min(3, len(acked))):
                    got = _served(b, q, t)
                    for _ in range(20):  # a read that failed (time-out, back-off) is no loss
                        if got == len(q.keys):
                            break
                        time.sleep(0.1)
                        got = _served(b, q, t)
                    if got < len(q.keys):
                        t.acked_lost += len(q.keys) - got
                        t.note("an acknowledged put is missing from the shared tier")
        finally:
            for s in (a, b, admin):
                s.close()


def run_mooncake(root: Path, seed: int, n: int, campaign: Campaign) -> None:
    """The remote kinds against Mooncake, in a private network namespace (Mooncake binds
    every interface): this module run there as a child, its tallies read back."""
    import json
    import os
    import subprocess
    import sys

    from kvlife.experiments.campaign.tally import KindTally
    from kvlife.tiers.mooncake.server import netns_command

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        campaign.skipped.append("mooncake: a private network namespace needs root and unshare")
        return
    root.mkdir(parents=True, exist_ok=True)
    out = root / "mooncake.json"
    cmd = [sys.executable, "-m", "kvlife.experiments.campaign.remote", str(root), str(seed), str(n)]
    proc = subprocess.run(
        netns_command([*cmd, str(out)]), capture_output=True, text=True, timeout=3600
    )
    if proc.returncode != 0 or not out.exists():
        campaign.skipped.append(f"mooncake: the namespace child failed: {proc.stderr[-400:]}")
        return
    for d in json.loads(out.read_text()):
        t = KindTally(d["kind"], d["deployment"], d["system"])
        for k, v in d.items():
            if k not in ("kind", "deployment", "system", "recovery_s", "recovery"):
                setattr(t, k, v)
        t.recovery_s = list(d["recovery"])
        campaign.add(t)


def _main(argv: list[str]) -> int:
    """``python -m kvlife.experiments.campaign.remote ROOT SEED N OUT`` (inside the namespace)."""
    import json

    root, seed, n, out = Path(argv[0]), int(argv[1]), int(argv[2]), Path(argv[3])
    campaign = Campaign(seed, False)
    run(root / "inside", seed, n, campaign, backend="mooncake")
    tallies = [t.to_json() | {"recovery": t.recovery_s} for t in campaign.tallies.values()]
    out.write_text(json.dumps(tallies))
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(_main(sys.argv[1:]))

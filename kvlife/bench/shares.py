"""``kvlife bench shares``: victims per second of :class:`~kvlife.policy.shares.TenantShares`
with many tenants (issue 24, quotas: the store and the replay simulator ask it for every
victim, and with 1,400 derived organisations the scan of every tenant per victim held a
replay to 3.4k touches/s).

Every tenant holds its share (``--keys`` keys of one unit each); then, ``--victims``
times, a put of one key of a tenant chosen at random asks for room first, as the
placement engine does (``evict_up_to(1, protected={the new key})``: the key is not
resident yet, so it counts as that tenant's incoming units), and is inserted. Each victim
is the putting tenant's own least recently used key (it is the only tenant over its
share). The figure is victims per second, the best of ``--rounds`` runs, with the
machine's Python loop speed beside it (:func:`kvlife.bench.limits.machine_figures`).
Indicative on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from kvlife.bench.limits import machine_figures
from kvlife.policy.shares import TenantShares


def _tenant(key: tuple[int, int]) -> int:
    return key[0]


def victims_per_second(tenants: int, keys: int, victims: int, seed: int = 0) -> float:
    """One run: ``tenants`` at their share of ``keys``, then ``victims`` puts."""
    policy: TenantShares[tuple[int, int], int] = TenantShares(
        _tenant, dict.fromkeys(range(tenants), keys)
    )
    for t in range(tenants):
        for i in range(keys):
            policy.insert((t, i))
    rng = random.Random(seed)
    order = [rng.randrange(tenants) for _ in range(victims)]
    serial = keys
    t0 = time.perf_counter()
    for t in order:
        key = (t, serial)
        serial += 1
        got = policy.evict_up_to(1, (key,))
        if len(got) != 1 or got[0][0] != t:
            raise AssertionError(f"a put of tenant {t} evicted {got}, not its own key")
        policy.insert(key)
    return victims / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvlife bench shares", description=__doc__)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--tenants", type=int, default=1000, help="tenants, each at its share")
    p.add_argument("--keys", type=int, default=8, help="keys (its share) per tenant")
    p.add_argument("--victims", type=int, default=20000, help="puts, one victim each")
    p.add_argument("--rounds", type=int, default=3, help="runs; the best is reported")
    p.add_argument("--quick", action="store_true", help="a small run (shape only)")
    args = p.parse_args(argv)
    victims, rounds = (500, 1) if args.quick else (args.victims, args.rounds)
    with tempfile.TemporaryDirectory(prefix="kvlife-bench-shares-") as d:
        machine = machine_figures(Path(d), quick=True)
    runs = [victims_per_second(args.tenants, args.keys, victims, seed) for seed in range(rounds)]
    out: dict[str, Any] = {
        "tenants": args.tenants,
        "keys_per_tenant": args.keys,
        "victims": victims,
        "rounds": rounds,
        "victims_per_s": max(runs),
        "runs_victims_per_s": runs,
        "machine": machine,
    }
    text = json.dumps(out, indent=2)
    if args.json is not None:
        args.json.write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0

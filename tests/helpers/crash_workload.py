"""The crash tests' writer: puts the deterministic workload into a store until SIGKILLed.

Run by the crash harness (:mod:`kvlife.faults.crash`) as
``python -m kvlife.faults.crash_child tests.helpers.crash_workload:run PATH LOG --seed S
--first N --shape churn`` with the repository root on ``PYTHONPATH``. It opens the store
with ``write_through=True`` (so a put that returned is durable) and puts prompts
``N, N+1, ...`` forever, invalidating a namespace now and then when the shape says so.
It appends to ``LOG`` (an :class:`~kvlife.faults.crash.AckLog`: a SIGKILL loses none of
its lines) and fsyncs the log before it acknowledges anything:

    start                          about to open the store (logged by the child program)
    ready                          the store is open (recovery done)
    gone <key hex>                 the store dropped the key's disk replica or the object
                                   (eviction, invalidation), written as the event is emitted
    nd <key hex>                   after the put that follows, the key has no disk replica
                                   (it was already present, held in DRAM only)
    put <n> <evictions> <compaction_bytes> <segments_reclaimed>
                                   put of prompt n returned (plus this session's counters)
    inv <n> <namespace>            invalidate(namespace) returned, right after put n

Only one put or invalidation is in flight at any moment, so after a kill the store may
differ from what the log says only by that operation's effects.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvlife.faults.crash import AckLog, DropLogSink
from tests.helpers.workload import SHAPES, disk_of, invalidation_after, make_prompt, put


def run(path: Path, log: AckLog, argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seed", type=int, required=True, help="workload seed")
    ap.add_argument("--first", type=int, required=True, help="first prompt number to put")
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True, help="tier sizes")
    args = ap.parse_args(argv)
    shape = SHAPES[args.shape]
    store = shape.open(path, sink=DropLogSink(log, tier="disk"))
    disk = disk_of(store)
    assert disk is not None
    log.ack("ready")
    n = args.first
    while True:
        prompt = make_prompt(args.seed, n)
        put(store, prompt)
        for key in prompt.keys:
            if not disk.contains(key):
                log.line(f"nd {key.hex()}")
        log.ack(
            f"put {n} {store.counters.tier('disk').evictions} "
            f"{disk.stats.compaction_bytes_written} {disk.stats.segments_reclaimed}"
        )
        ns = invalidation_after(args.seed, n, shape.invalidate_prob)
        if ns is not None:
            store.invalidate(namespace=ns)
            log.ack(f"inv {n} {ns}")
        n += 1


def idle(path: Path, log: AckLog, argv: list[str]) -> None:
    """A child that opens nothing, logs ``ready`` and waits to be killed (harness tests)."""
    log.ack("ready")
    while True:
        time.sleep(1.0)


def exit_early(path: Path, log: AckLog, argv: list[str]) -> None:
    """A child that returns at once: the harness must report it (harness tests)."""

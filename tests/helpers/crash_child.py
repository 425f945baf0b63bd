"""Crash child: puts the deterministic workload into a store until it is SIGKILLed.

Run as ``python -m tests.helpers.crash_child PATH LOG --seed S --first N --shape churn``
with the repository root on ``PYTHONPATH``. It opens the store with
``write_through=True`` (so a put that returned is durable) and puts prompts
``N, N+1, ...`` forever, invalidating a namespace now and then when the shape says so.
It appends to ``LOG`` with unbuffered writes (a SIGKILL loses none of them), and fsyncs
the log before it acknowledges anything:

    start                          about to open the store
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
import os
from pathlib import Path

from kvlife.core.events import EventSink, LifecycleEvent
from kvlife.core.lifecycle import Move
from tests.helpers.workload import SHAPES, disk_of, invalidation_after, make_prompt, put


class Log:
    """Append-only log written straight to the kernel (no user-space buffer)."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def line(self, text: str) -> None:
        os.write(self._fd, (text + "\n").encode())

    def ack(self, text: str) -> None:
        self.line(text)
        os.fsync(self._fd)


class GoneSink(EventSink):
    """Logs every key whose disk replica (or whole object) the store drops."""

    def __init__(self, log: Log) -> None:
        self._log = log

    def emit(self, event: LifecycleEvent) -> None:
        if event.kind == Move.DELETE.value or (
            event.kind == Move.EVICT.value and event.tier == "disk"
        ):
            self._log.line(f"gone {event.key}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("path", type=Path, help="store directory")
    ap.add_argument("log", type=Path, help="acknowledgement log (appended)")
    ap.add_argument("--seed", type=int, required=True, help="workload seed")
    ap.add_argument("--first", type=int, required=True, help="first prompt number to put")
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True, help="tier sizes")
    args = ap.parse_args(argv)
    shape = SHAPES[args.shape]
    log = Log(args.log)
    log.ack("start")
    store = shape.open(args.path, sink=GoneSink(log))
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


if __name__ == "__main__":
    main()

"""Probes for ``kvlife bench stages``: the entry and exit time of named functions on the
served data path, recorded in the process that runs them, so that one served call can
be laid out stage by stage (issue 28: where a served load's or put's time goes).

A probe replaces a function (a module's, or a class's method) by a wrapper that stamps
``time.perf_counter()`` before and after the call (CLOCK_MONOTONIC on Linux: the same
clock in the client and the server process). The product code carries no stamps of its
own; the probes are installed only in processes ``kvlife bench stages`` starts (the
server through ``python -m kvlife.bench.stage_probes OUT serve ...``) and in its own
client. Each wrapper costs about a microsecond a call (more on a cold cache), which the
stages carry.

A probe names the module where its function is *looked up* at call time (a name
imported with ``from ... import`` into another module is probed there). Every probe
must resolve: :func:`install` raises :class:`ProbeMissing` for one that does not (a
renamed function), so the bench never reports a stage silently absent.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import pickle
import runpy
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_RECORDS = 2_000_000
"""Records a process keeps at most (a long run keeps its first ones)."""


class ProbeMissing(RuntimeError):
    """A probe names a function that does not exist (renamed or moved)."""


@dataclass(frozen=True, slots=True)
class Probe:
    module: str
    qualname: str
    """``function`` or ``Class.method`` in :attr:`module`."""
    label: str
    """The stage's name in the report."""


Record = tuple[str, float, float, int]
"""(label, entered, returned, thread id): seconds of ``time.perf_counter``."""


SERVER_PROBES: tuple[Probe, ...] = (
    Probe("kvlife.server.reader", "FrameReader.next", "frame read"),
    Probe("kvlife.server.protocol", "decode_request", "request decoded"),
    Probe("kvlife.server.session", "Session.handle", "verb handled"),
    Probe("kvlife.server.loads", "Loads.release", "grant released"),
    Probe("kvlife.server.loads", "Loads._lookup_of", "hit records"),
    Probe("kvlife.server.loads", "Loads._into", "load into shared buffers"),
    Probe("kvlife.server.loads", "Loads._granted", "load by grant"),
    Probe("kvlife.store.reads", "Reader.load_async", "store load_async"),
    Probe("kvlife.store.frame_loads", "start", "frame load started"),
    Probe("kvlife.native.frames", "start_direct", "native frame reads started"),
    Probe("kvlife.store.frame_loads", "FrameLoad.chunk", "frame load: chunk checked"),
    Probe("kvlife.store.frame_loads", "FrameLoad._publish", "frame load published"),
    Probe("kvlife.store.reads", "_Feed._pipeline", "run on the I/O pool"),
    Probe("kvlife.tiers.disk.reader", "Reader.read_pipelined", "disk tier's run"),
    Probe("kvlife.native.frames", "read_run", "native reads"),
    Probe("kvlife.store.reads", "LoadHandle._complete", "chunk verified"),
    Probe("kvlife.store.reads", "Reader.publish", "load published"),
    Probe("kvlife.server.puts", "Puts.put", "put prepared"),
    Probe("kvlife.server.puts", "Puts._stage", "extents staged"),
    Probe("kvlife.server.puts", "Puts.put_written", "put_written"),
    Probe("kvlife.server.puts", "_hash_written", "hashed"),
    Probe("kvlife.server.puts", "Puts.put_commit", "put_commit"),
    Probe("kvlife.store.facade", "KVStore.commit_put", "store commit"),
    Probe("kvlife.server.protocol", "ok_reply", "reply packed"),
)
"""The server's stages, in the order a call meets them."""

CLIENT_PROBES: tuple[Probe, ...] = (
    Probe("kvlife.client.loads", "Loads._targets", "client: shared-buffer targets"),
    Probe("kvlife.server.protocol", "pack", "client: frame packed"),
    Probe("kvlife.server.protocol", "recv_frame", "client: reply frame"),
)
"""The client's stages (the bench's own process)."""


class Recorder:
    """The records of one process (appends are atomic under the interpreter lock)."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self._originals: list[tuple[object, str, object]] = []

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        records = self.records
        clock = time.perf_counter
        ident = threading.get_ident

        @functools.wraps(fn)
        def probed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                if len(records) < MAX_RECORDS:
                    records.append((label, t0, clock(), ident()))

        return probed

    def install(self, probes: Sequence[Probe]) -> None:
        """Replace every probe's function by its wrapper (ProbeMissing, nothing
        installed, if one does not resolve)."""
        found = [(*_resolve(p), p.label) for p in probes]
        for owner, name, fn, label in found:
            self._originals.append((owner, name, owner.__dict__[name]))
            setattr(owner, name, self.wrap(label, fn))

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals.clear()

    def dump(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(pickle.dumps(self.records))
        tmp.replace(path)


def _resolve(probe: Probe) -> tuple[Any, str, Callable[..., Any]]:
    try:
        owner: Any = importlib.import_module(probe.module)
        *path, name = probe.qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        fn = owner.__dict__[name]
    except (ImportError, AttributeError, KeyError):
        raise ProbeMissing(
            f"stage probe {probe.module}:{probe.qualname} ({probe.label!r}) does not resolve"
        ) from None
    if not callable(fn):
        raise ProbeMissing(f"stage probe {probe.module}:{probe.qualname} is not a function")
    return owner, name, fn


def read_records(path: Path) -> list[Record]:
    records: list[Record] = pickle.loads(path.read_bytes())
    return records


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvlife.bench.stage_probes OUT serve ARGS...``: ``kvlife serve`` with
    the server's probes installed; the records are written to OUT when it exits."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[1] != "serve":
        print("usage: python -m kvlife.bench.stage_probes OUT serve ARGS...", file=sys.stderr)
        return 2
    out = Path(args[0])
    recorder = Recorder()
    recorder.install(SERVER_PROBES)
    atexit.register(recorder.dump, out)
    # the command line run as a program in this process (as ``python -m kvlife.cli``
    # would run it), not imported: a benchmark sits below the command line's layer
    sys.argv = ["kvlife", *args[1:]]
    runpy.run_module("kvlife.cli", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

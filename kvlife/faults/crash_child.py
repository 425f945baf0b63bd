"""The crash child program: ``python -m kvlife.faults.crash_child MODULE:FUNCTION STORE LOG ...``.

It opens ``LOG`` as an :class:`~kvlife.faults.crash.AckLog`, acknowledges ``start``, and
calls ``MODULE.FUNCTION(store, log, args)`` (a :data:`CrashWorkload`) with the store
directory and the arguments after ``LOG``. The workload is expected to log ``ready``
once the store is open and then to run until the parent kills the process; if it returns
the child exits 0 (which a crash test reports as a child that ended by itself).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path

from kvlife.faults.crash import AckLog

CrashWorkload = Callable[[Path, AckLog, list[str]], None]
"""What a crash child runs: ``(store directory, acknowledgement log, arguments)``."""


def resolve(name: str) -> CrashWorkload:
    """The function named ``"module:function"``."""
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise SystemExit(f"crash_child: workload {name!r} is not MODULE:FUNCTION")
    fn = getattr(importlib.import_module(module_name), attr, None)
    if not callable(fn):
        raise SystemExit(f"crash_child: {module_name} has no function {attr}")
    workload: CrashWorkload = fn
    return workload


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 3:
        raise SystemExit(__doc__)
    workload = resolve(args[0])
    log = AckLog(Path(args[2]))
    log.ack("start")
    workload(Path(args[1]), log, args[3:])


if __name__ == "__main__":
    main()

"""What the attacks on the streaming copy share (tests/attack/test_stream_copy_attack.py,
test_stream_copy_strided_attack.py): the extension as copies.py sees it with its
streamed copies counted, a file's mapping, the verbs a client sends, and a child
process that must finish."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import tempfile
from typing import Any

import pytest

from kvlife.native import frames
from kvlife.server import protocol
from tests.server.conftest import ROOT, child_env

needs_native = pytest.mark.skipif(not frames.available(), reason="no C extension built")


class Counting:
    """The extension, its ``stream_copy`` calls counted (every other name delegated):
    ``calls`` the bytes of each streamed copy, ``contiguous`` whether its source was
    C-contiguous, ``refused`` the calls it answered False."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.calls: list[int] = []
        self.contiguous: list[bool] = []
        self.refused = 0

    def stream_copy(self, dst: Any, src: Any) -> bool:
        streamed = bool(self.module.stream_copy(dst, src))
        if streamed:
            self.calls.append(int(dst.nbytes))
            self.contiguous.append(bool(src.flags.c_contiguous))
        else:
            self.refused += 1
        return streamed

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)


def counted() -> Any:
    """A fixture for a test module to bind as ``counting``: the extension as copies.py
    sees it, a :class:`Counting` of the copies it streams (skipped without it)."""

    @pytest.fixture
    def counting_fixture(monkeypatch: pytest.MonkeyPatch) -> Counting:
        module = frames.native_module()
        if module is None:
            pytest.skip("no C extension built")
        wrapper = Counting(module)
        monkeypatch.setattr(frames, "native_module", lambda: wrapper)
        return wrapper

    return counting_fixture


def file_mmap(nbytes: int, access: int = mmap.ACCESS_WRITE) -> mmap.mmap:
    """A mapping of a fresh file of ``nbytes`` zero bytes (the file already unlinked)."""
    fd, path = tempfile.mkstemp(prefix="stream-copy-")
    try:
        os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes, access=access)
    finally:
        os.close(fd)
        os.unlink(path)


def sent_verbs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The verbs this process's clients send, in order, from now on."""
    sent: list[str] = []
    pack = protocol.pack

    def spy(msg: object) -> bytes:
        if isinstance(msg, list) and len(msg) > 1 and isinstance(msg[1], str):
            sent.append(msg[1])
        return pack(msg)

    monkeypatch.setattr(protocol, "pack", spy)
    return sent


def child_finishes(script: str, *args: str, native: bool = True, timeout: float = 60) -> str:
    """Run ``script`` in a child Python (a crash there would take pytest down) and
    assert it exits 0 having printed ``done``; returns its output. ``native=False``:
    the child runs with the extension switched off (``KVLIFE_NATIVE=0``)."""
    env = child_env()
    if not native:
        env["KVLIFE_NATIVE"] = "0"
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0 and "done" in proc.stdout, (
        f"{args}: exit {proc.returncode}\n{proc.stdout[-1000:]}\n{proc.stderr[-3000:]}"
    )
    return proc.stdout

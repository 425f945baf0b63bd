"""Attacks on ``kvlife serve --config``: a file that ``kvlife config check`` passes but
names places the server cannot use (the store path is a file, the socket's or the pid
file's folder does not exist, an unusable KV-events endpoint) must stop the server with
a typed error naming what was wrong, before it listens, and leave nothing behind: no
store created, no socket file, no arena (a half-started server leaves a socket that the
next client connects to in vain, and a fresh empty store where the operator expected
their own). Also what held: each malformed or mistyped file is refused by path and line.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.conftest import ROOT, child_env

TIERS = """
[[tiers]]
name = "dram"
kind = "memory"
budget = "1MiB"

[[tiers]]
name = "ssd"
kind = "disk"
budget = "4MiB"

[tiers.options]
segment_bytes = "1MiB"
direct_io = false
"""


def _serve(tmp: Path, text: str) -> subprocess.CompletedProcess[str]:
    (tmp / "c.toml").write_text(text)
    return subprocess.run(
        [sys.executable, "-m", "kvlife.cli", "serve", "--config", str(tmp / "c.toml")],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def _left(tmp: Path) -> list[str]:
    return sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.name != "c.toml")


def _server(tmp: Path, **extra: str) -> str:
    shm = tmp / "shm"
    shm.mkdir()
    lines = [f'socket = "{extra.pop("socket", "kv.sock")}"', f'shm_dir = "{shm}"']
    lines += [f'{k} = "{v}"' for k, v in extra.items()]
    return "[server]\n" + "\n".join(lines) + "\n"


CASES = {
    # the pid file's folder is missing: the server was listening when writing it failed
    "pid file folder missing": lambda t: (
        '[store]\npath = "s"\n' + _server(t, pid_file="nodir/kv.pid") + TIERS
    ),
    # the store path is an existing file: a raw FileExistsError before
    "store path is a file": lambda t: '[store]\npath = "c.toml"\n' + _server(t) + TIERS,
    # the socket's folder is missing: a fresh store was created and left behind
    "socket folder missing": lambda t: (
        '[store]\npath = "s"\n' + _server(t, socket="nodir/kv.sock") + TIERS
    ),
    # a KV-events endpoint that cannot be opened: the store folder was left behind
    "kv events endpoint unusable": lambda t: (
        '[store]\npath = "s"\n'
        + _server(t)
        + '[server.kv_events]\nendpoint = "tcp://999.1.1.1:*"\n'
        + TIERS
    ),
    # a first tier larger than the shared-memory filesystem: the mapping failed after
    # the store folder (and its lock file) was made
    "arena larger than shm": lambda t: (
        '[store]\npath = "s"\n'
        + _server(t)
        + '[[tiers]]\nname = "dram"\nkind = "memory"\nbudget = "100000TiB"\n'
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_place_in_the_file_stops_serve_typed_leaving_nothing(
    tmp_path: Path, case: str
) -> None:
    done = _serve(tmp_path, CASES[case](tmp_path))
    assert done.returncode != 0
    # a typed error (the CLI's one line), never a traceback
    assert "Traceback" not in done.stderr, done.stderr
    assert "kvlife: error:" in done.stderr, done.stderr
    assert _left(tmp_path) == ["shm"], (case, _left(tmp_path), done.stderr)


TIER = '[[tiers]]\nname = "d"\nkind = "memory"\n'
MEM = '[store]\npath = "s"\n' + TIER
"""A file whose first tier's budget follows on line 6."""

BAD_FILES = {
    "not toml": ("[store\npath = 1\n", 1),
    "negative budget": (MEM + "budget = -5\n", 6),
    "float budget": (MEM + "budget = 1.5e9\n", 6),
    "bool budget": (MEM + "budget = true\n", 6),
    "nan budget": (MEM + "budget = nan\n", 6),
    "duplicate tier": (MEM + "budget = 1024\n" + TIER + "budget = 1024\n", 8),
    "unknown key": ('[store]\npath = "s"\nbogus = 1\n' + TIER + "budget = 1024\n", 3),
    "first tier on disk": (
        '[store]\npath = "s"\n[server]\n[[tiers]]\nname = "d"\nkind = "disk"\nbudget = "64MiB"\n',
        6,
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_held_a_bad_file_is_refused_by_line_and_nothing_is_made(tmp_path: Path, case: str) -> None:
    text, line = BAD_FILES[case]
    done = _serve(tmp_path, text)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    assert f"c.toml:{line}:" in done.stderr, done.stderr
    assert _left(tmp_path) == [], _left(tmp_path)


def _check(tmp: Path, text: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    (tmp / "c.toml").write_text(text)
    return subprocess.run(
        [sys.executable, "-m", "kvlife.cli", "config", "check", str(tmp / "c.toml")],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("name", ["../escape", "a/b", "..", "/abs"])
def test_a_tier_name_that_is_a_path_is_refused_and_nothing_is_written_outside(
    tmp_path: Path, name: str
) -> None:
    """A disk tier keeps its files in a folder of the store named after the tier: the
    name ``../escape`` put its segments and catalog beside the store, outside it (and
    ``/abs`` anywhere), and ``config check`` passed the file."""
    text = (
        '[store]\npath = "s"\n[[tiers]]\nname = "dram"\nkind = "memory"\nbudget = "1MiB"\n'
        f'[[tiers]]\nname = "{name}"\nkind = "disk"\nbudget = "64MiB"\n'
        "[tiers.options]\ndirect_io = false\n"
    )
    done = _check(tmp_path, text)
    assert done.returncode == 1, done.stderr
    assert "c.toml:8: tiers[1].name" in done.stderr, done.stderr
    from kvlife.core.errors import InvalidArgument
    from kvlife.tiers.spec import TierSpec

    with pytest.raises(InvalidArgument, match="tier name"):
        TierSpec("disk", name, 64 << 20)
    assert _left(tmp_path) == []


def test_a_cpu_range_beyond_any_machine_is_refused_at_once(tmp_path: Path) -> None:
    """``cpus = "0-99999999"`` built a set of a hundred million ints: ``config check``
    (and ``serve``) ran for minutes and gigabytes instead of naming the bad range."""
    text = (
        '[store]\npath = "s"\n[server]\ncpus = "0-99999999"\n'
        '[[tiers]]\nname = "dram"\nkind = "memory"\nbudget = "1MiB"\n'
    )
    done = _check(tmp_path, text, timeout=20)
    assert done.returncode == 1, done.stderr
    assert "c.toml:4: server.cpus" in done.stderr, done.stderr

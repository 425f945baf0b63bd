"""``kvlife config check``: every error of a file is reported, each with its path and the
line it was written on (a missing key: its table's line), and a file with errors gives
no configuration."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.ops.config import check_file
from kvlife.ops.config.lines import line_index
from kvlife.ops.config.parse import parse_text
from kvlife.planner import PrefillProfile
from tests.server.conftest import ROOT, child_env

BASE = """\
[store]
path = "store"
io_threads = 2

[[tiers]]
name = "dram"
kind = "memory"
budget = "64MiB"
policy = "lru"

[[tiers]]
name = "ssd"
kind = "disk"
budget = "1GiB"
policy = "s3fifo"
transform = "int8"
durability = "write-through"

[tiers.options]
segment_bytes = "64MiB"
io_depth = 4

[server]
socket = "kv.sock"
staging_bytes = "16MiB"
cpus = "0"
metrics = ":0"
log_json = true
gc_whole_every_s = 300

[server.limits]
max_connections = 64
body_timeout_s = 10.0

[server.principals.alice]
uids = [1000]
organisation = "acme"

[server.kv_events]
endpoint = "tcp://127.0.0.1:*"
topic = "kv"

[quotas]
"user:alice" = { dram = "16MiB", ssd = "256MiB" }
public = { dram = "8MiB" }

[vllm]
chunk_tokens = 64
namespace = "organisation:acme"
"""

LINES = BASE.splitlines()


def line_no(text: str) -> int:
    return LINES.index(text) + 1


# (the line as written, the line made wrong, the path reported); each on its own line
MUTATIONS = [
    ('path = "store"', "path = 3", "store.path"),
    ("io_threads = 2", "io_threads = 0", "store.io_threads"),
    ('kind = "memory"', 'kind = "tape"', "tiers[0].kind"),
    ('budget = "64MiB"', 'budget = "64 potatoes"', "tiers[0].budget"),
    ('policy = "lru"', 'policy = "random"', "tiers[0].policy"),
    ('name = "ssd"', 'name = "dram"', "tiers[1].name"),
    ('budget = "1GiB"', "budget = 0", "tiers[1].budget"),
    ('transform = "int8"', 'transform = "int3"', "tiers[1].transform"),
    ('durability = "write-through"', 'durability = "forever"', "tiers[1].durability"),
    ('segment_bytes = "64MiB"', "segment_bytes = 1000", "tiers[1].options.segment_bytes"),
    ("io_depth = 4", "io_depth = true", "tiers[1].options.io_depth"),
    ('socket = "kv.sock"', "socket = []", "server.socket"),
    ('staging_bytes = "16MiB"', 'staging_bytes = "lots"', "server.staging_bytes"),
    ('cpus = "0"', 'cpus = "x-y"', "server.cpus"),
    ('metrics = ":0"', 'metrics = "127.0.0.1:http"', "server.metrics"),
    ("log_json = true", 'log_json = "yes"', "server.log_json"),
    ("gc_whole_every_s = 300", "gc_whole_every_s = -1", "server.gc_whole_every_s"),
    ("max_connections = 64", "max_connections = -1", "server.limits.max_connections"),
    ("body_timeout_s = 10.0", 'body_timeout_s = "soon"', "server.limits.body_timeout_s"),
    ('organisation = "acme"', 'organisation = "a b"', "server.principals.alice.organisation"),
    ('endpoint = "tcp://127.0.0.1:*"', 'endpoint = "http://x"', "server.kv_events.endpoint"),
    ('topic = "kv"', "topic = 1", "server.kv_events.topic"),
    ('public = { dram = "8MiB" }', 'public = { tape = "8MiB" }', "quotas.public.tape"),
    ("chunk_tokens = 64", "chunk_tokens = 0", "vllm.chunk_tokens"),
    ('namespace = "organisation:acme"', 'namespace = "team:x"', "vllm.namespace"),
]


RENAME = next(i for i, m in enumerate(MUTATIONS) if m[2] == "tiers[1].name")


def mutate(chosen: list[int]) -> tuple[str, set[tuple[str, int]]]:
    lines = list(LINES)
    expected = set()
    for i in chosen:
        good, bad, path = MUTATIONS[i]
        at = LINES.index(good)
        lines[at] = bad
        expected.add((path, at + 1))
    return "\n".join(lines) + "\n", expected


def issues_of(text: str, tmp: Path) -> set[tuple[str, int]]:
    config, issues = parse_text(text, tmp / "kvlife.toml")
    assert (config is None) == bool(issues)
    return {(i.path, i.line) for i in issues}


def test_the_base_file_is_valid(tmp_path: Path) -> None:
    config, issues = parse_text(BASE, tmp_path / "kvlife.toml")
    assert issues == [] and config is not None
    assert [t.name for t in config.store.chain] == ["dram", "ssd"]
    assert config.store.write_through and config.store.chain[1].transform == "int8"
    assert config.server is not None and config.server.limits.max_connections == 64
    assert config.connector_extra() == {
        "kvlife.chunk_tokens": 64,
        "kvlife.namespace": "organisation:acme",
    }


def test_each_error_alone(tmp_path: Path) -> None:
    for i, (_, _, path) in enumerate(MUTATIONS):
        text, expected = mutate([i])
        got = issues_of(text, tmp_path)
        assert expected <= got, (path, got)


@settings(max_examples=40, deadline=None)
@given(st.sets(st.integers(0, len(MUTATIONS) - 1), min_size=1))
def test_every_error_is_reported_with_its_path_and_line(chosen: set[int]) -> None:
    """Any set of errors in one file: all of them reported, each at its path and line,
    and nothing reported on a line that was not made wrong."""
    text, expected = mutate(sorted(chosen))
    got = issues_of(text, Path("/nonexistent"))
    assert expected <= got
    if RENAME not in chosen:  # the quotas of a renamed tier are wrong too
        assert {line for _, line in got} <= {line for _, line in expected}


MISSING = [
    # (text, path, line): a key left out is reported at its table's line
    ('[[tiers]]\nname = "dram"\nbudget = 1024\n', "tiers[0].kind", 1),
    ('[[tiers]]\nkind = "memory"\nbudget = 1024\n', "tiers[0].name", 1),
    (
        '[[tiers]]\nname = "m"\nkind = "memory"\nbudget = 4096\n\n[[tiers]]\nname = "r"\n'
        'kind = "mooncake"\nbudget = 4096\n\n[tiers.options]\nmaster = "h:1"\n',
        "tiers[1].options.metadata",
        11,
    ),
    ("[store]\npath = 'x'\n", "tiers", 1),
    (
        '[[tiers]]\nname = "m"\nkind = "memory"\nbudget = 4096\n\n[server.kv_events]\n'
        'topic = "t"\n',
        "server.kv_events.endpoint",
        6,
    ),
    ('[[tiers]]\nname = "m"\nkind = "memory"\nbudget = 4096\n[bogus]\nx = 1\n', "bogus", 5),
    (
        '[[tiers]]\nname = "m"\nkind = "memory"\nbudget = 4096\ncolour = "red"\n',
        "tiers[0].colour",
        5,
    ),
    (
        '[[tiers]]\nname = "m"\nkind = "memory"\nbudget = 4096\n[vllm]\nstore = "served"\n',
        "vllm.store",
        6,
    ),
]


def test_missing_and_unknown_keys(tmp_path: Path) -> None:
    for text, path, line in MISSING:
        got = issues_of(text, tmp_path)
        assert (path, line) in got, (text, got)


def test_not_toml_is_one_error_with_its_line(tmp_path: Path) -> None:
    config, issues = parse_text('[store]\npath = "x"\nbudget = = 3\n', tmp_path / "f.toml")
    assert config is None and len(issues) == 1 and issues[0].line == 3


def test_line_index_of_nested_and_quoted_keys() -> None:
    index = line_index(BASE)
    assert index[("tiers", 1, "options", "io_depth")] == line_no("io_depth = 4")
    assert index[("quotas", "user:alice", "ssd")] == line_no(
        '"user:alice" = { dram = "16MiB", ssd = "256MiB" }'
    )
    assert index[("server", "principals", "alice")] == line_no("[server.principals.alice]")


def test_config_check_command(tmp_path: Path) -> None:
    text, expected = mutate([1, 6, 20])
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    good = tmp_path / "good.toml"
    good.write_text(BASE)
    run = [sys.executable, "-m", "kvlife.cli", "config", "check"]
    out = subprocess.run(
        [*run, str(bad)], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 1
    for path, line in expected:
        assert f"{bad}:{line}: {path}: " in out.stderr, out.stderr
    assert "3 error(s)" in out.stderr
    ok = subprocess.run(
        [*run, str(good)], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120
    )
    assert ok.returncode == 0 and "ok; tiers: dram (memory" in ok.stdout, ok.stderr


def test_unreadable_file(tmp_path: Path) -> None:
    config, issues = check_file(tmp_path / "absent.toml")
    assert config is None and "cannot read" in issues[0].message


def test_planner_profile_is_read(tmp_path: Path) -> None:
    text = BASE + '\n[planner]\nprefill_profile = "profile.json"\n\n[planner.tiers.ssd]\n'
    text += "latency_s = 0.0001\nbytes_per_s = 2.0e9\n"
    _, issues = parse_text(text, tmp_path / "kvlife.toml")
    assert [i.path for i in issues] == ["planner.prefill_profile"]
    PrefillProfile(0.001, 1e-5, 1e-9).save(tmp_path / "profile.json")
    config, issues = parse_text(text, tmp_path / "kvlife.toml")
    assert issues == [] and config is not None and config.planner is not None
    model = config.planner.cost_model(64)
    assert model.tier("ssd").seconds(2_000_000_000) > 0.99


def test_write_through_onto_a_remote_tier_is_refused_on_its_line(tmp_path: Path) -> None:
    """The store writes through onto a disk tier only: a remote tier marked
    write-through is an issue at its own durability line (it was reported as the
    store-wide 'write_through needs a durable tier (a disk tier)' at line 1)."""
    text = (
        '[store]\npath = "store"\n\n[[tiers]]\nname = "dram"\nkind = "memory"\n'
        'budget = "64MiB"\n\n[[tiers]]\nname = "r"\nkind = "redis"\nbudget = "1GiB"\n'
        'durability = "write-through"\n\n[tiers.options]\nurl = "redis://127.0.0.1:1/0"\n'
    )
    config, issues = parse_text(text, tmp_path / "kvlife.toml")
    assert config is None
    assert [(i.path, i.line) for i in issues] == [("tiers[1].durability", 13)]
    assert "disk tier only" in issues[0].message and "redis" in issues[0].message

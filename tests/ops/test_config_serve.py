"""``kvlife serve --config FILE``: a real server run from a configuration file (no
flags), whose behaviour shows each part of the file took effect; and the flags given
beside a file override it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvlife.cli import build_parser
from kvlife.client import RemoteStore
from kvlife.core.errors import LimitExceeded
from kvlife.core.identity import PUBLIC
from kvlife.ops.config.serve import serve_config
from tests.conftest import prompt_kv, tiny_identity
from tests.server.conftest import ROOT, child_env

KiB = 1 << 10

CONFIG = """
[store]
path = "store"

[[tiers]]
name = "dram"
kind = "memory"
budget = "64KiB"

[[tiers]]
name = "ssd"
kind = "disk"
budget = "160KiB"
durability = "write-back"

[tiers.options]
segment_bytes = "64KiB"
direct_io = false

[server]
socket = "kv.sock"
pid_file = "kv.pid"
staging_bytes = "1MiB"

[server.limits]
max_chunks = 8
"""


def start(config: Path, *flags: str) -> subprocess.Popen[bytes]:
    log = (config.parent / "serve.log").open("ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvlife.cli", "serve", "--config", str(config), *flags],
        cwd=ROOT,
        env=child_env(),
        stderr=log,
    )
    pid_file = config.parent / "kv.pid"
    deadline = time.monotonic() + 60
    while not pid_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError((config.parent / "serve.log").read_text())
        time.sleep(0.02)
    return proc


def stop(proc: subprocess.Popen[bytes]) -> int:
    os.kill(proc.pid, signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def test_serve_runs_from_the_file(tmp_path: Path) -> None:
    config = tmp_path / "kvlife.toml"
    config.write_text(CONFIG)
    proc = start(config)  # no PATH, no --socket: both from the file
    try:
        sock = tmp_path / "kv.sock"
        assert sock.is_socket()
        with RemoteStore(sock, timeout=30) as c:
            info = c.info()
            assert [(t.name, t.capacity_bytes) for t in info.tiers] == [
                ("dram", 64 * KiB),
                ("ssd", 160 * KiB),
            ]
            # [server.limits] max_chunks = 8: a lookup of 10 chunks is refused
            tokens, kv = prompt_kv(99, 160)
            with pytest.raises(LimitExceeded):
                c.lookup(tiny_identity(), PUBLIC, tokens)
            # 24 prompts of 4 chunks (~200 KiB of KV) through a 64 KiB DRAM tier: the
            # chunks demoted land in the tier the file named, within its budget
            for seed in range(24):
                tokens, kv = prompt_kv(seed, 64)
                assert c.put_prompt(tiny_identity(), PUBLIC, tokens, kv).stored == 4
            counters = c.counters
            info = c.info()
        ssd = next(t for t in info.tiers if t.name == "ssd")
        assert counters.demotions > 0
        assert 0 < ssd.used_bytes <= 160 * KiB and ssd.replicas > 0
        assert counters.tier("ssd").evictions > 0  # the 160 KiB budget was enforced
        segments = list((tmp_path / "store" / "ssd").rglob("*"))
        assert any(p.is_file() and p.stat().st_size > 0 for p in segments)
        assert not (tmp_path / "store" / "disk").exists()
    finally:
        assert stop(proc) == 0
    assert not (tmp_path / "kv.pid").exists()


def test_flags_override_the_file(tmp_path: Path) -> None:
    config = tmp_path / "kvlife.toml"
    text = CONFIG.replace("[server]\n", '[server]\nmetrics = ":0"\nlog_json = true\n', 1)
    assert text != CONFIG
    config.write_text(text + '\n[server.kv_events]\nendpoint = "tcp://*:5557"\ntopic = "t"\n')
    args = build_parser().parse_args(
        [
            "serve",
            "--config",
            str(config),
            "--disk-bytes",
            str(512 * KiB),
            "--max-chunks",
            "64",
            "--socket",
            str(tmp_path / "other.sock"),
            "--no-promote",
        ]
    )
    cfg = serve_config(args)
    assert cfg.path == tmp_path / "store"
    assert cfg.socket == tmp_path / "other.sock"
    assert cfg.pid_file == tmp_path / "kv.pid"  # not given: the file's
    assert cfg.store is not None
    assert [(t.name, t.capacity_bytes) for t in cfg.store.chain] == [
        ("dram", 64 * KiB),
        ("ssd", 512 * KiB),
    ]
    assert cfg.limits.max_chunks == 64 and cfg.limits.max_connections == 512
    assert cfg.store.promote_on_hit is False
    assert cfg.staging_bytes == 1 << 20
    assert cfg.kv_events is not None and cfg.kv_events.endpoint == "tcp://*:5557"
    assert cfg.metrics == ("127.0.0.1", 0) and cfg.log_json  # not given: the file's
    over = build_parser().parse_args(
        [
            "serve",
            "--config",
            str(config),
            "--kv-events",
            "ipc:///tmp/x",
            "--kv-events-topic",
            "",
            "--metrics",
            "9999",
            "--no-log-json",
        ]
    )
    over_cfg = serve_config(over)
    assert not over_cfg.log_json  # --no-log-json switches the file's log_json = true off
    events = over_cfg.kv_events
    assert over_cfg.metrics == ("127.0.0.1", 9999)  # the flag wins over the file
    assert events is not None and (events.endpoint, events.topic) == ("ipc:///tmp/x", "")
    # without a file, the same function gives ServeConfig's own defaults
    plain = serve_config(build_parser().parse_args(["serve", str(tmp_path / "s")]))
    assert plain.store is None and plain.dram_bytes == 1 << 30 and plain.limits.max_chunks == 16384


@pytest.mark.parametrize("where", ["busy", "unresolvable", "no ops extra"])
def test_a_metrics_address_the_server_cannot_serve_leaves_nothing_behind(
    tmp_path: Path, where: str
) -> None:
    """``[server] metrics`` on a port another socket listens on, on a host name that
    does not resolve, or on a machine without prometheus-client (the ops extra; here
    a package of that name that fails to import): ``kvlife serve --config`` fails with
    the typed one-line error and makes nothing. On the code of 69c924e each failed
    only after making the store folder, which it left behind with its lock file and
    tier folders, the last with an ImportError traceback."""
    env = child_env()
    if where == "no ops extra":
        shadow = tmp_path / "shadow" / "prometheus_client"
        shadow.mkdir(parents=True)
        (shadow / "__init__.py").write_text('raise ImportError("no prometheus_client here")\n')
        env["PYTHONPATH"] = f"{shadow.parent}{os.pathsep}{env['PYTHONPATH']}"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        address = {"busy": f"127.0.0.1:{port}", "unresolvable": "nosuch.invalid:0"}.get(
            where, "127.0.0.1:0"
        )
        store = tmp_path / "run"
        store.mkdir()
        config = store / "kvlife.toml"
        config.write_text(CONFIG.replace("[server]\n", f'[server]\nmetrics = "{address}"\n', 1))
        proc = subprocess.run(
            [sys.executable, "-m", "kvlife.cli", "serve", "--config", str(config)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            timeout=120,
        )
    err = proc.stderr.decode()
    assert proc.returncode == 1, err
    assert "Traceback" not in err and err.startswith("kvlife: error:") and "metrics" in err, err
    assert sorted(p.name for p in store.iterdir()) == ["kvlife.toml"]

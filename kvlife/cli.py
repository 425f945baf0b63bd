"""The ``kvlife`` command line: info, check, demo, bench and experiments.

Subcommands import their modules lazily so that ``kvlife info`` does not pay for numba
or matplotlib.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import kvlife
from kvlife.core.errors import KVLifeError, StoreLockedError
from kvlife.report import format_bytes

GiB = 1 << 30


def _open_existing(path: str) -> object:
    from kvlife.store import KVStore

    p = Path(path)
    if not (p / "disk").is_dir():
        raise KVLifeError(f"{p} is not a kvlife store (no disk/ directory)")
    # budgets only bound new writes; an existing store is opened with room for what it holds
    return KVStore.open(p, dram_bytes=0, disk_bytes=1 << 50)


def _live_socket(args: argparse.Namespace) -> str | None:
    """The socket of the server to ask: ``--socket``, or ``PATH/serve.sock`` when a
    server answers there (a dead server's leftover socket is not one)."""
    if getattr(args, "socket", None):
        return str(args.socket)
    if args.path is None:
        raise KVLifeError("give a store PATH or --socket S")
    sock = Path(args.path) / "serve.sock"
    if not sock.is_socket():
        return None
    import socket

    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(sock))
    except OSError:
        return None
    finally:
        probe.close()
    return str(sock)


def cmd_info(args: argparse.Namespace) -> int:
    from kvlife.report import format_table
    from kvlife.store import KVStore

    sock = _live_socket(args)
    if sock is not None:
        remote = kvlife.connect(sock)
        try:
            info = remote.info()
            server = remote.server_info()["server"]
        finally:
            remote.close()
        if args.json:
            print(json.dumps({**info.to_json(), "server": server}, indent=2))
            return 0
        print(f"server {sock}: " + ", ".join(f"{k}={v}" for k, v in server.items()))
    else:
        store = _open_existing(args.path)
        assert isinstance(store, KVStore)
        try:
            info = store.info()
        finally:
            store.close(flush=False)
    if args.json:
        print(json.dumps(info.to_json(), indent=2))
        return 0
    print(f"store {info.path}")
    rows = []
    for t in info.tiers:
        rows.append([t.name, str(t.replicas), format_bytes(t.used_bytes)])
        extra = {k: v for k, v in t.details.items() if k in ("direct_io", "live_bytes", "segments")}
        if extra:
            rows.append(["", "", ", ".join(f"{k}={v}" for k, v in extra.items())])
    print(format_table(["tier", "replicas", "used"], rows))
    print()
    print(
        format_table(
            ["state", "objects", "bytes"],
            [
                [s, str(n), format_bytes(info.bytes_by_state[s])]
                for s, n in info.objects_by_state.items()
            ],
        )
    )
    print()
    nonzero = [[k, str(v)] for k, v in info.lifetime_counters.items() if v]
    print(format_table(["lifetime counter", "value"], nonzero or [["(none)", ""]]))
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    """Audit read-only; with --fix, repair (the only path that deletes) and audit again."""
    from tqdm import tqdm

    from kvlife.tiers.disk.audit import audit_directory

    sock = _live_socket(args)
    if sock is not None:
        return _check_live(sock, args.fix)
    path = Path(args.path)
    if args.fix:
        actions = _fix(path)
        for action in actions:
            print(f"fixed: {action}")
        if not actions:
            print("fixed: nothing needed fixing")
    segments = path / "disk" / "segments"
    total = sum(f.stat().st_size for f in segments.glob("seg-*.kvs")) if segments.is_dir() else 0
    with tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc="checking",
        leave=False,
        disable=total < (256 << 20),
    ) as bar:
        try:
            report = audit_directory(path, progress=bar.update)
        except StoreLockedError as exc:
            raise StoreLockedError(
                f"{exc} (a `kvlife serve` of it is audited through its socket: "
                "`kvlife check --socket S`)"
            ) from None
    print(f"checked {report.rows} replicas: {report.ok} ok, {len(report.bad_keys)} bad")
    if report.generation is not None:
        print(f"catalog generation {report.generation}")
    for problem in report.problems:
        print(f"  bad: {problem}")
    for line in report.quarantined:
        print(f"  quarantined row: {line}")
    for name in report.orphan_segments:
        print(f"  orphan segment: {name}")
    for name in report.quarantined_files:
        print(f"  quarantined file: quarantine/{name} (set aside by recovery; --fix deletes it)")
    if not report.clean:
        print("run `kvlife check --fix PATH` to repair" if not args.fix else "not repaired")
    return 0 if report.clean else 1


def _check_live(sock: str, fix: bool) -> int:
    """A live server holds the directory lock: its own audit, read-only, via the socket."""
    if fix:
        raise KVLifeError("a live server holds this store: stop it before `kvlife check --fix`")
    remote = kvlife.connect(sock)
    try:
        report = remote.check()
    finally:
        remote.close()
    print(f"checked {report.rows} replicas via {sock}: {report.ok} ok, {len(report.bad_keys)} bad")
    for problem in report.problems:
        print(f"  bad: {problem}")
    for line in report.quarantined:
        print(f"  quarantined row: {line}")
    for name in report.orphan_segments:
        print(f"  orphan segment: {name}")
    return 0 if report.clean else 1


def cmd_serve(args: argparse.Namespace) -> int:
    from kvlife.ops.config.serve import serve_config
    from kvlife.server.server import run

    return run(serve_config(args))


def cmd_config_check(args: argparse.Namespace) -> int:
    """Every error of a configuration file, by path and line; 0 when there is none."""
    from kvlife.ops.config import check_file

    config, issues = check_file(args.file)
    for issue in issues:
        print(f"{args.file}:{issue.line}: {issue.path}: {issue.message}", file=sys.stderr)
    if config is None:
        print(f"{args.file}: {len(issues)} error(s)", file=sys.stderr)
        return 1
    tiers = ", ".join(
        f"{t.name} ({t.kind}, {format_bytes(t.capacity_bytes)}"
        + (f", {t.transform}" if t.transform else "")
        + ")"
        for t in config.store.chain
    )
    print(f"{args.file}: ok; tiers: {tiers}")
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    from kvlife.apps.top import run_top

    return run_top(args.socket, interval=args.interval, once=args.once)


def _fix(path: Path) -> list[str]:
    from kvlife.store import KVStore
    from kvlife.tiers.disk.repair import prepare_repair

    actions = prepare_repair(path)
    store = _open_existing(str(path))
    assert isinstance(store, KVStore)
    try:
        report = store.check(fix=True)
    finally:
        store.close(flush=False)
    return [*actions, *report.actions]


def cmd_demo(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        from kvlife.bench.vllm import run_demo as run_vllm_demo

        return run_vllm_demo(args)
    if args.synthetic:
        from kvlife.apps.synthetic import run_synthetic_demo

        return run_synthetic_demo(args)
    from kvlife.apps.chat import run_demo

    return run_demo(args)


def _forward(module: str, argv: Sequence[str]) -> int:
    import importlib

    mod = importlib.import_module(module)
    result: int = mod.main(list(argv))
    return result


def _whole_every_seconds(text: str) -> float:
    from kvlife.server.heap import whole_every_problem

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    problem = whole_every_problem(value)
    if problem:
        raise argparse.ArgumentTypeError(f"seconds {problem}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvlife", description="KV-cache storage with identity, lifecycle and crash safety"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="tiers, objects per state, bytes and counters of a store")
    p.add_argument("path", nargs="?", help="store directory (a live server's: via its socket)")
    p.add_argument("--socket", default=None, help="ask the `kvlife serve` on this socket")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser(
        "check", help="audit a store read-only (catalog, rows, frames, superblock, files)"
    )
    p.add_argument("path", nargs="?", help="store directory (a live server's: via its socket)")
    p.add_argument("--socket", default=None, help="ask the `kvlife serve` on this socket")
    p.add_argument(
        "--fix",
        action="store_true",
        help="repair: drop bad and quarantined replicas, delete orphan and quarantined files",
    )
    p.set_defaults(func=cmd_check)

    p = sub.add_parser(
        "serve", help="serve a store to many processes (Unix socket + shared memory)"
    )
    p.add_argument(
        "path", nargs="?", help="store directory (locked while serving; default: the config's)"
    )
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="configuration file (TOML: tiers, server, quotas, planner; docs/operations.md); "
        "every flag given here overrides the value the file sets",
    )
    p.add_argument("--socket", default=None, help="Unix socket path (default PATH/serve.sock)")
    p.add_argument(
        "--dram-bytes",
        type=int,
        default=1 * GiB,
        help="shared-memory DRAM tier (with --config: the first tier's budget)",
    )
    p.add_argument(
        "--disk-bytes",
        type=int,
        default=8 * GiB,
        help="disk tier (0: none; with --config: the first disk tier's budget)",
    )
    p.add_argument(
        "--staging-bytes",
        type=int,
        default=256 << 20,
        help="arena room beyond the DRAM budget (puts being written, disk reads handed out)",
    )
    p.add_argument("--pid-file", default=None, help="write the server's pid here")
    p.add_argument("--write-through", action="store_true", help="make every put durable")
    p.add_argument("--no-promote", action="store_true", help="do not copy disk hits back into DRAM")
    p.add_argument(
        "--verify-dram-on-load",
        action="store_true",
        help="verify every load from the arena against the seal its replica was published "
        "with (one xxh3-128 per chunk loaded; README has the cost)",
    )
    p.add_argument(
        "--disk-transform",
        default="",
        help="transform the disk tier stores replicas with, e.g. int4 or lossless "
        "(docs/transforms.md; lookups take them only with a matching accept)",
    )
    p.add_argument(
        "--shm-dir",
        default=None,
        help="tmpfs for the arena and shared buffers (default /dev/shm; one mounted "
        "huge=always gives direct I/O into the arena full speed, docs/server.md)",
    )
    p.add_argument(
        "--cpus",
        default=None,
        help="CPUs the server runs on, e.g. 1 or 2-3 (keep them apart from the clients' "
        "CPUs: requests are then handled while clients copy, docs/server.md)",
    )
    p.add_argument(
        "--tenants",
        default=None,
        help="TOML file of principals (Unix users, groups, tokens, admin role): tenants "
        "enforced by the store, each in its own keyed namespaces (docs/server.md, "
        "Trust boundary); without it every client of this Unix user is trusted alike",
    )
    p.add_argument(
        "--metrics",
        nargs="?",
        const="127.0.0.1:0",
        default=None,
        metavar="HOST:PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics (HOST defaults to "
        "127.0.0.1; port 0, or no value, picks a free one, named in the start line; "
        "docs/operations.md)",
    )
    p.add_argument(
        "--log-json",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="log one JSON object per line (--no-log-json: text, over a config file's "
        "log_json = true; default: the file's, else text)",
    )
    p.add_argument(
        "--gc-whole-every",
        type=_whole_every_seconds,
        default=None,
        metavar="SECONDS",
        help="the server freezes what survives each full garbage collection, so that the "
        "next ones walk only what is new (pauses of 0.5 s at 256,000 chunks otherwise); "
        "every SECONDS it collects everything once (default 600; 0: Python's collector "
        'as it is; docs/server.md, Known limits, "Collector pauses")',
    )
    p.add_argument(
        "--events",
        default=None,
        metavar="FILE",
        help="write the store's lifecycle events to FILE (JSON lines, appended to; "
        ".parquet: Parquet) for `kvlife report --events` (docs/events.md)",
    )
    p.add_argument(
        "--kv-events",
        default=None,
        metavar="ENDPOINT",
        help="publish BlockStored/BlockRemoved/AllBlocksCleared in vLLM's KV-events format "
        "on this ZMQ endpoint (medium: the tier's name); bound when it has * or is ipc://, "
        "e.g. tcp://127.0.0.1:*, else connected to a router's SUB (docs/operations.md)",
    )
    p.add_argument(
        "--kv-events-replay",
        default=None,
        metavar="ENDPOINT",
        help="ZMQ ROUTER endpoint that replays buffered KV-event batches (as vLLM's does)",
    )
    p.add_argument("--kv-events-topic", default=None, help="topic frame of KV events")
    from kvlife.ops.config.serve import unset_defaults
    from kvlife.server.limits import add_flags

    add_flags(p)  # every budget a client can make the server hold
    # a flag given overrides the config file: so each defaults to "not given" and the
    # real defaults are filled after the file (kvlife.ops.config.serve)
    unset_defaults(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("top", help="live view of a running `kvlife serve` (needs the ops extra)")
    p.add_argument("--socket", required=True, help="the server's Unix socket")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between frames")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.set_defaults(func=cmd_top)

    p = sub.add_parser("config", help="configuration files: `kvlife config check FILE`")
    config_sub = p.add_subparsers(dest="config_command", required=True)
    q = config_sub.add_parser(
        "check", help="report every error of a configuration file by path and line"
    )
    q.add_argument("file", help="the configuration file (TOML)")
    q.set_defaults(func=cmd_config_check)

    p = sub.add_parser(
        "demo",
        help="SmolLM2 chat with and without kvlife (--synthetic: store-only workload with "
        "fault injection and restart)",
    )
    p.add_argument(
        "--synthetic",
        action="store_true",
        help="run the store-only workload (synthetic KV, no model)",
    )
    p.add_argument(
        "--engine",
        choices=("hf", "vllm"),
        default="hf",
        help="hf: the transformers adapter; vllm: a real vLLM with the kvlife connector "
        "(needs .venv-vllm, docs/vllm.md)",
    )
    p.add_argument("--dir", default=None, help="store directory (default: a fresh temp dir)")
    p.add_argument(
        "--dram-mib",
        type=int,
        default=None,
        help="DRAM tier budget, MiB (default 16; synthetic: 128)",
    )
    p.add_argument("--disk-mib", type=int, default=4096, help="disk tier budget, MiB")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens generated per turn")
    p.add_argument("--chunk-tokens", type=int, default=64, help="tokens per KV chunk")
    p.add_argument("--users", type=int, default=8, help="synthetic: chat users")
    p.add_argument("--turns", type=int, default=6, help="synthetic: turns per user")
    p.add_argument("--json", default=None, help="write the results as JSON to this file")
    p.add_argument("--seed", type=int, default=0, help="synthetic: workload seed")
    p.add_argument(
        "--events",
        default=None,
        help="write the store's lifecycle events here (JSON lines; `kvlife report --events`)",
    )
    p.set_defaults(func=cmd_demo)

    sub.add_parser(
        "bench",
        help="benchmarks: `kvlife bench NAME --help` (NAME: " + ", ".join(BENCHES) + ")",
        add_help=False,
    )
    sub.add_parser("replay", help="replay a trace: `kvlife replay --help`", add_help=False)
    sub.add_parser(
        "report",
        help="one run of a trace, all the metrics (JSON, HTML): `kvlife report --help`",
        add_help=False,
    )
    sub.add_parser(
        "sweep", help="hit ratio against capacity per policy: `kvlife sweep --help`", add_help=False
    )
    sub.add_parser(
        "experiment",
        help="experiments: `kvlife experiment identity|lifetime-hints|transforms|"
        "crossover|object-size|sharing-scope|isolation|upstream|faults --help`",
        add_help=False,
    )
    return parser


BENCHES = {
    "io": "kvlife.bench.io",
    "ttft": "kvlife.bench.ttft",
    "ssd": "kvlife.sim.bench_ssd",
    "concurrency": "kvlife.bench.concurrency",
    "async": "kvlife.bench.overlap",
    "transforms": "kvlife.bench.transforms",
    "remote": "kvlife.bench.remote",
    "vllm": "kvlife.bench.vllm",
    "vllm-trace": "kvlife.bench.vllm_trace",
    "server": "kvlife.bench.server",
    "stages": "kvlife.bench.stages",
    "lmcache-mp": "kvlife.bench.peer_lmcache_mp",
    "tenant-arenas": "kvlife.bench.tenant_arenas",
    "invalidate": "kvlife.bench.invalidate",
    "pauses": "kvlife.bench.pauses",
    "shares": "kvlife.bench.shares",
    "replay": "kvlife.bench.replay",
}
EXPERIMENTS = {
    "lifetime-hints": "kvlife.sim.lifetime_hints",
    "identity": "kvlife.experiments.identity",
    "transforms": "kvlife.experiments.transforms",
    "crossover": "kvlife.experiments.crossover",
    "object-size": "kvlife.experiments.object_size",
    "sharing-scope": "kvlife.experiments.sharing_scope",
    "isolation": "kvlife.experiments.isolation",
    "upstream": "kvlife.experiments.upstream",
    "faults": "kvlife.experiments.faults",
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] in (["replay"], ["sweep"]):
            from kvlife.replay import cli as replay_cli

            if argv[0] == "replay":
                return replay_cli.replay_main(argv[1:])
            return replay_cli.sweep_main(argv[1:])
        if argv[:1] == ["report"]:
            return _forward("kvlife.reporting.cli", argv[1:])
        if argv[:1] in (["bench"], ["experiment"]):
            table = BENCHES if argv[0] == "bench" else EXPERIMENTS
            if len(argv) < 2 or argv[1] not in table:
                print(f"usage: kvlife {argv[0]} {{{','.join(table)}}} [options]", file=sys.stderr)
                return 2
            return _forward(table[argv[1]], argv[2:])
        args = build_parser().parse_args(argv)
        if args.command == "demo" and args.dram_mib is None:
            args.dram_mib = 128 if args.synthetic else 16
        result: int = args.func(args)
        return result
    except KVLifeError as exc:
        print(f"kvlife: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

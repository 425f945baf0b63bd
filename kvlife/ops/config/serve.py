"""``kvlife serve``'s settings from a configuration file and its flags, in one place.

Every flag of ``kvlife serve`` defaults to "not given" (:func:`unset_defaults`), so
:func:`serve_config` can tell a flag given from a default: the file's values are taken
first and each flag given overrides the value it names. Without ``--config`` the same
function fills the defaults of :class:`~kvlife.server.server.ServeConfig` and
:class:`~kvlife.server.limits.Limits`. The flags and the file thus end in the same
dataclasses; no other code reads either.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import replace
from pathlib import Path

from kvlife.core.errors import InvalidArgument
from kvlife.ops.config.parse import load_file
from kvlife.ops.config.schema import KVLifeConfig, ServerSettings
from kvlife.ops.kv_events import KVEventsConfig
from kvlife.server.address import parse_address
from kvlife.server.limits import Limits
from kvlife.server.server import ServeConfig, parse_cpus
from kvlife.store.config import StoreConfig
from kvlife.tenancy.principals import load_config as load_principals
from kvlife.tiers.spec import TierSpec

_DEFAULT = ServeConfig(Path("."))


def unset_defaults(parser: argparse.ArgumentParser) -> None:
    """Every option of ``parser`` defaults to None: :func:`serve_config` fills the real
    defaults, after the file's values."""
    parser.set_defaults(
        **{
            a.dest: None
            for a in parser._actions  # argparse keeps its actions there only
            if a.dest not in ("help", "func") and a.option_strings
        }
    )


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The server's settings: the file (``--config``), then every flag given."""
    file = load_file(args.config) if args.config else None
    server = file.server if file is not None and file.server is not None else ServerSettings()
    if args.path:
        path = Path(args.path)
    elif file is not None and file.path is not None:
        path = file.path
    else:
        raise InvalidArgument(
            "kvlife serve needs the store directory: PATH, or [store] path in --config"
        )
    limits = _limits(server.limits, args)
    tenants = Path(args.tenants) if args.tenants else server.principals
    common = {
        "path": path,
        "socket": Path(args.socket) if args.socket else server.socket,
        "staging_bytes": _given(args.staging_bytes, server.staging_bytes),
        "pid_file": Path(args.pid_file) if args.pid_file else server.pid_file,
        "shm_dir": Path(args.shm_dir) if args.shm_dir else server.shm_dir,
        "cpus": parse_cpus(args.cpus) if args.cpus else server.cpus,
        "limits": limits,
        "tenants": tenants,
        "kv_events": _kv_events(server.kv_events, args),
        "metrics": _metrics_address(args.metrics if args.metrics is not None else server.metrics),
        "log_json": server.log_json if args.log_json is None else bool(args.log_json),
        "gc_whole_every_s": server.gc_whole_every_s
        if args.gc_whole_every is None
        else args.gc_whole_every,
        "events": Path(args.events) if args.events else server.events,
    }
    if file is None:
        return ServeConfig(
            dram_bytes=_given(args.dram_bytes, _DEFAULT.dram_bytes),
            disk_bytes=_given(args.disk_bytes, _DEFAULT.disk_bytes),
            write_through=bool(args.write_through),
            promote_on_hit=not args.no_promote,
            disk_transform=args.disk_transform or "",
            verify_dram_on_load=bool(args.verify_dram_on_load),
            **common,  # type: ignore[arg-type]
        )
    store = _store(file, args)
    disk = next((t for t in store.chain if t.kind == "disk"), None)
    return ServeConfig(
        dram_bytes=store.chain[0].capacity_bytes,
        disk_bytes=disk.capacity_bytes if disk is not None else 0,
        write_through=store.write_through,
        promote_on_hit=store.promote_on_hit,
        disk_transform=disk.transform if disk is not None else "",
        verify_dram_on_load=store.verify_dram_on_load,
        store=store,
        **common,  # type: ignore[arg-type]
    )


def _given(value: int | None, default: int) -> int:
    return default if value is None else value


def _metrics_address(text: str | None) -> tuple[str, int] | None:
    if text is None:
        return None
    return parse_address(text)


def _limits(base: Limits, args: argparse.Namespace) -> Limits:
    given = {
        f.name: getattr(args, f"limit_{f.name}")
        for f in dataclasses.fields(Limits)
        if getattr(args, f"limit_{f.name}", None) is not None
    }
    return replace(base, **given) if given else base


def _kv_events(base: KVEventsConfig | None, args: argparse.Namespace) -> KVEventsConfig | None:
    endpoint = args.kv_events or (base.endpoint if base is not None else "")
    if not endpoint:
        if args.kv_events_replay or args.kv_events_topic is not None:
            raise InvalidArgument("--kv-events-replay and --kv-events-topic need --kv-events")
        return None
    config = base if base is not None else KVEventsConfig(endpoint)
    return replace(
        config,
        endpoint=endpoint,
        replay_endpoint=args.kv_events_replay or config.replay_endpoint,
        topic=config.topic if args.kv_events_topic is None else args.kv_events_topic,
    )


def _store(file: KVLifeConfig, args: argparse.Namespace) -> StoreConfig:
    """The file's store settings with the flags given applied: ``--dram-bytes`` is the
    first tier's budget, ``--disk-bytes`` and ``--disk-transform`` the first disk
    tier's (``--disk-bytes 0`` drops it)."""
    store = file.store
    chain: list[TierSpec] = list(store.chain)
    if args.dram_bytes is not None:
        chain[0] = replace(chain[0], capacity_bytes=args.dram_bytes)
    disk = next((i for i, t in enumerate(chain) if t.kind == "disk"), None)
    if (args.disk_bytes is not None or args.disk_transform is not None) and disk is None:
        raise InvalidArgument(
            f"--disk-bytes/--disk-transform: the chain of {file.source} has no disk tier"
        )
    if disk is not None and args.disk_transform is not None:
        params = (
            chain[disk].transform_params if args.disk_transform == chain[disk].transform else ()
        )
        chain[disk] = replace(chain[disk], transform=args.disk_transform, transform_params=params)
    if disk is not None and args.disk_bytes is not None:
        if args.disk_bytes == 0:
            del chain[disk]
        else:
            chain[disk] = replace(chain[disk], capacity_bytes=args.disk_bytes)
    shares = store.tenant_shares
    if args.tenants:  # a principals file replaces the file's principals, and its quotas
        from_file = load_principals(Path(args.tenants)).shares
        shares = from_file or shares
    return replace(
        store,
        tiers=tuple(chain),
        write_through=store.write_through or bool(args.write_through),
        promote_on_hit=store.promote_on_hit and not args.no_promote,
        verify_dram_on_load=store.verify_dram_on_load or bool(args.verify_dram_on_load),
        tenant_shares=shares,
    )

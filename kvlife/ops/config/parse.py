"""A configuration file (TOML) made into :class:`~kvlife.ops.config.schema.KVLifeConfig`,
every error reported with its path and line.

The file is read with :mod:`tomllib` and then checked table by table. A bad value is
noted as a :class:`ConfigIssue` (its path such as ``tiers[1].budget``, the line it was
written on, what is wrong) and the check goes on, so one run names every error; only a
file that is not TOML at all stops at its first error (tomllib's, with its line). Every
value ends in the class the store, the server or the connector already takes
(:class:`~kvlife.store.config.StoreConfig`, :class:`~kvlife.tiers.spec.TierSpec` with the
kind's options class, :class:`~kvlife.server.limits.Limits`,
:class:`~kvlife.tenancy.principals.TenancyConfig`, ...), built by their own checks, so a
file is never taken that those would refuse. docs/operations.md has a full example.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvlife.core.errors import InvalidArgument, KVLifeError
from kvlife.core.identity import Namespace, NamespaceKind
from kvlife.ops.config.lines import Path as KeyPath
from kvlife.ops.config.lines import format_path, line_index, line_of
from kvlife.ops.config.schema import (
    CONNECTOR_KEYS,
    KVLifeConfig,
    PlannerSettings,
    ServerSettings,
    TierSeed,
)
from kvlife.ops.kv_events import KVEventsConfig
from kvlife.server.address import parse_address
from kvlife.server.heap import whole_every_problem
from kvlife.server.limits import Limits
from kvlife.store.config import StoreConfig
from kvlife.tenancy.names import check_name
from kvlife.tenancy.principals import TenancyConfig, parse_config
from kvlife.tenancy.quotas import PUBLIC_TENANT, Shares
from kvlife.tiers.options import TierOptionError, TierOptions, conforms, describe
from kvlife.tiers.registry import tier_kind
from kvlife.tiers.spec import TIER_NAME, TIER_NAME_RULE, TierSpec

VOLATILE_KINDS = frozenset({"memory", "shm"})
"""Built-in kinds whose replicas are gone when the process ends; every other kind keeps
what it committed (disk, redis, mooncake)."""
Durability = Literal["volatile", "write-back", "write-through"]
"""A tier's ``durability``: volatile (memory kinds), write-back (a durable kind filled by
demotions and flushes, the default) or write-through (every put durable there before it
returns: :attr:`~kvlife.store.config.StoreConfig.write_through`)."""

_UNITS = {
    "B": 1,
    "KiB": 1 << 10,
    "MiB": 1 << 20,
    "GiB": 1 << 30,
    "TiB": 1 << 40,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")


@dataclass(frozen=True, slots=True)
class ConfigIssue:
    """One error of a configuration file."""

    path: str
    """Where in the file's structure: ``tiers[1].budget``, ``server.limits.backlog``."""
    line: int
    """The line it was written on (1-based; a missing key: its table's line)."""
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.path}: {self.message}"


class ConfigError(InvalidArgument):
    """A configuration file with errors; ``issues`` lists every one."""

    def __init__(self, source: Path, issues: list[ConfigIssue]) -> None:
        self.source = source
        self.issues = issues
        lines = "\n".join(f"  {source}:{i.line}: {i.path}: {i.message}" for i in issues)
        super().__init__(f"{source}: {len(issues)} error(s) in the configuration\n{lines}")


def parse_size(value: object) -> int:
    """Bytes: an int, or a string such as ``"2GiB"``, ``"512 MiB"``, ``"1.5GB"``."""
    if type(value) is int:
        return value
    if isinstance(value, str):
        m = _SIZE.fullmatch(value)
        if m is not None and m.group(2) in (*_UNITS, ""):
            number = float(m.group(1))
            unit = _UNITS[m.group(2) or "B"]
            if number * unit == int(number * unit):
                return int(number * unit)
    raise InvalidArgument(
        f"must be bytes: an int or a size such as '2GiB' or '512MB', got {value!r}"
    )


def load_file(path: str | Path) -> KVLifeConfig:
    """The configuration in ``path``; :class:`ConfigError` naming every error."""
    source = Path(path)
    config, issues = check_file(source)
    if config is None:
        raise ConfigError(source, issues)
    return config


def check_file(path: str | Path) -> tuple[KVLifeConfig | None, list[ConfigIssue]]:
    """The configuration in ``path`` and its errors (the configuration is None when
    there are any)."""
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return None, [ConfigIssue("", 1, f"cannot read {source}: {exc}")]
    return parse_text(text, source)


def parse_text(text: str, source: Path) -> tuple[KVLifeConfig | None, list[ConfigIssue]]:
    """As :func:`check_file`, for the text of ``source``."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        m = re.search(r"line (\d+)", str(exc))
        return None, [ConfigIssue("", int(m.group(1)) if m else 1, f"not TOML: {exc}")]
    reader = _Reader(text, source.resolve().parent)
    config = reader.config(data, source)
    issues = sorted(reader.issues, key=lambda i: i.line)
    return (config if not issues else None), issues


class _Bad:
    """A value that was reported: whatever depends on it is not built."""


BAD = _Bad()


class _Reader:
    """Walks the parsed file, noting every issue with its path and line."""

    def __init__(self, text: str, base: Path) -> None:
        self.index = line_index(text)
        self.base = base
        self.issues: list[ConfigIssue] = []
        self.budgets: dict[str, int | None] | None = None
        """Name -> budget of each tier (None: a bad budget); None when a tier's name
        could not be read (no quota or seed is then checked against the chain)."""

    def bad(self, path: KeyPath, message: str) -> _Bad:
        self.issues.append(ConfigIssue(format_path(path), line_of(self.index, path), message))
        return BAD

    # ------------------------------------------------------------------ values

    def table(self, value: object, path: KeyPath, known: set[str] | None) -> dict[str, Any]:
        """``value`` as a table (an empty one, reported, if it is not); every key not in
        ``known`` reported (None: any key)."""
        if not isinstance(value, dict):
            self.bad(path, f"must be a table, got {_kind(value)}")
            return {}
        if known is not None:
            for key in value:
                if key not in known:
                    self.bad((*path, key), f"unknown key (known: {', '.join(sorted(known))})")
        return value

    def value(
        self, table: Mapping[str, Any], path: KeyPath, key: str, hint: Any, default: Any
    ) -> Any:
        """``table[key]`` checked against ``hint`` (``"size"`` for bytes); ``default``
        when absent (``...``: required)."""
        where = (*path, key)
        if key not in table:
            if default is ...:
                return self.bad(where, "required")
            return default
        raw = table[key]
        if hint == "size":
            try:
                return parse_size(raw)
            except InvalidArgument as exc:
                return self.bad(where, str(exc))
        ok, value = conforms(raw, hint)
        if not ok:
            return self.bad(where, f"must be {describe(hint, optional=False)}, got {raw!r}")
        return value

    def file_path(self, value: str) -> Path:
        """A path of the file, relative to the file's directory."""
        p = Path(value).expanduser()
        return p if p.is_absolute() else self.base / p

    # ------------------------------------------------------------------ the file

    def config(self, data: dict[str, Any], source: Path) -> KVLifeConfig | None:
        self.table(data, (), {"store", "tiers", "server", "planner", "quotas", "vllm"})
        store = self.table(data.get("store", {}), ("store",), _STORE_KEYS)
        path = self.value(store, ("store",), "path", str, None)
        has_server = "server" in data
        chain, write_through = self.tiers(data.get("tiers", ...), serving=has_server)
        names = self.budgets
        shares = self.quotas(data.get("quotas", {}), names)
        settings: dict[str, Any] = {}
        for key, (hint, default) in _STORE_OPTIONS.items():
            settings[key] = self.value(store, ("store",), key, hint, default)
        parity = store.get("segment_parity")
        if parity is not None:
            settings["segment_parity"] = self.parity(parity)
        if settings.get("io_threads") is not BAD and settings["io_threads"] < 1:
            settings["io_threads"] = self.bad(("store", "io_threads"), "must be >= 1")
        server = self.server(data["server"]) if has_server else None
        planner = self.planner(data["planner"], names) if "planner" in data else None
        connector = self.connector(data.get("vllm", {}), has_server, path)
        if self.issues or chain is None or shares is None:
            return None
        if any(v is BAD for v in settings.values()) or server is BAD or planner is BAD:
            return None
        try:
            store_config = StoreConfig(
                tiers=chain, write_through=write_through, tenant_shares=shares, **settings
            )
        except KVLifeError as exc:
            self.bad(("store",), str(exc))
            return None
        assert not isinstance(server, _Bad) and not isinstance(planner, _Bad)
        return KVLifeConfig(
            source=source,
            store=store_config,
            path=self.file_path(path) if isinstance(path, str) else None,
            server=server,
            planner=planner,
            connector=connector,
        )

    def parity(self, value: object) -> tuple[int, int] | _Bad:
        where: KeyPath = ("store", "segment_parity")
        if (
            isinstance(value, list)
            and len(value) == 2
            and all(type(x) is int and x >= 1 for x in value)
            and value[0] + value[1] <= 32
        ):
            return (value[0], value[1])
        return self.bad(where, f"must be [k, m] with k, m >= 1 and k + m <= 32, got {value!r}")

    def tiers(self, value: object, serving: bool) -> tuple[tuple[TierSpec, ...] | None, bool]:
        """The chain and whether a tier asked for write-through."""
        if value is ...:
            self.bad(("tiers",), "required: at least one [[tiers]] table")
            return None, False
        if not isinstance(value, list) or not value:
            self.bad(("tiers",), "must be one or more [[tiers]] tables")
            return None, False
        specs: list[TierSpec | None] = []
        seen: set[str] = set()
        self.budgets = {}
        names_readable = True
        durable_seen = False
        write_through = False
        for i, raw in enumerate(value):
            path: KeyPath = ("tiers", i)
            t = self.table(raw, path, _TIER_KEYS)
            name = self.value(t, path, "name", str, ...)
            if isinstance(name, str):
                if not name:
                    name = self.bad((*path, "name"), "must not be empty")
                elif not TIER_NAME.fullmatch(name):
                    name = self.bad((*path, "name"), f"{name!r:.80}: {TIER_NAME_RULE}")
                elif name in seen:
                    name = self.bad((*path, "name"), f"tier {name!r} is named twice in the chain")
                else:
                    seen.add(name)
            kind = self.value(t, path, "kind", str, ...)
            if isinstance(kind, str):
                try:
                    tier_kind(kind)
                except InvalidArgument as exc:
                    kind = self.bad((*path, "kind"), str(exc))
            if serving and i == 0 and isinstance(kind, str) and kind not in VOLATILE_KINDS:
                self.bad(
                    (*path, "kind"),
                    f"kvlife serve keeps the first tier in shared memory: it must be "
                    f"memory or shm, got {kind!r}",
                )
            budget = self.value(t, path, "budget", "size", ...)
            if isinstance(budget, int) and budget <= 0:
                budget = self.bad((*path, "budget"), f"must be > 0, got {budget}")
            policy = self.value(t, path, "policy", str, "lru")
            if isinstance(policy, str):
                from kvlife.policy.base import policy_names

                if policy not in policy_names():
                    policy = self.bad(
                        (*path, "policy"),
                        f"unknown eviction policy {policy!r} (known: {', '.join(policy_names())})",
                    )
            transform, params = self.transform(t, path)
            volatile = isinstance(kind, str) and kind in VOLATILE_KINDS
            durability = self.value(t, path, "durability", Durability, "")
            if isinstance(durability, str) and durability and isinstance(kind, str):
                if volatile and durability != "volatile":
                    self.bad(
                        (*path, "durability"),
                        f"a {kind} tier is volatile: {durability} needs a durable kind",
                    )
                elif not volatile and durability == "volatile" and kind in _DURABLE_KINDS:
                    self.bad(
                        (*path, "durability"),
                        f"a {kind} tier is durable: write-back or write-through",
                    )
                elif durability == "write-through":
                    if kind != "disk":
                        # StoreConfig writes through onto a disk tier only; said here,
                        # on the tier's own line, not as a store-wide error.
                        self.bad(
                            (*path, "durability"),
                            f"write-through goes to a disk tier only; a {kind} tier is "
                            'written back (durability = "write-back")',
                        )
                    elif durable_seen:
                        self.bad(
                            (*path, "durability"),
                            "write-through goes to the first durable tier of the chain only",
                        )
                    write_through = True
            if isinstance(kind, str) and not volatile:
                durable_seen = True
            if isinstance(name, str) and self.budgets is not None:
                self.budgets[name] = budget if isinstance(budget, int) else None
            elif not (isinstance(t.get("name"), str) and t["name"]):
                names_readable = False  # a name twice is still a name quotas may use
            options = self.options(t.get("options", {}), (*path, "options"), kind)
            if (
                any(p is BAD for p in (name, kind, budget, policy))
                or isinstance(transform, _Bad)
                or isinstance(params, _Bad)
                or isinstance(options, _Bad)
            ):
                specs.append(None)
                continue
            try:
                specs.append(
                    TierSpec(
                        kind,
                        name,
                        budget,
                        policy,
                        options=options,
                        transform=transform,
                        transform_params=params,
                    )
                )
            except KVLifeError as exc:
                self.bad(path, str(exc))
                specs.append(None)
        if not names_readable:  # which tier a quota or seed means cannot be told
            self.budgets = None
        if any(s is None for s in specs):
            return None, write_through
        return tuple(s for s in specs if s is not None), write_through

    def transform(
        self, t: Mapping[str, Any], path: KeyPath
    ) -> tuple[str | _Bad, tuple[tuple[str, int | float | bool | str], ...] | _Bad]:
        transform = self.value(t, path, "transform", str, "")
        raw = t.get("transform_params", {})
        params = self.table(raw, (*path, "transform_params"), None)
        pairs: list[tuple[str, int | float | bool | str]] = []
        for key, value in params.items():
            if not isinstance(value, int | float | bool | str):
                self.bad((*path, "transform_params", key), f"must be a scalar, got {value!r}")
                return transform, BAD
            pairs.append((key, value))
        if not isinstance(transform, str):
            return transform, BAD
        if not transform:
            if pairs:
                return transform, self.bad((*path, "transform_params"), "without a transform")
            return transform, ()
        from kvlife.transforms.registry import make_transform, transform_names

        if transform not in transform_names():
            return self.bad(
                (*path, "transform"),
                f"unknown transform {transform!r} (known: {', '.join(transform_names())})",
            ), BAD
        try:
            make_transform(transform, dict(pairs))
        except KVLifeError as exc:
            return transform, self.bad((*path, "transform_params"), str(exc))
        return transform, tuple(sorted(pairs))

    def options(self, raw: object, path: KeyPath, kind: object) -> TierOptions | _Bad:
        """The kind's options class from the ``options`` table: every unknown option,
        missing one, value of the wrong type and broken invariant is reported."""
        given = self.table(raw, path, None)
        if not isinstance(kind, str):
            return BAD
        cls = tier_kind(kind).options
        fields = {f.name: f for f in dataclasses.fields(cls)}
        hints = typing.get_type_hints(cls)
        ok: dict[str, Any] = {}
        failed = unknown = False
        for key in given:
            if key not in fields:
                known = ", ".join(sorted(fields)) or "none"
                self.bad((*path, key), f"unknown option of a {kind} tier (known: {known})")
                unknown = True
                continue
            hint = "size" if key.endswith("_bytes") and hints[key] is int else hints[key]
            checked = self.value(given, path, key, hint, ...)
            if checked is BAD:
                failed = True  # left at its default to check the others' invariants
            else:
                ok[key] = checked
        for name, f in fields.items():
            if name not in given and f.default is dataclasses.MISSING:
                self.bad((*path, name), f"required by a {kind} tier")
                return BAD
        for name, f in fields.items():
            if name not in ok and name in given and f.default is dataclasses.MISSING:
                return BAD  # a required value of the wrong type: nothing to build
        # invariants: each broken one reported, then left at its default to find the next
        reported: set[str] = set()
        while True:
            try:
                options = cls(**ok)
                return BAD if unknown or failed or reported else options
            except TierOptionError as exc:
                if exc.field in reported or exc.field not in ok:
                    self.bad(path, str(exc))
                    return BAD
                reported.add(exc.field)
                self.bad((*path, exc.field), exc.problem)
                if fields[exc.field].default is dataclasses.MISSING:
                    return BAD
                del ok[exc.field]
            except KVLifeError as exc:
                self.bad(path, str(exc))
                return BAD

    def quotas(self, raw: object, tiers: dict[str, int | None] | None) -> Shares | None:
        """``[quotas]``: tenant -> {tier = bytes}."""
        table = self.table(raw, ("quotas",), None)
        out: list[tuple[str, tuple[tuple[str, int], ...]]] = []
        sums: dict[str, int] = {}
        last: dict[str, KeyPath] = {}
        failed = False
        for tenant, shares in table.items():
            path: KeyPath = ("quotas", tenant)
            try:
                _check_tenant(tenant)
            except InvalidArgument as exc:
                self.bad(path, str(exc))
                failed = True
            entries = self.table(shares, path, None)
            pairs = []
            for tier in entries:
                nbytes = self.value(entries, path, tier, "size", ...)
                if tiers is not None and tier not in tiers:
                    self.bad((*path, tier), f"no tier {tier!r} in the chain ({', '.join(tiers)})")
                    failed = True
                elif isinstance(nbytes, int):
                    pairs.append((tier, nbytes))
                    sums[tier] = sums.get(tier, 0) + nbytes
                    last[tier] = (*path, tier)
                else:
                    failed = True
            out.append((tenant, tuple(sorted(pairs))))
        for tier, total in sums.items():
            budget = tiers.get(tier) if tiers is not None else None
            if budget is not None and total > budget:
                self.bad(
                    last[tier],
                    f"the shares of tier {tier} add up to {total} bytes, more than its "
                    f"budget {budget}: one tenant's burst could evict another's objects",
                )
                failed = True
        return None if failed else tuple(out)

    def server(self, raw: object) -> ServerSettings | _Bad:
        path: KeyPath = ("server",)
        t = self.table(raw, path, _SERVER_KEYS)
        socket = self.value(t, path, "socket", str, None)
        staging = self.value(t, path, "staging_bytes", "size", ServerSettings().staging_bytes)
        shm_dir = self.value(t, path, "shm_dir", str, None)
        pid_file = self.value(t, path, "pid_file", str, None)
        cpus = self.cpus(t)
        limits = self.limits(t.get("limits", {}))
        principals = self.principals(t["principals"]) if "principals" in t else None
        events = self.kv_events(t["kv_events"]) if "kv_events" in t else None
        metrics = self.metrics(t)
        log_json = self.value(t, path, "log_json", bool, False)
        whole = self.value(t, path, "gc_whole_every_s", float, ServerSettings().gc_whole_every_s)
        if isinstance(whole, float) and (problem := whole_every_problem(whole)):
            whole = self.bad((*path, "gc_whole_every_s"), problem)
        event_log = self.value(t, path, "events", str, None)
        parts = (socket, staging, shm_dir, pid_file, cpus, limits, principals, events)
        if any(p is BAD for p in (*parts, metrics, log_json, event_log, whole)):
            return BAD
        assert isinstance(limits, Limits) and isinstance(cpus, tuple)
        assert not isinstance(principals, _Bad) and not isinstance(events, _Bad)
        assert not isinstance(metrics, _Bad)
        defaults = ServerSettings()
        return ServerSettings(
            socket=self.file_path(socket) if socket else None,
            staging_bytes=staging,
            shm_dir=self.file_path(shm_dir) if shm_dir else defaults.shm_dir,
            cpus=cpus,
            pid_file=self.file_path(pid_file) if pid_file else None,
            limits=limits,
            principals=principals,
            kv_events=events,
            metrics=metrics,
            log_json=log_json,
            gc_whole_every_s=whole,
            events=self.file_path(event_log) if event_log else None,
        )

    def metrics(self, t: Mapping[str, Any]) -> str | _Bad | None:
        """``metrics = "HOST:PORT"`` (or ``":PORT"``, ``"PORT"``; port 0: a free one)."""
        if "metrics" not in t:
            return None
        value = t["metrics"]
        if not isinstance(value, str):
            return self.bad(("server", "metrics"), f"must be 'HOST:PORT', got {value!r}")
        try:
            parse_address(value)
        except InvalidArgument as exc:
            return self.bad(("server", "metrics"), str(exc))
        return value

    def cpus(self, t: Mapping[str, Any]) -> tuple[int, ...] | _Bad:
        if "cpus" not in t:
            return ()
        value = t["cpus"]
        if isinstance(value, list) and all(type(c) is int and c >= 0 for c in value):
            return tuple(sorted(set(value)))
        if isinstance(value, str):
            from kvlife.server.server import parse_cpus

            try:
                return parse_cpus(value)
            except InvalidArgument as exc:
                return self.bad(("server", "cpus"), str(exc))
        return self.bad(
            ("server", "cpus"), f"must be '2-3', '0,2' or a list of ints, got {value!r}"
        )

    def limits(self, raw: object) -> Limits | _Bad:
        path: KeyPath = ("server", "limits")
        fields = {f.name: f for f in dataclasses.fields(Limits)}
        t = self.table(raw, path, set(fields))
        given: dict[str, Any] = {}
        failed = False
        for key in t:
            if key not in fields:
                failed = True
                continue
            default = fields[key].default
            hint = float if isinstance(default, float) else int
            value = self.value(t, path, key, hint, ...)
            if value is BAD:
                failed = True
            elif not value > 0:
                self.bad((*path, key), f"must be > 0, got {value}")
                failed = True
            else:
                given[key] = value
        if failed:
            return BAD
        try:
            return Limits(**given)
        except InvalidArgument as exc:
            return self.bad(path, str(exc))

    def principals(self, raw: object) -> TenancyConfig | _Bad:
        path: KeyPath = ("server", "principals")
        t = self.table(raw, path, None)
        failed = False
        for name, spec in t.items():
            if isinstance(spec, dict) and "shares" in spec:
                self.bad((*path, name, "shares"), "quotas go in the [quotas] table")
                failed = True
                continue
            try:
                parse_config({"principal": {name: spec}})
            except InvalidArgument as exc:
                self.bad(self._principal_key(path, name, spec), str(exc))
                failed = True
        if failed:
            return BAD
        if not t:
            return self.bad(path, "names no principal")
        try:
            return parse_config({"principal": t})
        except InvalidArgument as exc:
            return self.bad(path, str(exc))

    @staticmethod
    def _principal_key(path: KeyPath, name: str, spec: object) -> KeyPath:
        """The key of a principal's table that is wrong on its own (the table itself when
        none is, or the name is)."""
        if not isinstance(spec, dict):
            return (*path, name)
        try:
            parse_config({"principal": {name: {}}})
        except InvalidArgument:
            return (*path, name)  # the name itself
        for key, value in spec.items():
            alone = {key: value}
            if key == "token_expires" and "token_sha256" in spec:
                alone["token_sha256"] = spec["token_sha256"]
            try:
                parse_config({"principal": {name: alone}})
            except InvalidArgument:
                return (*path, name, key)
        return (*path, name)

    def kv_events(self, raw: object) -> KVEventsConfig | _Bad:
        path: KeyPath = ("server", "kv_events")
        known = {f.name for f in dataclasses.fields(KVEventsConfig)}
        t = self.table(raw, path, known)
        values: dict[str, Any] = {}
        hints = typing.get_type_hints(KVEventsConfig)
        failed = False
        for key in known:
            value = self.value(t, path, key, hints[key], ... if key == "endpoint" else None)
            if value is BAD:
                failed = True
            elif value is not None:
                values[key] = value
        for key in ("endpoint", "replay_endpoint"):
            v = values.get(key)
            if isinstance(v, str) and not v.startswith(("tcp://", "ipc://", "inproc://")):
                self.bad((*path, key), f"must be tcp://, ipc:// or inproc://..., got {v!r}")
                failed = True
        if failed:
            return BAD
        try:
            return KVEventsConfig(**values)
        except InvalidArgument as exc:
            return self.bad(path, str(exc))

    def planner(self, raw: object, tiers: dict[str, int | None] | None) -> PlannerSettings | _Bad:
        path: KeyPath = ("planner",)
        t = self.table(raw, path, {"prefill_profile", "tiers"})
        profile = self.value(t, path, "prefill_profile", str, ...)
        failed = profile is BAD
        if isinstance(profile, str):
            from kvlife.planner import PrefillProfile

            try:
                PrefillProfile.load(self.file_path(profile))
            except InvalidArgument as exc:
                self.bad((*path, "prefill_profile"), str(exc))
                failed = True
        seeds = []
        table = self.table(t.get("tiers", {}), (*path, "tiers"), None)
        for name, spec in table.items():
            where: KeyPath = (*path, "tiers", name)
            if tiers is not None and name not in tiers:
                self.bad(where, f"no tier {name!r} in the chain ({', '.join(tiers)})")
                failed = True
            s = self.table(spec, where, {"latency_s", "bytes_per_s"})
            latency = self.value(s, where, "latency_s", float, 0.0)
            rate = self.value(s, where, "bytes_per_s", float, ...)
            if isinstance(latency, float) and latency < 0:
                latency = self.bad((*where, "latency_s"), f"must be >= 0, got {latency}")
            if isinstance(rate, float) and rate <= 0:
                rate = self.bad((*where, "bytes_per_s"), f"must be > 0, got {rate}")
            if latency is BAD or rate is BAD:
                failed = True
            else:
                seeds.append(TierSeed(name, latency, rate))
        if failed:
            return BAD
        assert isinstance(profile, str)
        return PlannerSettings(self.file_path(profile), tuple(seeds))

    def connector(
        self, raw: object, has_server: bool, path: object
    ) -> tuple[tuple[str, object], ...]:
        where: KeyPath = ("vllm",)
        t = self.table(raw, where, set(CONNECTOR_KEYS))
        out: list[tuple[str, object]] = []
        for key, hint in CONNECTOR_KEYS.items():
            value = self.value(t, where, key, hint, None)
            if value is None or value is BAD:
                continue
            problem = _connector_problem(key, value, has_server, path)
            if problem:
                self.bad((*where, key), problem)
                continue
            if key == "events":  # a path, relative to the file's directory
                value = str(self.file_path(str(value)))
            out.append((f"kvlife.{key}", value))
        return tuple(out)


def _connector_problem(key: str, value: object, has_server: bool, path: object) -> str:
    if key in ("chunk_tokens", "load_timeout_ms") and isinstance(value, int) and value <= 0:
        return f"must be > 0, got {value}"
    if key == "namespace":
        try:
            Namespace.parse(str(value))
        except InvalidArgument as exc:
            return str(exc)
    if key == "salt_kind" and value not in {k.value for k in NamespaceKind}:
        return f"must be one of {', '.join(k.value for k in NamespaceKind)}, got {value!r}"
    if key == "events" and not value:
        return "must name a file (JSON lines, or .parquet)"
    if key == "store":
        if value not in ("served", "embedded"):
            return f"must be 'served' or 'embedded', got {value!r}"
        if value == "served" and not has_server:
            return "'served' needs a [server] table (its socket)"
        if value == "embedded" and not isinstance(path, str):
            return "'embedded' needs [store] path"
    return ""


def _check_tenant(tenant: str) -> None:
    if tenant == PUBLIC_TENANT:
        return
    kind, sep, name = tenant.partition(":")
    if not sep or kind not in ("user", "organisation"):
        raise InvalidArgument(
            f"tenant {tenant!r} must be 'public', 'user:NAME' or 'organisation:NAME'"
        )
    check_name(f"tenant {kind}", name)


_STORE_OPTIONS: dict[str, tuple[Any, Any]] = {
    "promote_on_hit": (bool, True),
    "verify_dram_on_load": (bool, False),
    "io_threads": (int, 4),
}
_STORE_KEYS = {"path", "segment_parity", *_STORE_OPTIONS}
_TIER_KEYS = {
    "name",
    "kind",
    "budget",
    "policy",
    "transform",
    "transform_params",
    "durability",
    "options",
}
_SERVER_KEYS = {
    "socket",
    "staging_bytes",
    "shm_dir",
    "cpus",
    "pid_file",
    "limits",
    "principals",
    "kv_events",
    "metrics",
    "log_json",
    "gc_whole_every_s",
    "events",
}
_DURABLE_KINDS = frozenset({"disk", "redis", "mooncake"})


def _kind(value: object) -> str:
    return {dict: "a table", list: "an array", str: "a string", bool: "a bool"}.get(
        type(value), type(value).__name__
    )

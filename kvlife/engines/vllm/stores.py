"""The store a vLLM connector talks to, named by ``kv_connector_extra_config``.

vLLM builds one connector in its scheduler and one in every worker; with its default
multiprocess executors those are separate processes, and all of them must see one
store. Two ways to name it:

- ``{"kvlife.socket": S}``: a client of the store ``kvlife serve`` serves on the Unix
  socket ``S`` (``kvlife.client.RemoteStore``); any number of processes.
- ``{"kvlife.path": P}``: a store embedded in this process, opened once and shared by
  every connector instance of the process through :data:`_EMBEDDED` (vLLM in one
  process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the ``uni`` executor). When another
  process holds ``P`` the open is refused with :class:`EmbeddedStoreInUse`, which says
  to use ``kvlife serve`` instead.
- ``{"kvlife.config": F}``: a configuration file (:mod:`kvlife.ops.config`,
  docs/operations.md): its ``[server]`` socket (served) or its ``[store]`` path with its
  whole chain (embedded; ``[vllm] store`` chooses when it has both), and its ``[vllm]``
  table as defaults of the other ``kvlife.*`` keys (:func:`resolve_extra_config`).

``{"kvlife.events": F}`` beside an embedded store writes its lifecycle events to ``F``
(schema v1, :mod:`kvlife.core.events`; JSON lines appended, or Parquet when ``F`` ends
in ``.parquet``): every move of the chunks the connectors of the process put, load,
evict and invalidate, as the store emits them, for ``kvlife report --events``. A served
store's events are the server's (the connector only sees its client API), so it is
refused there.

Both are used through the public ``KVStore`` API only (lookup, prepare_put, put_async,
commit_put, abort_put, load_async, counters), so either works.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvlife.core.errors import InvalidArgument, StoreLockedError
from kvlife.core.events import EventSink, LifecycleEvent, fan_out
from kvlife.engines.errors import EngineError
from kvlife.store.api import StoreAPI as _StoreAPI
from kvlife.store.config import StoreConfig

if TYPE_CHECKING:  # the configuration file's modules are read only when one is named
    from kvlife.ops.config import KVLifeConfig

MiB = 1 << 20
DEFAULT_DRAM = 256 * MiB
DEFAULT_DISK = 4096 * MiB


StoreAPI = _StoreAPI[Any]
"""A ``KVStore`` or a ``RemoteStore`` (:class:`kvlife.store.api.StoreAPI`; the connector
keeps their pending puts opaque)."""


class EmbeddedStoreInUse(EngineError):
    """``kvlife.path`` names a store another process holds: vLLM's scheduler and workers
    run in separate processes, so they must share a served store (``kvlife.socket``)."""


@dataclass(frozen=True, slots=True)
class StoreAddress:
    """Where the connector's store is: exactly one of ``socket`` and ``path``."""

    socket: str = ""
    """Unix socket of ``kvlife serve``."""
    path: str = ""
    """Directory of a store embedded in this process."""
    dram_bytes: int = DEFAULT_DRAM
    """Embedded store: DRAM tier budget."""
    disk_bytes: int = DEFAULT_DISK
    """Embedded store: disk tier budget."""
    write_through: bool = False
    """Embedded store: every put durable on disk before it completes."""
    store: StoreConfig | None = None
    """Embedded store: its settings from a configuration file (overrides the sizes)."""
    events: str = ""
    """Embedded store: file its lifecycle events are written to (empty: none)."""
    token_file: str = ""
    """Served store with principals (``kvlife serve --tenants``): a file holding the
    token of the principal the engine is, where its Unix user does not say which (a
    file, not the token itself: vLLM logs its connector config)."""
    direct_reads: bool = True
    """Served store: the workers read their disk hits' frames from the server's segment
    files themselves, verified, while the server confirms them
    (``RemoteStore(direct_reads=True)``, docs/server.md, "Direct disk reads"); a server
    with principals names no frames, and a frame this process cannot open or verify is
    loaded through the server. ``kvlife.direct_reads: false`` loads every disk hit
    through the server."""

    def __post_init__(self) -> None:
        if bool(self.socket) == bool(self.path):
            raise InvalidArgument(
                "kv_connector_extra_config must name the kvlife store by exactly one of "
                f"'kvlife.socket' (kvlife serve) and 'kvlife.path' (embedded); got "
                f"socket={self.socket!r}, path={self.path!r}"
            )
        if self.events and not self.path:
            raise InvalidArgument(
                "kvlife.events logs the events of an embedded store (kvlife.path); a "
                "served store's events are the server's, its clients do not see them"
            )
        if not isinstance(self.direct_reads, bool):
            raise InvalidArgument(f"kvlife.direct_reads must be a bool, got {self.direct_reads!r}")
        if self.token_file and not self.socket:
            raise InvalidArgument(
                "kvlife.token_file names a principal of a served store (kvlife.socket); "
                "an embedded store (kvlife.path) has no principals"
            )

    def without_direct_reads(self) -> StoreAddress:
        """This address for a store whose lookups should name no disk frames: one
        that loads nothing (the vLLM scheduler side only counts hits) or only into
        buffers direct reads cannot fill (the SGLang backend). A lookup that names its
        disk hits' frames costs the server and the client more (a 128-chunk prompt all
        on disk: 1.28 ms against 0.55 ms, 2026-12-07)."""
        return replace(self, direct_reads=False)

    def token(self) -> str | None:
        """The token in :attr:`token_file` (None: none named)."""
        if not self.token_file:
            return None
        try:
            token = Path(self.token_file).read_text().strip()
        except OSError as exc:
            raise InvalidArgument(
                f"kvlife.token_file {self.token_file!r} cannot be read: {exc}"
            ) from exc
        if not token:
            raise InvalidArgument(f"kvlife.token_file {self.token_file!r} is empty")
        return token

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any], config: KVLifeConfig | None = None
    ) -> StoreAddress:
        """Where the store is: ``kvlife.socket`` or ``kvlife.path`` as given, else the
        configuration file's (``config``, from :func:`resolve_extra_config`)."""
        if config is not None:
            return cls._from_file(extra, config)
        if "kvlife.store" in extra:
            raise InvalidArgument("kvlife.store chooses within kvlife.config: give both")

        def size(name: str, default: int) -> int:
            value = extra.get(name, default // MiB)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgument(f"{name} must be a size in MiB (int >= 0), got {value!r}")
            return value * MiB

        wt = extra.get("kvlife.write_through", False)
        if not isinstance(wt, bool):
            raise InvalidArgument(f"kvlife.write_through must be a bool, got {wt!r}")
        return cls(
            socket=str(extra.get("kvlife.socket", "") or ""),
            path=str(extra.get("kvlife.path", "") or ""),
            dram_bytes=size("kvlife.dram_mib", DEFAULT_DRAM),
            disk_bytes=size("kvlife.disk_mib", DEFAULT_DISK),
            write_through=wt,
            events=str(extra.get("kvlife.events", "") or ""),
            token_file=str(extra.get("kvlife.token_file", "") or ""),
            direct_reads=extra.get("kvlife.direct_reads", True),
        )

    @classmethod
    def _from_file(cls, extra: Mapping[str, Any], config: KVLifeConfig) -> StoreAddress:
        sized = sorted(k for k in _SIZED if k in extra)
        if sized:
            raise InvalidArgument(
                f"{', '.join(sized)}: the store's tiers come from kvlife.config "
                f"({config.source}); set them there"
            )
        socket = str(extra.get("kvlife.socket", "") or "")
        path = str(extra.get("kvlife.path", "") or "")
        events = str(extra.get("kvlife.events", "") or "")
        direct = extra.get("kvlife.direct_reads", True)
        if socket or path:  # named explicitly: over the file's choice
            store = config.store if path else None
            return cls(socket=socket, path=path, store=store, events=events, direct_reads=direct)
        mode = extra.get("kvlife.store") or ("served" if config.server else "embedded")
        if mode == "served":
            if config.server is None:
                raise InvalidArgument(f"{config.source}: kvlife.store 'served' needs [server]")
            sock = config.server.socket or config.store_path() / "serve.sock"
            return cls(socket=str(sock), events=events, direct_reads=direct)
        if mode != "embedded":
            raise InvalidArgument(f"kvlife.store must be 'served' or 'embedded', got {mode!r}")
        return cls(path=str(config.store_path()), store=config.store, events=events)


_SIZED = ("kvlife.dram_mib", "kvlife.disk_mib", "kvlife.write_through")
"""Keys that size an embedded store: with a configuration file its chain says."""


def resolve_extra_config(
    extra: Mapping[str, Any],
) -> tuple[dict[str, Any], KVLifeConfig | None]:
    """``kv_connector_extra_config`` with the ``[vllm]`` table of its ``kvlife.config``
    file (if any) as defaults under the keys given, and the file's configuration
    (:class:`~kvlife.ops.config.ConfigError` listing every error of a bad file)."""
    name = extra.get("kvlife.config")
    if not name:
        return dict(extra), None
    from kvlife.ops.config import load_file

    config = load_file(str(name))
    return {**config.connector_extra(), **extra}, config


class FanoutSink(EventSink):
    """Lifecycle events of an embedded store, handed to every subscribed queue (each
    connector drains its own with ``take``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[int, list[LifecycleEvent]] = {}

    def subscribe(self) -> int:
        with self._lock:
            token = len(self._queues) + 1
            while token in self._queues:
                token += 1
            self._queues[token] = []
            return token

    def unsubscribe(self, token: int) -> None:
        with self._lock:
            self._queues.pop(token, None)

    def emit(self, event: LifecycleEvent) -> None:
        with self._lock:
            for queue in self._queues.values():
                queue.append(event)

    def take(self, token: int) -> list[LifecycleEvent]:
        with self._lock:
            got = self._queues.get(token)
            if not got:
                return []
            self._queues[token] = []
            return got


@dataclass(slots=True)
class _Embedded:
    store: StoreAPI
    sink: FanoutSink
    events: str = ""
    """The event file the store writes (``kvlife.events``; empty: none)."""
    log: EventSink | None = None
    users: int = 0

    def close(self) -> None:
        self.store.close()
        if self.log is not None:  # after the store: its closing moves are logged too
            self.log.close()


@dataclass(slots=True)
class StoreLease:
    """One connector's use of a store; ``release()`` once when the connector shuts down."""

    store: StoreAPI
    """A ``KVStore`` or ``RemoteStore``."""
    address: StoreAddress
    events: FanoutSink | None = None
    """Lifecycle events of an embedded store (a served store keeps its own)."""
    token: int = 0
    released: bool = field(default=False)

    def take_events(self) -> list[LifecycleEvent]:
        return self.events.take(self.token) if self.events is not None else []

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        if self.address.socket:
            self.store.close()
            return
        _release_embedded(self.address.path, self.token)


_EMBEDDED: dict[Path, _Embedded] = {}
"""Embedded stores open in this process, by resolved directory."""
_EMBEDDED_LOCK = threading.Lock()


def open_store(address: StoreAddress) -> StoreLease:
    """A lease on the store at ``address`` (connects, or opens/shares the embedded one)."""
    if address.socket:
        from kvlife.client import RemoteStore

        remote: StoreAPI = RemoteStore(
            address.socket, token=address.token(), direct_reads=address.direct_reads
        )
        return StoreLease(remote, address)
    path = Path(address.path).resolve()
    with _EMBEDDED_LOCK:
        held = _EMBEDDED.get(path)
        events = str(Path(address.events).resolve()) if address.events else ""
        if held is not None and held.events != events:
            raise InvalidArgument(
                f"kvlife.path {path} is open in this process with kvlife.events "
                f"{held.events or '(none)'}; a connector asked for {events or '(none)'}: "
                "the connectors of one process share one store and one event log"
            )
        if held is None:
            from kvlife.store import KVStore
            from kvlife.trace.events_io import open_event_file

            sink = FanoutSink()
            try:
                log = open_event_file(events, append=True) if events else None
            except OSError as exc:
                raise InvalidArgument(f"kvlife.events {events}: cannot be written: {exc}") from exc
            store_sink: EventSink = sink if log is None else fan_out(sink, log)
            try:
                if address.store is not None:
                    store = KVStore(path, address.store, sink=store_sink)
                else:
                    store = KVStore.open(
                        path,
                        dram_bytes=address.dram_bytes,
                        disk_bytes=address.disk_bytes,
                        write_through=address.write_through,
                        sink=store_sink,
                    )
            except BaseException as exc:
                if log is not None:
                    log.close()
                if not isinstance(exc, StoreLockedError):
                    raise
                raise EmbeddedStoreInUse(
                    f"kvlife.path {path} is held by another process ({exc}). vLLM runs its "
                    "scheduler and workers in separate processes unless "
                    "VLLM_ENABLE_V1_MULTIPROCESSING=0 with the uni executor; otherwise run "
                    "`kvlife serve` on that directory and pass kvlife.socket"
                ) from exc
            held = _EMBEDDED[path] = _Embedded(store, sink, events, log)
        held.users += 1
        token = held.sink.subscribe()
        return StoreLease(held.store, address, held.sink, token)


def _release_embedded(path_text: str, token: int) -> None:
    path = Path(path_text).resolve()
    with _EMBEDDED_LOCK:
        held = _EMBEDDED.get(path)
        if held is None:
            return
        held.sink.unsubscribe(token)
        held.users -= 1
        if held.users > 0:
            return
        del _EMBEDDED[path]
    held.close()


def close_all() -> None:
    """Close every embedded store of this process (flushed: write-back DRAM reaches
    disk, the lock is released). Runs by itself when the interpreter exits, so an engine
    that exits without shutting its connectors down loses nothing it stored."""
    with _EMBEDDED_LOCK:
        held = list(_EMBEDDED.values())
        _EMBEDDED.clear()
    for h in held:
        h.close()


# Interpreter exit joins thread pools (the store's writers among them) before atexit
# handlers run; threading's own exit hooks run before that join, last registered first.
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(close_all)
else:  # pragma: no cover - every CPython since 3.9 has it
    atexit.register(close_all)

"""Structured logs: one line per lifecycle-significant event of a store or a server
(start, recovery, quarantine, corruption caught, loss, fencing, stop), human text by
default and one JSON object per line on request (``kvlife serve --log-json``).

Every line goes through the standard library's :mod:`logging` under one logger
namespace, ``kvlife`` (``kvlife.serve`` for the server, ``kvlife.store`` for what the
store's lifecycle events report, ``kvlife.globalindex.index`` for a fenced publication),
so an application embedding the store routes them as it routes its own logs. A line is
an *event* name and its *fields* (:func:`log_event`); the formatters render the same record as
``2026-12-02T08:00:00Z kvlife serve: start pid=12 socket=...`` or as
``{"time": ..., "level": "info", "logger": "kvlife.serve", "event": "start", "pid": 12, ...}``.

:func:`configure` installs the handler behind a queue: the caller's thread (a store
thread holding the index lock, for a corruption caught) only enqueues the record, and
one listener thread writes it, so a slow or blocked stderr never stalls the store.

:class:`LogSink` is the event sink that turns the store's lifecycle events into log
lines: an object invalidated as corrupt (``corrupt``) and an object lost because its
demotion failed (``loss``). A namespace is logged as its aggregated label
(:func:`namespace_label`), never a tenant's name.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import queue
import time
from typing import Any, TextIO

from kvlife.core.events import EventSink, LifecycleEvent

LOGGER = "kvlife"
"""The one logger namespace of kvlife's logs."""

_EVENT = "kvlife_event"
_FIELDS = "kvlife_fields"


def log_event(
    logger: logging.Logger, event: str, level: int = logging.INFO, **fields: object
) -> None:
    """One structured line: ``event`` and its ``fields`` (rendered by the formatters)."""
    if logger.isEnabledFor(level):
        logger.log(level, event, extra={_EVENT: event, _FIELDS: fields})


def _stamp(created: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))


def _who(name: str) -> str:
    """``kvlife.serve`` -> ``kvlife serve`` (the prefix the server's lines always had)."""
    return name.replace(".", " ", 1)


class HumanFormatter(logging.Formatter):
    """``<UTC time> kvlife serve: <event> key=value ...`` (a plain message as it is)."""

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, object] = getattr(record, _FIELDS, {})
        text = " ".join([record.getMessage(), *(f"{k}={v}" for k, v in fields.items())])
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return f"{_stamp(record.created)} {_who(record.name)}: {text}"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``time`` (UTC, ISO 8601), ``level``, ``logger``,
    ``event`` and the event's fields (a plain message: event ``message``, field
    ``message``)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": _stamp(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        event = getattr(record, _EVENT, None)
        if event is None:
            out["event"] = "message"
            out["message"] = record.getMessage()
        else:
            out["event"] = event
            for k, v in getattr(record, _FIELDS, {}).items():
                out.setdefault(k, v)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, separators=(",", ":"))


class Logging:
    """The handler :func:`configure` installed; :meth:`close` writes what is queued,
    removes it and gives the ``kvlife`` logger back its level and propagation."""

    def __init__(
        self,
        handler: logging.Handler,
        listener: logging.handlers.QueueListener,
        before: tuple[int, bool],
    ) -> None:
        self._handler = handler
        self._listener = listener
        self._before = before

    def flush(self) -> None:
        """Write every record queued so far (the writer thread stops after them and a
        new one starts)."""
        self._listener.stop()
        self._listener.start()

    def close(self) -> None:
        global _active
        if _active is self:
            _active = None
        self._listener.stop()  # writes every queued record first
        logger = logging.getLogger(LOGGER)
        logger.removeHandler(self._handler)
        logger.setLevel(self._before[0])
        logger.propagate = self._before[1]


def configure(stream: TextIO, *, json_lines: bool = False) -> Logging:
    """Send the ``kvlife`` loggers' INFO and above to ``stream``, human or JSON, through
    a queue and one writer thread. The logger does not propagate to the root logger
    (the lines would be written twice by an application that logs to stderr too)."""
    q: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    out = logging.StreamHandler(stream)
    out.setFormatter(JsonFormatter() if json_lines else HumanFormatter())
    listener = logging.handlers.QueueListener(q, out)
    handler = _RecordQueue(q)
    logger = logging.getLogger(LOGGER)
    before = (logger.level, logger.propagate)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.addHandler(handler)
    listener.start()
    global _active
    _active = Logging(handler, listener, before)
    return _active


_active: Logging | None = None
"""The handler :func:`configure` installed last (None: none, or closed)."""


def flush_logs() -> None:
    """Write every line logged so far through :func:`configure`'s queue (nothing to do
    when none is configured): a server calls it before it says it is ready."""
    if _active is not None:
        _active.flush()


class _RecordQueue(logging.handlers.QueueHandler):
    """A QueueHandler that enqueues the record itself (the formatter runs on the writer
    thread and needs the event's fields, which ``prepare`` would drop)."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        return record


def namespace_label(namespace: str, tenants: bool) -> str:
    """A namespace as logs and metrics name it: ``public``; ``request`` for every request
    namespace (one per request: never a label each); on a server with principals every
    other namespace is a tenant's keyed one and is ``tenants`` (never a tenant's name);
    otherwise the namespace itself (``organisation:acme``)."""
    kind = namespace.partition(":")[0]
    if kind in ("public", "request"):
        return kind
    return "tenants" if tenants else namespace


class LogSink(EventSink):
    """Lifecycle events worth a log line: ``corrupt`` (an object invalidated because a
    replica failed verification) and ``loss`` (an object dropped because its demotion
    failed). Called under the store's lock: it only enqueues (see :func:`configure`)."""

    def __init__(self, tenants: bool = False, logger: str = LOGGER + ".store") -> None:
        self.tenants = tenants
        self.log = logging.getLogger(logger)

    def kinds(self) -> frozenset[str]:
        return frozenset({"corrupt", "invalidate"})

    def emit(self, event: LifecycleEvent) -> None:
        if event.kind == "corrupt":
            name = "corrupt"
        elif event.kind == "invalidate" and "failed" in event.reason:
            name = "loss"
        else:
            return
        log_event(
            self.log,
            name,
            logging.WARNING,
            key=event.key,
            state=event.state,
            tier=event.tier,
            namespace=namespace_label(event.namespace, self.tenants),
            reason=event.reason,
            seq=event.seq,
        )

"""Prometheus metrics of a kvlife store or server (needs the ``ops`` extra:
prometheus-client).

Everything is read at scrape time from what the store and the server keep anyway, so the
hot path pays nothing for it: the store's counters since it opened
(:class:`~kvlife.results.StoreCounters`), each tier's figures, one pass over the index for
objects and bytes per lifecycle state and per namespace
(:meth:`~kvlife.store.facade.KVStore.namespace_figures`), and on a server its sessions,
leases and the latency histograms it observes per request (:mod:`kvlife.server.live`). The
collectors are registered on a registry of their own, never prometheus-client's global
one, so two stores in one process export separately.

Namespaces are labels as :func:`kvlife.core.logs.namespace_label` names them: on a server
with principals every tenant's keyed namespace is one label value, ``tenants``, never a
tenant's name; request namespaces are always ``request``. docs/operations.md lists every
metric.

``registry_for(store)`` is the embedded store's registry; :func:`serve` serves a registry
on ``http://HOST:PORT/metrics`` from a daemon thread (port 0: a free one).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from kvlife.core.errors import InvalidArgument, StoreClosedError
from kvlife.core.lifecycle import ObjectState
from kvlife.core.logs import namespace_label
from kvlife.results import StoreCounters, TierCounters
from kvlife.server.live import LATENCY_BOUNDS, LiveFigures
from kvlife.store.facade import KVStore
from kvlife.tiers.base import Tier

if TYPE_CHECKING:
    from kvlife.server.session import ServerState

PREFIX = "kvlife_"

STORE_COUNTERS: dict[str, tuple[str, str]] = {
    "puts": ("puts", "put_prompt and commit_put calls that committed"),
    "chunks_stored": ("chunks_stored", "chunks newly stored by puts"),
    "chunks_already_present": ("chunks_already_present", "chunks a put found indexed"),
    "chunks_dropped": ("chunks_dropped", "chunks a put could not place in any tier"),
    "events_dropped": (
        "events_dropped",
        "lifecycle events the event sink failed to take (the moves happened)",
    ),
    "write_through_failed": (
        "write_through_failed_chunks",
        "new chunks of write-through puts dropped because they could not be made durable",
    ),
    "deletes_failed": (
        "deletes_failed_replicas",
        "replicas out of service whose delete failed (retried at close)",
    ),
    "lookups": ("lookups", "lookups"),
    "lookup_chunks_hit": ("lookup_hit_chunks", "chunks lookups found indexed"),
    "lookup_chunks_miss": ("lookup_miss_chunks", "chunks lookups did not find"),
    "lookup_chunks_refused": ("lookup_refusals", "lookups that ended at a refused replica"),
    "loads": ("loads", "loads"),
    "bytes_loaded": ("loaded_bytes", "bytes served by loads"),
    "corrupt": ("corrupt_replicas", "replicas caught failing verification (dropped)"),
    "corrupt_frames": ("corrupt_frames", "transform frames that failed verification"),
    "direct_loads": ("direct_loaded_chunks", "chunks clients read from disk frames themselves"),
    "frame_loads": ("frame_loaded_chunks", "chunks loads read from disk frames without pins"),
    "sealed_mismatch": ("sealed_mismatches", "replicas in memory changed after their seal"),
    "read_errors": ("read_errors", "chunk reads that failed with an I/O error (a miss)"),
    "vanished": ("vanished_chunks", "chunks invalidated or evicted between lookup and load"),
    "unknown_transform": ("unknown_transform_chunks", "replicas of a transform not known"),
    "demotions": ("demotions", "replicas copied to the next tier before eviction"),
    "demote_failed": ("demotion_failures", "objects dropped because their demotion failed"),
    "promotions": ("promotions", "slower tiers' hits copied into the first tier"),
    "promote_failed": ("promotion_failures", "promotions that failed (source kept)"),
    "invalidated": ("invalidated_objects", "objects invalidated"),
    "evicted": ("evicted_objects", "objects dropped when their last replica was evicted"),
    "recovered": ("recovered_objects", "objects recovered at open"),
    "recovery_dropped": ("recovery_dropped_objects", "rows quarantined at open"),
    "aborted": ("aborted_objects", "TENTATIVE objects aborted"),
    "encoded": ("encoded_replicas", "replicas encoded for a transforming tier"),
    "decoded": ("decoded_replicas", "framed replicas decoded"),
    "segments_rebuilt": ("segments_rebuilt", "lost segment files rebuilt from parity"),
    "segments_unrecoverable": ("segments_unrecoverable", "lost segment files parity could not"),
}
"""Every StoreCounters field -> (metric name without ``kvlife_``/``_total``, help)."""

TIER_COUNTERS: dict[str, tuple[str, str]] = {
    "loaded": ("tier_hits", "chunks served to loads from this tier"),
    "bytes_loaded": ("tier_loaded_bytes", "bytes served to loads from this tier"),
    "stored": ("tier_stored_replicas", "replicas written into this tier"),
    "evictions": ("tier_evictions", "replicas evicted from this tier to make room"),
    "invalidated_bytes": ("tier_invalidated_bytes", "bytes this tier gave back to invalidations"),
}
"""Every TierCounters field -> (metric name without ``kvlife_``/``_total``, labelled by
tier, help)."""

SERVER_EVENTS = ("accept_errors", "body_timeouts", "unreplied_errors", "internal_errors")


@dataclass(frozen=True, slots=True)
class StoreCollector:
    """The store's figures at scrape time (a prometheus-client custom collector)."""

    store: KVStore
    tenants: bool = False
    """A server with principals: tenants' namespaces are aggregated (``tenants``)."""

    def describe(self) -> list[Metric]:
        return []  # figures change with the store: described at each scrape only

    def _label(self, namespace: str) -> str:
        return namespace_label(namespace, self.tenants)

    def collect(self) -> Iterator[Metric]:
        store = self.store
        try:
            counters = store.counters
            names = list(store.tier_names)
            tiers = [store.tier(n) for n in names]
            spaces, tentative = store.namespace_figures(self._label)
        except StoreClosedError:
            return
        yield from _tier_gauges(names, tiers)
        yield from _counters(counters, names)
        objects = GaugeMetricFamily(
            PREFIX + "objects",
            "objects by lifecycle state and namespace",
            labels=["state", "namespace"],
        )
        nbytes = GaugeMetricFamily(
            PREFIX + "object_bytes",
            "bytes of the objects (exact size) by lifecycle state and namespace",
            labels=["state", "namespace"],
        )
        held = GaugeMetricFamily(
            PREFIX + "namespace_bytes",
            "bytes of replicas held in each tier, by namespace",
            labels=["tier", "namespace"],
        )
        for ns, (by_state, bytes_by_state, by_tier) in sorted(spaces.items()):
            for state in ObjectState:
                if state is ObjectState.TENTATIVE:
                    continue
                objects.add_metric([state.value, ns], by_state.get(state.value, 0))
                nbytes.add_metric([state.value, ns], bytes_by_state.get(state.value, 0))
            for tier in names:
                held.add_metric([tier, ns], by_tier.get(tier, 0))
        yield objects
        yield nbytes
        yield held
        yield GaugeMetricFamily(
            PREFIX + "tentative_objects",
            "objects being put (TENTATIVE: not yet visible, in no namespace's figures)",
            value=tentative,
        )


def _tier_gauges(names: Sequence[str], tiers: Sequence[Tier]) -> Iterator[Metric]:
    cap = GaugeMetricFamily(PREFIX + "tier_capacity_bytes", "budget of the tier", labels=["tier"])
    used = GaugeMetricFamily(PREFIX + "tier_used_bytes", "bytes the tier holds", labels=["tier"])
    reps = GaugeMetricFamily(PREFIX + "tier_replicas", "replicas the tier holds", labels=["tier"])
    for name, tier in zip(names, tiers, strict=True):
        cap.add_metric([name], tier.capacity_bytes)
        used.add_metric([name], tier.used_bytes)
        reps.add_metric([name], len(tier.replica_keys()))
    yield cap
    yield used
    yield reps


def _counters(c: StoreCounters, names: Sequence[str]) -> Iterator[Metric]:
    for field, (name, text) in STORE_COUNTERS.items():
        yield CounterMetricFamily(PREFIX + name, text, value=getattr(c, field))
    per_tier = {n: c.per_tier.get(n, TierCounters()) for n in names}
    for field, (name, text) in TIER_COUNTERS.items():
        fam = CounterMetricFamily(PREFIX + name, text, labels=["tier"])
        for tier, tc in per_tier.items():
            fam.add_metric([tier], getattr(tc, field))
        yield fam
    # a tier misses a chunk asked of the chain that it did not serve: a slower tier
    # served it, or no tier held it (a lookup miss)
    misses = CounterMetricFamily(
        PREFIX + "tier_misses",
        "chunks asked of the chain this tier did not serve (a slower tier did, or none)",
        labels=["tier"],
    )
    below = c.lookup_chunks_miss
    for tier in reversed(names):
        misses.add_metric([tier], below)
        below += per_tier[tier].loaded
    yield misses


@dataclass(frozen=True, slots=True)
class ServerCollector:
    """A server's sessions, leases and request latencies at scrape time."""

    state: ServerState
    live: LiveFigures

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        state = self.state
        with state.lock:
            sessions = list(state.sessions.values())
            released = (state.released_puts, state.released_loads)
            events = dict(state.events)
        yield GaugeMetricFamily(
            PREFIX + "client_connections", "client sessions", value=len(sessions)
        )
        leases = GaugeMetricFamily(
            PREFIX + "leases", "what clients hold now, by kind", labels=["kind"]
        )
        leases.add_metric(["load"], sum(len(s.loads.grants) for s in sessions))
        leases.add_metric(["put"], sum(len(s.puts.pending) for s in sessions))
        leases.add_metric(["staged"], sum(len(s.puts.staged) for s in sessions))
        leases.add_metric(["buffer"], sum(len(s.loads.buffers) for s in sessions))
        yield leases
        gone = CounterMetricFamily(
            PREFIX + "released_leases",
            "leases released because their client went away",
            labels=["kind"],
        )
        gone.add_metric(["put"], released[0])
        gone.add_metric(["load"], released[1])
        yield gone
        errors = CounterMetricFamily(
            PREFIX + "server_errors",
            "requests and connections the server refused or failed",
            labels=["kind"],
        )
        for name in SERVER_EVENTS:
            errors.add_metric([name], events.get(name, 0))
        yield errors
        for metric, (text, parts) in _HISTOGRAMS.items():
            labels = sorted({k for _, lab in parts for k in lab})
            fam = HistogramMetricFamily(PREFIX + metric, text, labels=labels)
            for name, lab in parts:
                snap = self.live.latency[name].snapshot()
                buckets: list[tuple[str, float]] = []
                seen = 0
                for bound, n in zip(_BOUNDS, snap["counts"], strict=True):
                    seen += n
                    buckets.append((bound, seen))
                fam.add_metric([lab[k] for k in labels], buckets, snap["sum"])
            yield fam


_BOUNDS = [*(repr(b) for b in LATENCY_BOUNDS), "+Inf"]
_HISTOGRAMS: dict[str, tuple[str, list[tuple[str, dict[str, str]]]]] = {
    "lookup_seconds": ("time the server took to answer a lookup", [("lookup", {})]),
    "load_seconds": ("time the server took to answer a load", [("load", {})]),
    "store_seconds": (
        "time the server took to answer a put request (prepare: objects created, extents "
        "reserved; commit: sealed, written, indexed)",
        [("store_prepare", {"phase": "prepare"}), ("store_commit", {"phase": "commit"})],
    ),
}
"""Histogram name -> (help, [(LiveFigures histogram, its labels)])."""


def registry_for(store: KVStore, *, tenants: bool = False) -> CollectorRegistry:
    """A registry of its own exporting ``store``'s figures (the embedded store's; a
    server adds its own collector, :func:`server_registry`)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(store, tenants))
    return registry


def server_registry(state: ServerState, live: LiveFigures) -> CollectorRegistry:
    """The store's figures and the server's (sessions, leases, latencies)."""
    registry = registry_for(state.store, tenants=state.tenancy is not None)
    registry.register(ServerCollector(state, live))
    return registry


class MetricsServer:
    """``registry`` on ``http://HOST:PORT/metrics`` from a daemon thread."""

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0):
        try:
            self._httpd, self._thread = start_http_server(port, host, registry)
        except OSError as exc:
            raise InvalidArgument(f"cannot serve metrics on {host}:{port}: {exc}") from exc
        self.host = host
        self.port: int = self._httpd.server_address[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def serve(registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0) -> MetricsServer:
    """Serve ``registry`` over HTTP (port 0: a free one; the result names the URL)."""
    return MetricsServer(registry, host, port)

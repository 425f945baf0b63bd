"""Operating kvlife next to an inference engine (issue 27): the one configuration file
that describes a store, its server, its planner and its quotas
(:mod:`kvlife.ops.config`), and the KV events a KV-aware router subscribes to
(:mod:`kvlife.ops.kv_events`). Everything here sits beside the server and only maps onto
the store's and the server's own typed settings, so an operator's file and the library's
dataclasses can never say two different things. The rest of operating kvlife lives with
what it observes: structured logs in :mod:`kvlife.core.logs`, the server's live figures in
:mod:`kvlife.server.live`, the Prometheus exporter in :mod:`kvlife.server.prometheus` and
the terminal view ``kvlife top`` in :mod:`kvlife.apps.top` (docs/operations.md)."""

"""Operating kvlife: what a serving team runs next to its engines. Prometheus metrics of a
store or a server (:mod:`kvlife.ops.metrics`), the server's live figures that no store
counter holds, request latencies and recent lifecycle events (:mod:`kvlife.ops.live`),
the terminal live view ``kvlife top`` (:mod:`kvlife.ops.top`) and structured logs, human
or JSON, under the one logger namespace ``kvlife`` (:mod:`kvlife.ops.logs`). The modules
that need the ``ops`` extra (prometheus-client, rich) are imported only by the commands
that use them."""

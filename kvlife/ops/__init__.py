"""Operating kvlife: the primitives a serving team's tools read, a leaf over core. The
server's live figures that no store counter holds, request latencies and recent lifecycle
events (:mod:`kvlife.ops.live`), and structured logs, human or JSON, under the one logger
namespace ``kvlife`` (:mod:`kvlife.ops.logs`). Their consumers sit higher: the Prometheus
exporter of a store or a server (:mod:`kvlife.server.prometheus`) and the terminal live
view ``kvlife top`` (:mod:`kvlife.apps.top`); the modules that need the ``ops`` extra
(prometheus-client, rich) are imported only by the commands that use them."""

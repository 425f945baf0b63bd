"""Operating kvlife next to an inference engine (issue 27): the one configuration file
that describes a store, its server, its planner and its quotas
(:mod:`kvlife.ops.config`), and the KV events a KV-aware router subscribes to
(:mod:`kvlife.ops.kv_events`). Everything here sits above the store and the server and
only maps onto their own typed settings, so an operator's file and the library's
dataclasses can never say two different things."""

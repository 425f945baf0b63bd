"""``kvlife serve``: one store shared by many processes on one host (Unix socket control
plane, shared-memory data plane, leases per connection)."""

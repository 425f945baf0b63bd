"""kvlife: a KV-cache storage layer with identity, lifecycle and crash-safe tiers."""

__version__ = "0.1.0"

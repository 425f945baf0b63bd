"""One configuration file for a store, its server, its planner, its quotas and the vLLM
connector (TOML; docs/operations.md): :func:`load_file` reads and checks it whole
(:class:`ConfigError` lists every error by path and line), :mod:`.serve` maps it and the
``kvlife serve`` flags onto the server's settings."""

from kvlife.ops.config.parse import ConfigError, ConfigIssue, check_file, load_file, parse_size
from kvlife.ops.config.schema import KVLifeConfig, PlannerSettings, ServerSettings, TierSeed

__all__ = [
    "ConfigError",
    "ConfigIssue",
    "KVLifeConfig",
    "PlannerSettings",
    "ServerSettings",
    "TierSeed",
    "check_file",
    "load_file",
    "parse_size",
]

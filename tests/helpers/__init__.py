"""Helpers shared by the recovery tests: a deterministic workload and the crash child."""

"""Tests of the device models and the lifetime-hints experiment (kvlife.sim)."""

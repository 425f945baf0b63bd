"""The ``"machine"`` section every ``kvlife bench`` JSON carries (issue 28): the shape a
test checks, never the speed."""

from __future__ import annotations

import math

from kvlife.bench.limits import MACHINE_KEYS


def assert_machine_figures(doc: dict[str, object]) -> None:
    """``doc["machine"]`` holds memcpy, the streaming copy, raw write and read GB/s and
    the Python loop's speed, each a positive finite number, and says whether the raw I/O
    was O_DIRECT, whether the disk tier read natively and how idle CPUs wait."""
    machine = doc["machine"]
    assert isinstance(machine, dict), machine
    for key in MACHINE_KEYS:
        value = machine[key]
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (key, value)
    assert isinstance(machine["direct_io"], bool)
    assert machine["bytes"] >= machine["block_bytes"] > 0
    assert machine["cpu_count"] >= 1
    assert isinstance(machine["native_reads"], bool)
    assert machine["cpuidle_driver"] is None or isinstance(machine["cpuidle_driver"], str)
    assert machine["halt_poll_ns"] is None or isinstance(machine["halt_poll_ns"], int)

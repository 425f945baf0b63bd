"""The oracle-checked model test of the embedded store's whole public API (issue 18's first
defence): hypothesis rules and a seeded stress driver over
:class:`~tests.helpers.oracle_machine.OracleMachine`, every served byte checked by the
oracle of :mod:`tests.helpers.oracle`.

A short budget runs in the default suite (derandomized: the same examples every run), a
long one under ``-m slow`` (random examples, and stress runs of thousands of steps).
Switches (environment):

- ``KVLIFE_ORACLE_RULES_OFF=two_phase,reopen,...``: rule groups switched off.
- ``KVLIFE_ORACLE_EXAMPLES``, ``KVLIFE_ORACLE_STEPS`` (hypothesis),
  ``KVLIFE_ORACLE_STRESS_STEPS``, ``KVLIFE_ORACLE_SEED`` (stress): budgets and the seed;
  ``KVLIFE_ORACLE_SHRINK=0`` skips shrinking (quicker to iterate).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvlife.store import reads
from tests.conftest import budget
from tests.helpers.oracle import Universe
from tests.helpers.oracle_machine import OracleMachine, stress
from tests.helpers.oracle_targets import EmbeddedTarget, Target


class EmbeddedOracle(OracleMachine):
    def make_target(self) -> tuple[Universe, Target]:
        self.dir = Path(tempfile.mkdtemp(prefix="kvlife-oracle-"))
        u = Universe()
        return u, EmbeddedTarget(self.dir / "store", u)

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def oracle_settings(examples: int, steps: int, derandomize: bool) -> settings:
    return settings(
        max_examples=int(os.environ.get("KVLIFE_ORACLE_EXAMPLES", examples)),
        stateful_step_count=int(os.environ.get("KVLIFE_ORACLE_STEPS", steps)),
        deadline=None,
        derandomize=derandomize,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.reuse, Phase.generate]
        if os.environ.get("KVLIFE_ORACLE_SHRINK") == "0"
        else list(Phase),
    )


def run_stress(machine: OracleMachine, seed: int, steps: int) -> None:
    """A stress run; a failure carries its seed and every step."""
    steps = int(os.environ.get("KVLIFE_ORACLE_STRESS_STEPS", steps))
    log: list[str] = []
    machine.max_reopens = steps
    try:
        stress(machine, seed, steps, log)
    except BaseException as exc:
        exc.add_note(f"stress seed {seed} (KVLIFE_ORACLE_SEED={seed}), steps:\n" + "\n".join(log))
        raise
    finally:
        machine.teardown()


def test_oracle_embedded() -> None:
    run_state_machine_as_test(
        EmbeddedOracle, settings=oracle_settings(budget(20, 40), 40, derandomize=True)
    )


def test_oracle_embedded_one_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same model with loads read as on one CPU (``kvlife serve --cpus`` with one):
    each load with a depth read back to back by one task, each chunk verified on a
    helper of the disk tier meanwhile (``kvlife.store.reads``, ``_Feed.pipelined``)."""
    monkeypatch.setattr(reads, "_one_cpu", lambda: True)
    run_state_machine_as_test(
        EmbeddedOracle, settings=oracle_settings(budget(10, 20), 40, derandomize=True)
    )
    run_stress(EmbeddedOracle(), 7, budget(100, 200))


@pytest.mark.parametrize("seed", [2, 5])
def test_oracle_embedded_stress(seed: int) -> None:
    run_stress(EmbeddedOracle(), int(os.environ.get("KVLIFE_ORACLE_SEED", seed)), budget(150, 300))


@pytest.mark.slow
def test_oracle_embedded_long() -> None:
    run_state_machine_as_test(EmbeddedOracle, settings=oracle_settings(400, 60, derandomize=False))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(8))
def test_oracle_embedded_stress_long(seed: int) -> None:
    run_stress(EmbeddedOracle(), 1000 + seed, 3000)

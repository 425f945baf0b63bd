"""The oracle-checked model test through ``kvlife serve`` with two client processes (issue
18's first defence, served): the rules of :class:`~tests.helpers.oracle_machine.OracleMachine`
sent to two worker processes, each with its own ``RemoteStore``, every served byte checked;
a reopen stops (SIGTERM, a flush) or kills (SIGKILL) the server and starts it again.

One server and two clients per module; each example works on its own model family (keys
no other example shares) and invalidates it when it ends. Short budget in the default
suite, long one under ``-m slow``; the switches of ``tests/test_oracle_model.py`` apply.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import pytest
from hypothesis.stateful import run_state_machine_as_test

from tests.conftest import budget
from tests.helpers.oracle import Universe
from tests.helpers.oracle_machine import OracleMachine
from tests.helpers.oracle_served import Rig, ServedTarget
from tests.helpers.oracle_targets import Target
from tests.test_oracle_model import oracle_settings, run_stress

_families = itertools.count()
_rig: list[Rig] = []


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    r = Rig(tmp_path_factory.mktemp("oracle-served"))
    _rig.append(r)
    yield r
    _rig.clear()
    r.close()


class ServedOracle(OracleMachine):
    max_reopens = 1
    """A restart of the server costs most of a second."""
    fixable = False

    def make_target(self) -> tuple[Universe, Target]:
        u = Universe(f"served{next(_families)}")
        return u, ServedTarget(_rig[0], u)


def test_oracle_served(rig: Rig) -> None:
    run_state_machine_as_test(ServedOracle, settings=oracle_settings(12, 30, derandomize=True))


def test_oracle_served_stress(rig: Rig) -> None:
    run_stress(ServedOracle(), int(os.environ.get("KVLIFE_ORACLE_SEED", "1")), budget(100, 150))


@pytest.mark.slow
def test_oracle_served_long(rig: Rig) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ServedOracle, "max_reopens", 3)
        run_state_machine_as_test(
            ServedOracle, settings=oracle_settings(120, 40, derandomize=False)
        )


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_oracle_served_stress_long(rig: Rig, seed: int) -> None:
    run_stress(ServedOracle(), 2000 + seed, 1500)

"""The store state machine of ``test_store_state_machine.py`` with power cuts added.

Every session of the store runs through a :class:`~kvlife.faults.powercut.PowerCutIO`.
Two more rules: cut the power between two calls, or arm a cut at the k-th file call of a
put (before or after it, with or without a partial write-back of pending pages) and run
the put. Either way the dead store is closed, the seam settles (the directory is what a
power cut leaves), the store is reopened, and recovery must have dropped nothing. The model
is the base machine's: what a write-through put acknowledged (it returned before the cut)
must be served; the chunks of a put cut short may or may not be; in write-back mode a cut
loses DRAM, so nothing is owed. Every other rule and invariant of the base machine (only
indexed objects served, served bytes equal the put, events obey the table) runs as is.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import rule, run_state_machine_as_test

from kvlife.core.errors import KVLifeError
from kvlife.faults.damage import catalog_file
from kvlife.faults.powercut import CutPoint, PowerCut, PowerCutIO
from kvlife.tiers.disk.fileio import FileIO
from tests.conftest import TINY, budget
from tests.test_store_state_machine import PROMPTS, Prompt, StoreMachine, WriteBackMachine

N = TINY.tokens_per_chunk


class PowerCutRules(StoreMachine):
    """The base rules, every session behind a power-cut seam, plus two cut rules."""

    io: PowerCutIO
    stashes: Path | None = None
    """One directory per machine holding every session's stash: a session closed
    without a cut (the base machine's ``crash_and_reopen``) is never settled, so its
    stash would outlive the machine; teardown removes them all."""

    def _fileio(self) -> FileIO:
        if self.stashes is None:  # the first session starts in the base __init__
            self.stashes = Path(tempfile.mkdtemp(prefix="kvlife-sm-stash-"))
        self.io = PowerCutIO(
            catalogs=[catalog_file(self.dir)], stash=Path(tempfile.mkdtemp(dir=self.stashes))
        )
        return self.io

    def teardown(self) -> None:
        try:
            self.io.cut("teardown")
            self.store.close(flush=False)
            self.io.settle()  # removes its stash
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
            if self.stashes is not None:
                shutil.rmtree(self.stashes, ignore_errors=True)

    def _cut_and_reopen(self) -> None:
        self.io.cut()
        self.store.close(flush=False)
        self.io.settle()
        self._check_events()
        self.states.clear()  # a new process: every object starts from the catalog
        self.store = self._open()
        # No catalog row may name bytes that were not durable at the cut.
        assert self.store.counters.recovery_dropped == 0, "recovery dropped replicas"
        if not self.write_through:  # DRAM is gone: nothing was owed
            self.maybe |= self.must
            self.must.clear()

    @rule()
    def power_cut_between_calls(self) -> None:
        self._cut_and_reopen()

    @rule(
        p=st.sampled_from(PROMPTS),
        nth=st.integers(1, 24),
        when=st.sampled_from(["before", "after"]),
        persist=st.sampled_from([0.0, 0.5]),
    )
    def power_cut_during_put(
        self, p: Prompt, nth: int, when: Literal["before", "after"], persist: float
    ) -> None:
        self.io.persist = persist
        self.io.arm(CutPoint(nth, None, when))
        try:
            res = self.store.put_prompt(p.identity, p.namespace, p.tokens, p.kv)
        except (KVLifeError, PowerCut):
            if not self.io.dead:
                raise
        if self.io.dead:  # cut short: each of its chunks may or may not have landed
            for i, key in enumerate(p.keys):
                self.expected[key] = np.ascontiguousarray(p.kv[:, :, :, i * N : (i + 1) * N])
                if key not in self.must:
                    self.maybe.add(key)
        else:  # it returned before the cut: acknowledged
            self._record_put(p, res.tokens_stored_or_present)
        self._cut_and_reopen()


class PowerCutMachine(PowerCutRules):
    """Write-through, large disk: what a put acknowledged must survive every cut."""


class PowerCutWriteBackMachine(PowerCutRules, WriteBackMachine):
    """Write-back, small disk: eviction everywhere; served bytes must still be right."""


def test_stash_directories_are_cleaned(tmp_path: Path) -> None:
    """settle() removes the seam's stash (the machine creates one per session)."""
    io = PowerCutIO(stash=tmp_path / "stash")
    f = tmp_path / "f"
    f.write_bytes(b"x")
    io.unlink(f)
    io.cut()
    io.settle()
    assert not (tmp_path / "stash").exists() and f.exists()


@pytest.mark.parametrize("machine", [PowerCutMachine, PowerCutWriteBackMachine])
def test_the_machines_leave_no_directory_behind(
    machine: type[PowerCutRules], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A few short runs (reopens without a cut among them: ``crash_and_reopen``) leave no
    stash or store directory in the temporary directory: every session's stash goes
    with its machine, not only the ones a cut settled."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    run_state_machine_as_test(
        machine, settings=settings(max_examples=3, stateful_step_count=10, deadline=None)
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# A short budget in the default suite (the long one under the slow profile, see
# tests/conftest.py); test_power_cut_machines_long runs both machines for longer.
TestPowerCutMachine = PowerCutMachine.TestCase
TestPowerCutMachine.settings = settings(
    max_examples=budget(8, 15), stateful_step_count=25, deadline=None
)
TestPowerCutWriteBackMachine = PowerCutWriteBackMachine.TestCase
TestPowerCutWriteBackMachine.settings = settings(
    max_examples=budget(8, 15), stateful_step_count=25, deadline=None
)


@pytest.mark.slow
@pytest.mark.parametrize("machine", [PowerCutMachine, PowerCutWriteBackMachine])
def test_power_cut_machines_long(machine: type[PowerCutRules]) -> None:
    run_state_machine_as_test(
        machine, settings=settings(max_examples=100, stateful_step_count=40, deadline=None)
    )

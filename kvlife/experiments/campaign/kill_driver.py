"""The SIGKILL rounds of the campaign, in a process of their own.

``python -m kvlife.experiments.campaign.kill_driver --root DIR --kills N --seed S --json OUT``
runs ``N`` rounds (see :mod:`kvlife.experiments.campaign.kills`): fork a writer, wait until
it stops at its kill point (or, for ``random``, a seeded delay), SIGKILL it, reap it,
fold its log into what the store directory owes; the next round's writer verifies it.
A directory is started afresh every ``--rounds-per-dir`` rounds (with a last verifying
writer first), so verification stays short. The tallies go to ``OUT`` as JSON.

This process forks, so it never opens a store or starts a thread itself.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

from kvlife.experiments.campaign.kills import (
    COMBO_STEPS,
    STEPS,
    Ledger,
    Plan,
    choose,
    parse,
    run_child,
    tally_verification,
)
from kvlife.experiments.campaign.tally import KindTally

WAIT_S = 60.0


def _wait(pid: int, stop_after: float | None) -> str:
    """Wait for the child: ``stopped`` (at its kill point), ``exited`` or ``timeout``;
    with ``stop_after``, SIGKILL it after that many seconds (``random``)."""
    deadline = time.monotonic() + (stop_after if stop_after is not None else WAIT_S)
    while True:
        got, status = os.waitpid(pid, os.WUNTRACED | os.WNOHANG)
        if got == pid:
            if os.WIFSTOPPED(status):
                return "stopped"
            return "exited" if os.WIFEXITED(status) else "signalled"
        if time.monotonic() >= deadline:
            return "due" if stop_after is not None else "timeout"
        time.sleep(0.0005)


def _kill(pid: int) -> bool:
    """SIGKILL and reap; True if the kill is what ended it."""
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def one_round(
    d: Path,
    ledger: Ledger,
    plan: Plan,
    rnd: int,
    t: KindTally,
    prev: KindTally | None,
    rng: random.Random,
    combined: bool = False,
) -> bool:
    """One fork-stop-kill round; True if the writer was SIGKILLed at its point. What
    the writer verified at its start is the previous round's outcome: it goes to
    ``prev`` (the tally of the kill that left the store so), and a verification that
    completed counts as that kill's detection (the store recovered and checked out)."""
    logp = d / f"r{rnd}.log"
    expect = d / f"r{rnd}.expect.json"
    expect.write_text(json.dumps(ledger.expectation()))
    pid = os.fork()
    if pid == 0:
        run_child(d / "store", logp, expect, plan)
    random_delay = rng.uniform(0.0, 0.25) if plan.step == "random" else None
    state = _wait(pid, random_delay)
    killed = False
    if state in ("stopped", "due", "timeout"):
        killed = _kill(pid)
        if state == "timeout":
            t.note("a writer never reached its kill point in time")
            killed = False
    lines = parse(logp)
    if prev is not None and tally_verification(lines, prev, lost_writes=combined):
        prev.detections += 1
    err = logp.parent / (logp.name + ".err")
    if err.exists():
        t.note("writer failed: " + err.read_text().strip().splitlines()[-1][:200])
    if killed and (plan.lose == 0 or any(k == "lostw" for k, _ in lines)):
        # a combined round counts once both faults fired: the lost write, then the kill
        t.injections += 1
        t.sigkills += 1
    elif killed:
        t.sigkills += 1
        t.note("the kill came before the lost write")
    ledger.absorb(lines, plan)
    return killed


def run(
    root: Path, kills: int, seed: int, rounds_per_dir: int = 20, shapes: tuple[str, ...] = ()
) -> list[KindTally]:
    rng = random.Random(seed)
    shapes = shapes or tuple(STEPS)
    tallies: dict[str, KindTally] = {}
    done = 0
    rnd = 0
    dirs = 0
    while done < kills:
        if rnd > 20 * kills + 100:  # kills stopped landing: say so rather than spin
            t = tallies.setdefault("stuck", KindTally("sigkill-stuck", "embedded"))
            t.note(f"only {done} of {kills} kills landed in {rnd} rounds")
            break
        shape = shapes[dirs % len(shapes)]
        dirs += 1
        d = root / f"{shape}-{dirs}"
        d.mkdir(parents=True)
        ledger = Ledger(shape, seed * 1000 + dirs)
        prev: KindTally | None = None
        for _ in range(rounds_per_dir):
            if done >= kills:
                break
            _, step, nth = choose(rng, [shape])
            t = tallies.setdefault(
                f"{shape}:{step}", KindTally(f"sigkill-{shape}:{step}", "embedded")
            )
            plan = Plan(
                shape,
                step,
                nth,
                ledger.seed,
                ledger.next_first,
                30 if shape == "compaction" else 12,
            )
            rnd += 1
            if one_round(d, ledger, plan, rnd, t, prev, rng):
                done += 1
                prev = t
            else:
                prev = None  # the writer ran out of work: it was not killed
        if prev is not None:  # a last writer that only verifies (max_puts=0), then exits
            rnd += 1
            plan = Plan(shape, "frame-written", 1, ledger.seed, ledger.next_first, max_puts=0)
            one_round(d, ledger, plan, rnd, KindTally("verify", "embedded"), prev, rng)
        shutil.rmtree(d, ignore_errors=True)
    return [t for t in tallies.values() if t.injections]


def run_combined(root: Path, rounds: int, seed: int, per_dir: int = 8) -> list[KindTally]:
    """``rounds`` SIGKILLs of ``commit`` writers that lost one of their segment writes
    first (a lost write, then the kill at a step of :data:`COMBO_STEPS`)."""
    rng = random.Random(seed * 31 + 7)
    tallies: dict[str, KindTally] = {}
    done = rnd = dirs = 0
    while done < rounds and rnd < 20 * rounds + 100:
        dirs += 1
        d = root / f"combo-{dirs}"
        d.mkdir(parents=True)
        ledger = Ledger("commit", seed * 1000 + 500 + dirs)
        prev: KindTally | None = None
        for _ in range(per_dir):
            if done >= rounds:
                break
            step = rng.choice(COMBO_STEPS)
            nth = rng.randint(4, 12)
            name = f"combo:lost-write+sigkill@commit:{step}"
            t = tallies.setdefault(name, KindTally(name, "embedded"))
            # the lost write lands among the writer's first puts, before the kill point
            plan = Plan("commit", step, nth, ledger.seed, ledger.next_first, 12, rng.randint(1, 6))
            rnd += 1
            if one_round(d, ledger, plan, rnd, t, prev, rng, combined=True):
                done += 1
                prev = t
            else:
                prev = None
        if prev is not None:
            rnd += 1
            plan = Plan("commit", "frame-written", 1, ledger.seed, ledger.next_first, max_puts=0)
            one_round(d, ledger, plan, rnd, KindTally("verify", "embedded"), prev, rng, True)
        shutil.rmtree(d, ignore_errors=True)
    return [t for t in tallies.values() if t.sigkills]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--root", type=Path, required=True, help="a private scratch directory")
    ap.add_argument("--kills", type=int, required=True, help="SIGKILLs to land")
    ap.add_argument("--seed", type=int, default=0, help="campaign seed")
    ap.add_argument(
        "--rounds-per-dir",
        type=int,
        default=0,
        help="rounds per store directory (0: enough directories for every shape, at most 20)",
    )
    ap.add_argument(
        "--kill-combos", type=int, default=0, help="SIGKILLs combined with a lost write"
    )
    ap.add_argument("--serve-kills", type=int, default=0, help="kvlife serve clients to kill")
    ap.add_argument("--server-kills", type=int, default=0, help="kvlife serve servers to kill")
    ap.add_argument("--json", type=Path, required=True, help="write the tallies here")
    args = ap.parse_args(argv)
    per_dir = args.rounds_per_dir or min(20, max(3, args.kills // (2 * len(STEPS))))
    tallies = run(args.root, args.kills, args.seed, per_dir) if args.kills else []
    if args.kill_combos:
        tallies += run_combined(args.root, args.kill_combos, args.seed)
    if args.serve_kills or args.server_kills:
        from kvlife.experiments.campaign import served

        tallies += served.run(args.root / "serve", args.seed, args.serve_kills, args.server_kills)
    doc = {"tallies": [t.to_json() | {"recovery": t.recovery_s} for t in tallies], "skipped": []}
    args.json.write_text(json.dumps(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

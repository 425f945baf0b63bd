"""Fuzz the disk tier's persisted formats (issue 9): random damage to catalog rows, the
catalog file, its write-ahead log, the superblock, frame headers and segments.

The store under test is a crash image (files copied while the store was open, after an
acknowledged invalidation, so the log holds its last transactions). Each example
damages it once (a flip, a zero-fill, a truncation, a swap or a deletion) and reopens.
Every outcome must be one of: a typed refusal (:class:`~kvlife.core.errors.KVLifeError`),
or an open store that serves every chunk bit-exact or as a miss. Never a wrong byte,
never an invalidated chunk indexed or served again, never a segment file that held a
committed frame deleted by the open (it may only be set aside in ``quarantine/``), and
``check`` only ever reads.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from kvlife.core.errors import KVLifeError
from kvlife.tiers.disk.audit import audit_directory
from kvlife.tiers.disk.frame import HEADER_USED, frame_len
from kvlife.tiers.disk.repair import prepare_repair
from tests.conftest import budget
from tests.helpers.damage import (
    Workload,
    all_segment_names,
    build_crash_image,
    catalog_file,
    disk_dir,
    open_store,
    segment_files,
    serve_all,
    snapshot,
)

Target = Literal["catalog-row", "catalog-file", "wal", "superblock", "frame-header", "segment"]
Op = Literal["flip", "zero", "truncate", "swap", "delete"]
COLUMNS = ("key", "seg", "off", "nbytes", "checksum", "dtype", "shape", "transform", "info")


@dataclass(frozen=True, slots=True)
class Damage:
    target: Target
    op: Op
    pick: int
    """Which row, field, segment or frame (modulo how many there are)."""
    position: float
    """Where in the file (or field) as a fraction of its length."""
    length: int
    seed: int


damages = st.builds(
    Damage,
    target=st.sampled_from(
        ["catalog-row", "catalog-file", "wal", "superblock", "frame-header", "segment"]
    ),
    op=st.sampled_from(["flip", "zero", "truncate", "swap", "delete"]),
    pick=st.integers(0, 1 << 16),
    position=st.floats(0.0, 1.0, exclude_max=True),
    length=st.one_of(st.integers(1, 16), st.integers(1, 3 * 4096)),
    seed=st.integers(0, 2**32 - 1),
)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Workload:
    base = tmp_path_factory.mktemp("fuzz-pristine")
    return build_crash_image(base / "s", base / "img", prompts=8, more=3)


# ------------------------------------------------------------------ applying damage


def _damage_bytes(f: Path, d: Damage) -> None:
    data = f.read_bytes()
    if d.op == "delete":
        f.unlink()
        return
    if not data:
        return
    start = int(d.position * len(data))
    end = min(len(data), start + d.length)
    if d.op == "truncate":
        os.truncate(f, start)
        return
    buf = bytearray(data)
    if d.op == "flip":
        buf[start:end] = bytes(b ^ 0xFF for b in buf[start:end])
    elif d.op == "zero":
        buf[start:end] = bytes(end - start)
    else:  # swap with another range of the same length
        n = end - start
        other = np.random.default_rng(d.seed).integers(0, max(1, len(data) - n + 1))
        a, b = bytes(buf[start:end]), bytes(buf[other : other + n])
        buf[start:end], buf[other : other + n] = b, a
    f.write_bytes(bytes(buf))


def _damage_row(path: Path, d: Damage) -> None:
    """Change one field of one row with sqlite3, as an operator or a stray writer would."""
    db = sqlite3.connect(catalog_file(path))
    try:
        with db:
            rowids = [r[0] for r in db.execute("SELECT rowid FROM replicas ORDER BY rowid")]
            rowid = rowids[d.pick % len(rowids)]
            col = COLUMNS[(d.pick // 7) % len(COLUMNS)]
            if d.op == "delete":
                db.execute("DELETE FROM replicas WHERE rowid = ?", (rowid,))
                return
            if d.op == "swap":
                other = rowids[(d.pick + 1) % len(rowids)]
                (va,) = db.execute(
                    f"SELECT {col} FROM replicas WHERE rowid = ?", (rowid,)
                ).fetchone()
                (vb,) = db.execute(
                    f"SELECT {col} FROM replicas WHERE rowid = ?", (other,)
                ).fetchone()
                if col == "key":  # keys are unique: rotate through a free value
                    db.execute("UPDATE replicas SET key = x'00' WHERE rowid = ?", (rowid,))
                db.execute(f"UPDATE replicas SET {col} = ? WHERE rowid = ?", (va, other))
                db.execute(f"UPDATE replicas SET {col} = ? WHERE rowid = ?", (vb, rowid))
                return
            (v,) = db.execute(f"SELECT {col} FROM replicas WHERE rowid = ?", (rowid,)).fetchone()
            db.execute(f"UPDATE replicas SET {col} = ? WHERE rowid = ?", (_changed(v, d), rowid))
    except sqlite3.IntegrityError:
        pass  # the change would break a constraint: SQLite refused it, nothing changed
    finally:
        db.close()


def _changed(v: object, d: Damage) -> object:
    if isinstance(v, int):
        return {"flip": v ^ (1 << (d.seed % 20)), "zero": 0, "truncate": v // 2}[d.op]
    if isinstance(v, bytes):
        if not v:
            return b"\x01"
        i = int(d.position * len(v))
        if d.op == "flip":
            return v[:i] + bytes([v[i] ^ (1 + d.seed % 255)]) + v[i + 1 :]
        if d.op == "zero":
            return v[:i] + bytes(len(v) - i)
        return v[:i]
    assert isinstance(v, str)
    if not v:
        return "x"
    i = int(d.position * len(v))
    if d.op == "flip":
        return v[:i] + chr(ord(v[i]) ^ 1) + v[i + 1 :]
    if d.op == "zero":
        return v[:i] + "0" * (len(v) - i)
    return v[:i]


def apply(path: Path, d: Damage) -> set[str]:
    """Apply the damage; return the names of segment files it deleted or emptied."""
    disk = disk_dir(path)
    segs = segment_files(path)
    gone: set[str] = set()
    if d.target == "catalog-row":
        _damage_row(path, d)
    elif d.target in ("catalog-file", "wal", "superblock"):
        name = {"catalog-file": "catalog.sqlite", "wal": "catalog.sqlite-wal"}.get(
            d.target, "superblock"
        )
        f = disk / name
        if f.exists():
            _damage_bytes(f, d)
    elif d.target == "frame-header":
        seg = segs[d.pick % len(segs)]
        size = seg.stat().st_size
        frame = 8192  # every frame of the workload: one header page + one payload page
        assert frame_len(1) == frame
        start = (d.pick // 11) % max(1, size // frame) * frame
        sub = Damage(
            d.target,
            d.op if d.op != "delete" else "flip",
            d.pick,
            (start + d.position * HEADER_USED) / size,
            min(d.length, HEADER_USED),
            d.seed,
        )
        _damage_bytes(seg, sub)
    else:
        seg = segs[d.pick % len(segs)]
        if d.op == "swap":
            other = segs[(d.pick + 1) % len(segs)]
            a, b = seg.read_bytes(), other.read_bytes()
            seg.write_bytes(b)
            other.write_bytes(a)
        else:
            _damage_bytes(seg, d)
    for s in segs:
        if not s.exists() or s.stat().st_size == 0:
            gone.add(s.name)
    return gone


# ------------------------------------------------------------------ the property


def run_one(pristine: Workload, tmp: Path, d: Damage) -> None:
    path = tmp / "store"
    shutil.copytree(pristine.path, path)
    w = Workload(path, pristine.prompts, pristine.refs, pristine.invalidated)
    committed = {p.name for p in segment_files(path) if p.stat().st_size > 0}
    gone = apply(path, d)
    event(f"damage: {d.target} {d.op}")
    # check only reads, whatever it finds
    before = snapshot(path)
    with contextlib.suppress(KVLifeError):
        audit_directory(path)
    assert snapshot(path) == before, "check changed a damaged store"
    try:
        store = open_store(path)
    except KVLifeError as exc:
        event(f"refused: {type(exc).__name__}")
        assert committed - gone <= all_segment_names(path), "a refused open deleted a segment"
    else:
        try:
            missing = (committed - gone) - all_segment_names(path)
            assert not missing, f"open deleted segments that held committed frames: {missing}"
            got = serve_all(store, w)
            event(f"opened: {len(got.missed - w.invalidated)} live chunks missed")
            assert got.served <= w.live
        finally:
            try:
                store.close()
            except KVLifeError as exc:
                event(f"close refused: {type(exc).__name__}")
    fix_then_check(w)


def fix_then_check(w: Workload) -> None:
    """What ``kvlife check --fix`` does; afterwards the audit is clean and the store
    still serves only right bytes (or it refuses, typed, what it cannot repair)."""
    try:
        prepare_repair(w.path)
        store = open_store(w.path)
    except KVLifeError as exc:
        event(f"fix refused: {type(exc).__name__}")
        return
    try:
        store.check(fix=True)
    finally:
        store.close()
    report = audit_directory(w.path)
    assert report.clean, report
    assert not report.quarantined_files, report
    store = open_store(w.path)
    try:
        assert store.counters.recovery_dropped == 0, "the fix left something to drop"
        assert serve_all(store, w).served <= w.live
    finally:
        store.close()


_examples = [
    Damage("wal", "flip", 0, 0.9, 1, 1),
    Damage("wal", "truncate", 0, 0.5, 1, 2),
    Damage("wal", "delete", 0, 0.0, 1, 3),
    Damage("superblock", "flip", 0, 0.002, 8, 4),
    Damage("superblock", "delete", 0, 0.0, 1, 5),
    Damage("catalog-row", "flip", 8 * 7, 0.3, 1, 6),  # info of a row
    Damage("catalog-row", "swap", 7, 0.0, 1, 7),  # two rows' segment numbers
    Damage("catalog-file", "zero", 0, 0.6, 3 * 4096, 8),
    Damage("frame-header", "flip", 11, 0.2, 8, 9),
    Damage("segment", "swap", 0, 0.0, 1, 10),
    Damage("segment", "truncate", 1, 0.5, 1, 11),
]


def _with_examples(f: Callable[..., None]) -> Callable[..., None]:
    for e in _examples:
        f = example(damage=e)(f)
    return f


_FIXTURE_OK = [HealthCheck.function_scoped_fixture]


@settings(max_examples=budget(30, 60), deadline=None, suppress_health_check=_FIXTURE_OK)
@given(damage=damages)
@_with_examples
def test_random_damage_is_a_correct_load_a_miss_or_a_typed_refusal(
    pristine: Workload, tmp_path_factory: pytest.TempPathFactory, damage: Damage
) -> None:
    run_one(pristine, tmp_path_factory.mktemp("fuzz"), damage)


@pytest.mark.slow
@settings(max_examples=600, deadline=None, suppress_health_check=_FIXTURE_OK)
@given(damage=damages)
def test_random_damage_many_examples(
    pristine: Workload, tmp_path_factory: pytest.TempPathFactory, damage: Damage
) -> None:
    run_one(pristine, tmp_path_factory.mktemp("fuzz"), damage)

"""Issue 9: ``kvlife check`` only reads; ``check --fix`` repairs once and for all.

Before the fix, ``check`` opened the store for writing, so its recovery dropped bad
replicas and deleted unreferenced segments (it never listed an orphan) and it exited 0
on damage; a damaged catalog gave a traceback; and after ``check --fix`` on a row with a
flipped key every later ``check`` said it fixed it again.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvlife.cli import main
from tests.helpers.damage import (
    build,
    build_crash_image,
    catalog_file,
    disk_dir,
    flip,
    open_store,
    row_of,
    segment_files,
    serve_all,
    snapshot,
    sql,
)
from tests.helpers.workload import USERS


def check(path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, str]:
    code = main(["check", str(path), *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_check_changes_nothing_and_reports_every_kind_of_damage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    w = build(tmp_path / "s", prompts=6)
    victim = next(iter(w.refs))
    sql(w.path, "UPDATE replicas SET off = off + 4096 WHERE rowid = ?", (row_of(w.path, victim),))
    seg = segment_files(w.path)[-1]
    assert seg.name != "seg-00000001.kvs"  # the victim's row names the first segment
    flip(seg, 4096 + 100)  # a payload: only a full check sees it
    stray = disk_dir(w.path) / "segments" / "seg-00000077.kvs"
    stray.write_bytes(b"x" * 8192)
    before = snapshot(w.path)
    for _ in range(2):
        code, out, err = check(w.path, capsys)
        assert code == 1, out
        assert err == ""
        assert "orphan segment: seg-00000077.kvs" in out
        assert out.count("  bad: ") == 2, out
        assert snapshot(w.path) == before, "check changed the store"
    assert stray.exists()


def test_check_reports_a_rolled_back_catalog_without_opening_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    w = build_crash_image(tmp_path / "s", tmp_path / "img")
    (disk_dir(w.path) / "catalog.sqlite-wal").unlink()
    before = snapshot(w.path)
    code, out, _ = check(w.path, capsys)
    assert code == 1 and "behind the acknowledged generation" in out, out
    assert snapshot(w.path) == before
    code, out, _ = check(w.path, capsys, "--fix")
    assert code == 0, out
    assert "dropped all" in out
    code, out, _ = check(w.path, capsys)
    assert code == 0, out
    store = open_store(w.path)
    try:
        assert serve_all(store, w).served == set()
    finally:
        store.close()


def test_fix_of_a_flipped_key_is_done_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    w = build(tmp_path / "s", prompts=6)
    cat = catalog_file(w.path)
    victim = next(iter(w.refs))
    flip(cat, cat.read_bytes().find(victim) + 3)
    code, out, _ = check(w.path, capsys)
    assert code == 1, out
    code, out, _ = check(w.path, capsys, "--fix")
    assert code == 0, out
    assert "fixed:" in out
    for _ in range(2):
        code, out, _ = check(w.path, capsys)
        assert code == 0 and "fixed" not in out and "bad: " not in out, out
        code, out, _ = check(w.path, capsys, "--fix")
        assert code == 0 and "nothing needed fixing" in out, out
    store = open_store(w.path)
    try:
        assert store.counters.recovery_dropped == 0
        # The flip hit the table (row quarantined, deleted by the fix) or only the
        # index (rebuilt from the table by the fix, so the row is whole again).
        assert serve_all(store, w).served >= set(w.refs) - {victim}
    finally:
        store.close()


def test_fix_deletes_quarantined_rows_and_files_then_check_is_clean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    w = build(tmp_path / "s", prompts=6, invalidate=USERS[1])
    victim = next(iter(w.live))
    sql(w.path, "UPDATE replicas SET nbytes = 7 WHERE rowid = ?", (row_of(w.path, victim),))
    (disk_dir(w.path) / "segments" / "seg-00000088.kvs").write_bytes(b"y" * 4096)
    store = open_store(w.path)  # quarantines the row, sets the stray file aside
    store.close()
    code, out, _ = check(w.path, capsys)
    assert code == 1 and "quarantined row" in out and "quarantined file" in out, out
    code, out, _ = check(w.path, capsys, "--fix")
    assert code == 0, out
    assert "deleted 1 quarantined catalog rows" in out and "quarantined files" in out, out
    code, out, _ = check(w.path, capsys)
    assert code == 0 and "quarantined" not in out, out
    store = open_store(w.path)
    try:
        assert serve_all(store, w).served == w.live - {victim}
    finally:
        store.close()


def test_damaged_catalog_is_one_error_line_never_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    w = build(tmp_path / "s", prompts=4)
    ((root,),) = sql(w.path, "SELECT rootpage FROM sqlite_master WHERE name = 'counters'")
    assert isinstance(root, int)
    with catalog_file(w.path).open("r+b") as fh:
        fh.seek((root - 1) * 4096)
        fh.write(os.urandom(4096))
    code, out, err = check(w.path, capsys)
    assert code == 1
    assert "Traceback" not in out + err
    assert "catalog" in out


def test_check_of_an_open_store_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    w = build(tmp_path / "s", prompts=2)
    store = open_store(w.path)
    try:
        code, _, err = check(w.path, capsys)
        assert code == 1 and err.startswith("kvlife: error:") and "open in another" in err
        assert err.count("\n") == 1
    finally:
        store.close()


def test_check_of_a_missing_catalog_lists_the_segments_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    w = build(tmp_path / "s", prompts=4)
    for f in disk_dir(w.path).glob("catalog.sqlite*"):
        f.unlink()
    before = snapshot(w.path)
    code, out, _ = check(w.path, capsys)
    assert code == 1 and "missing" in out and "orphan segment" in out, out
    code, _, err = check(w.path, capsys, "--fix")
    assert code == 1 and "missing" in err and err.count("\n") == 1
    assert snapshot(w.path) == before


def test_damaged_superblock_copy_is_reported_then_fixed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    w = build(tmp_path / "s", prompts=4, invalidate=USERS[1])
    flip(disk_dir(w.path) / "superblock", 4096 + 24, 8)
    before = snapshot(w.path)
    code, out, _ = check(w.path, capsys)
    assert code == 1 and "superblock" in out and "copy 1" in out, out
    assert snapshot(w.path) == before
    code, out, _ = check(w.path, capsys, "--fix")
    assert code == 0 and "rewrote the superblock" in out, out
    code, out, _ = check(w.path, capsys)
    assert code == 0, out

"""Read-only audit of a store directory, and the repairs ``kvlife check --fix`` makes
before it can open the store.

:func:`audit_directory` changes nothing: it opens the catalog with a SQLite ``mode=ro``
URI (SQLite may create its ``-shm`` index; no data file is written), runs
``PRAGMA integrity_check``, parses and checksums every row, reads every frame header
and payload with plain reads, compares the catalog generation with the superblock, and
lists orphan segments and quarantined files. No recovery runs, nothing is quarantined,
moved or deleted. It takes a shared ``flock`` on ``PATH/LOCK`` for its duration, so it
refuses (:class:`~kvlife.core.errors.StoreLockedError`) while a process has the store
open, and a store cannot be opened while it runs.

:func:`prepare_repair` holds the lock exclusively and fixes what stops the store from
opening: it rebuilds damaged indexes (``REINDEX``) and resolves a catalog that cannot
be proven current (behind the superblock, or no superblock after rows were deleted) by
dropping every replica, since any of them might have been invalidated. The rest of a
fix runs through the opened store (:meth:`kvlife.tiers.disk.tier.DiskTier.check`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from kvlife.core.errors import KVLifeError, StoreLockedError, StorePathError
from kvlife.tiers.base import AuditReport
from kvlife.tiers.buffers import ALIGN, aligned_empty
from kvlife.tiers.disk.catalog import Catalog, CatalogCorrupt, CatalogMissing, CatalogRow
from kvlife.tiers.disk.fileio import FileIO
from kvlife.tiers.disk.frame import HEADER_BYTES, frame_len
from kvlife.tiers.disk.superblock import FILE_NAME, Superblock, read_superblock

_SEG_RE = re.compile(r"^seg-(\d{8})\.kvs$")


def _disk_dir(path: Path) -> Path:
    disk = path / "disk"
    if not disk.is_dir():
        raise StorePathError(f"{path} is not a kvlife store (no disk/ directory)")
    return disk


@contextlib.contextmanager
def _locked(path: Path, exclusive: bool) -> Iterator[None]:
    lock = path / "LOCK"
    try:
        flags = os.O_RDWR | os.O_CREAT if exclusive else os.O_RDONLY
        fd = os.open(lock, flags, 0o644)
    except FileNotFoundError:
        yield  # never opened by a store: nobody to exclude
        return
    except OSError as exc:
        raise StorePathError(f"cannot open {lock}: {exc}") from exc
    try:
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreLockedError(
                f"store {path} is open in another process; check it after that process closes it"
            ) from None
        yield
    finally:
        os.close(fd)


def _segments(segdir: Path) -> dict[int, Path]:
    try:
        names = list(segdir.iterdir()) if segdir.is_dir() else []
    except OSError as exc:
        raise StorePathError(f"cannot list {segdir}: {exc}") from exc
    out: dict[int, Path] = {}
    for p in names:
        m = _SEG_RE.match(p.name)
        if m:
            out[int(m.group(1))] = p
    return out


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError as exc:
        raise StorePathError(f"cannot stat {p}: {exc}") from exc


def audit_directory(
    path: str | Path, progress: Callable[[int], object] | None = None
) -> AuditReport:
    """Audit the store at ``path`` without changing it (see the module docstring).

    ``progress`` is called with each replica's byte count as it is checked. Damage is
    reported in the result; only an unusable directory (not a store, unreadable, open
    in another process) raises, always a :class:`~kvlife.core.errors.KVLifeError`.
    """
    root = Path(path)
    disk = _disk_dir(root)
    with _locked(root, exclusive=False):
        return _audit(disk, progress)


def _audit(disk: Path, progress: Callable[[int], object] | None) -> AuditReport:
    report = AuditReport()
    segdir = disk / "segments"
    files = _segments(segdir)
    sizes = {sid: _size(p) for sid, p in files.items()}
    qdir = disk / "quarantine"
    with contextlib.suppress(FileNotFoundError):
        report.quarantined_files.extend(sorted(p.name for p in qdir.iterdir() if p.is_file()))
    has_data = any(n > 0 for n in sizes.values())
    catalog_path = disk / "catalog.sqlite"
    sb = read_superblock(disk / FILE_NAME)
    if not catalog_path.exists() or _size(catalog_path) == 0:
        if has_data:
            state = "missing" if not catalog_path.exists() else "empty"
            report.problems.append(str(CatalogMissing(catalog_path, segdir, state)))
            report.orphan_segments.extend(p.name for sid, p in sorted(files.items()) if sizes[sid])
        return report
    try:
        cat = Catalog(catalog_path, readonly=True)
    except CatalogMissing as exc:
        if has_data:
            report.problems.append(str(exc))
            report.orphan_segments.extend(p.name for sid, p in sorted(files.items()) if sizes[sid])
        return report
    except KVLifeError as exc:
        report.problems.append(str(exc))
        return report
    try:
        report.generation = cat.generation
        report.problems.extend(f"catalog integrity: {m}" for m in cat.integrity())
        if cat.version >= 2:
            _audit_generation(report, cat.generation, sb.generation, sb.problems, disk)
        referenced: set[int] = set()
        fds: dict[int, int] = {}
        try:
            for s in cat.scan():
                if s.seg is not None:
                    referenced.add(s.seg)
                if s.quarantine is not None:
                    report.quarantined.append(f"{s.key.hex()[:16]}…: {s.quarantine}")
                    continue
                report.rows += 1
                if s.row is None or s.problem:
                    report.problems.append(s.problem)
                    report.bad_keys.append(s.key)
                    continue
                if progress is not None:
                    progress(s.row.nbytes)
                problem = _check_frame(s.row, files, sizes, fds)
                if problem:
                    where = f"seg-{s.row.seg:08d}@{s.row.off}"
                    report.problems.append(f"{s.row.key.hex()[:16]}… {where}: {problem}")
                    report.bad_keys.append(s.row.key)
                else:
                    report.ok += 1
        finally:
            for fd in fds.values():
                os.close(fd)
    except KVLifeError as exc:
        report.problems.append(str(exc))
    finally:
        cat.close()
    for sid, p in sorted(files.items()):
        if sid not in referenced and sizes[sid] > 0:
            report.orphan_segments.append(p.name)
    return report


def _audit_generation(
    report: AuditReport, have: int, acked: int | None, problems: tuple[str, ...], disk: Path
) -> None:
    sb = disk / FILE_NAME
    if acked is None:
        if have > 0:
            report.problems.append(
                f"superblock {sb} {'; '.join(problems)} and the catalog is at generation "
                f"{have}: nothing proves the catalog holds every acknowledged deletion"
            )
        else:
            report.problems.extend(f"superblock {sb} {p}" for p in problems)
        return
    if have < acked:
        report.problems.append(
            f"catalog generation {have} is behind the acknowledged generation {acked} "
            "(superblock): the write-ahead log lost committed deletions"
        )
    elif have > acked:
        report.problems.append(
            f"superblock generation {acked} trails the catalog's {have} (the next open records it)"
        )
    report.problems.extend(f"superblock {sb} {p}" for p in problems)


def _check_frame(
    row: CatalogRow, files: dict[int, Path], sizes: dict[int, int], fds: dict[int, int]
) -> str:
    path = files.get(row.seg)
    if path is None:
        return f"segment seg-{row.seg:08d} is missing"
    size = sizes[row.seg]
    if row.off % ALIGN or row.off + HEADER_BYTES + row.nbytes > size:
        flen = frame_len(row.nbytes)
        return f"frame at {row.off} (+{flen}) lies beyond the segment's {size} bytes"
    try:
        fd = fds.get(row.seg)
        if fd is None:
            fd = fds[row.seg] = os.open(path, os.O_RDONLY)
        data = os.pread(fd, HEADER_BYTES + row.nbytes, row.off)
    except OSError as exc:
        return f"read failed: {exc}"
    if len(data) < HEADER_BYTES + row.nbytes:
        return f"truncated: {len(data)} bytes"
    payload = np.frombuffer(data, dtype=np.uint8, offset=HEADER_BYTES)
    return row.verify(data[:HEADER_BYTES], [payload])


def check_frame(
    row: CatalogRow,
    fd: int | None,
    length: int,
    io: FileIO,
    *,
    header: bool = True,
    full: bool = True,
) -> str:
    """Empty if the frame a row names matches it, else what is wrong.

    ``fd`` and ``length`` are the row's segment file (None: there is none). Always
    checks that the frame lies inside the file; with ``header`` reads the frame header
    and checks it against the row, with ``full`` the payload's checksum too. Reads go
    through ``io`` into an aligned buffer, so ``fd`` may be open for direct I/O.
    """
    if fd is None:
        return f"segment seg-{row.seg:08d} is missing"
    flen = frame_len(row.nbytes)
    if row.off % ALIGN or row.off + HEADER_BYTES + row.nbytes > length:
        return f"frame at {row.off} (+{flen}) lies beyond the segment's {length} bytes"
    if not header and not full:
        return ""
    buf = aligned_empty(flen if full else HEADER_BYTES)
    try:
        got = io.preadv(fd, [buf], row.off)
    except OSError as exc:
        return f"read failed: {exc}"
    if got < (HEADER_BYTES + row.nbytes if full else HEADER_BYTES):
        return f"truncated: {got} bytes"
    payload = [buf[HEADER_BYTES : HEADER_BYTES + row.nbytes]] if full else None
    return row.verify(buf.data[:HEADER_BYTES], payload)


def prepare_repair(path: str | Path) -> list[str]:
    """Fix what keeps the store at ``path`` from opening; returns what was done.

    Rebuilds the catalog's indexes when SQLite's integrity check fails (and raises
    :class:`CatalogCorrupt` if that does not cure it), and when the catalog cannot be
    proven current (behind the superblock's generation, or the superblock lost after
    rows were deleted) drops every row, since any of them may be a replica whose
    invalidation was lost; the next open then sets the segments aside and the fix
    deletes them. A missing catalog beside segment data is not repaired
    (:class:`CatalogMissing`: restore it, or move the segments away).
    """
    root = Path(path)
    disk = _disk_dir(root)
    actions: list[str] = []
    with _locked(root, exclusive=True):
        catalog_path = disk / "catalog.sqlite"
        segdir = disk / "segments"
        has_data = any(_size(p) > 0 for p in _segments(segdir).values())
        if not catalog_path.exists():
            if has_data:
                raise CatalogMissing(catalog_path, segdir)
            return actions
        sb = Superblock(disk / FILE_NAME, FileIO(direct=False))
        try:
            cat = Catalog(
                catalog_path, create=not has_data, initial_generation=sb.read().generation or 0
            )
        except BaseException:
            sb.close()
            raise
        try:
            problems = cat.integrity()
            if problems:
                cat.reindex()
                still = cat.integrity()
                if still:
                    raise CatalogCorrupt(
                        catalog_path,
                        "integrity check still fails after rebuilding the indexes: "
                        + "; ".join(still[:3]),
                    )
                actions.append(f"rebuilt the catalog's indexes ({problems[0]})")
            state = sb.read()
            have, acked = cat.generation, state.generation
            if (acked is None and have > 0) or (acked is not None and have < acked):
                why = (
                    f"the superblock is lost ({'; '.join(state.problems)})"
                    if acked is None
                    else f"its generation {have} is behind the acknowledged {acked}"
                )
                n = cat.drop_all(acked or 0)
                actions.append(
                    f"dropped all {n} catalog rows: the catalog cannot be proven current "
                    f"({why}), so any row might be a replica whose invalidation was lost"
                )
            if state.generation != cat.generation or None in state.generations:
                sb.write_both(cat.generation)
                actions.append(f"rewrote the superblock at generation {cat.generation}")
        finally:
            cat.close()
            sb.close()
    return actions

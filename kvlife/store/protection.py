"""Parity protection of the disk tiers' segment files, between sessions.

With ``StoreConfig(segment_parity=(k, m))`` a clean close groups the sealed segment files
of every disk tier ``k`` at a time and writes ``m`` parity files per group under
``<tier>/parity/`` (:mod:`kvlife.transforms.parity`, ISA-L Reed-Solomon). Segment files
are immutable once their session ended (a session writes only to segments it created),
so a group stays valid until one of its members is removed (emptied or compacted away)
or rewritten; the next close drops such a group and protects its survivors anew.

The next open, before any tier reads its files, rebuilds every segment file that a
group protects, that the catalog still names, and that is gone (deleted, lost with its
disk), or, with ``verify_on_open="full"``, whose bytes decayed in place (same size,
inode and mtime, another xxh3-128): bit-exact, verified against the checksum recorded
at protection, atomically renamed into place. Up to ``m`` files of a group may be gone
at once (members removed on purpose count as gone). What could not be rebuilt is
counted and left to the tier's own recovery (its rows are quarantined, never served).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvlife.core.errors import KVLifeError
from kvlife.store.config import StoreConfig
from kvlife.tiers.kinds import DiskOptions
from kvlife.transforms.parity import (
    MANIFEST_SUFFIX,
    PARITY_SUFFIX,
    ParityError,
    ParityGroup,
    UnknownParityFormat,
    member_status,
    parity_intact,
    protect_files,
    read_group,
    rebuild_files,
)

PARITY_DIR = "parity"
_SEG_RE = re.compile(r"^seg-(\d{8})\.kvs$")


@dataclass(slots=True)
class ParityOutcome:
    """What one protection or repair pass did."""

    groups_written: int = 0
    segments_protected: int = 0
    groups_dropped: int = 0
    """Groups whose members changed or went (their survivors were protected anew)."""
    rebuilt: list[str] = field(default_factory=list)
    """Segment files rebuilt from parity (tier/segment)."""
    unrecoverable: list[str] = field(default_factory=list)
    """Lost segment files parity could not rebuild, with why."""
    unusable: list[str] = field(default_factory=list)
    """Manifests that could not be read (damaged, or of an unknown format)."""


def _disk_dirs(path: Path, config: StoreConfig) -> list[Path]:
    return [path / spec.name for spec in config.chain if spec.kind == "disk"]


def _groups(pdir: Path, out: ParityOutcome) -> list[tuple[Path, ParityGroup]]:
    found = []
    for manifest in sorted(pdir.glob(f"*{MANIFEST_SUFFIX}")):
        try:
            found.append((manifest, read_group(manifest)))
        except ParityError as exc:
            out.unusable.append(str(exc))
    return found


def _referenced(tier_dir: Path) -> set[int] | None:
    """Segment ids the catalog's rows name (None: no readable catalog)."""
    from kvlife.tiers.disk.catalog import Catalog

    path = tier_dir / "catalog.sqlite"
    if not path.exists():
        return None
    try:
        cat = Catalog(path, readonly=True)
    except KVLifeError:
        return None  # the tier's open reports it
    try:
        return {s.seg for s in cat.scan() if s.seg is not None}
    except KVLifeError:
        return None
    finally:
        cat.close()


def _sweep(directory: Path, pattern: str) -> None:
    """Remove what a pass killed midway left behind (never a file a group names)."""
    for p in directory.glob(pattern):
        p.unlink(missing_ok=True)


def _full_verify(config: StoreConfig, tier: str) -> bool:
    spec = next(t for t in config.chain if t.name == tier)
    return isinstance(spec.config, DiskOptions) and spec.config.verify_on_open == "full"


def repair(path: Path, config: StoreConfig) -> ParityOutcome:
    """Rebuild lost segment files from parity (at open, before the tiers open); with
    ``verify_on_open="full"`` also those whose bytes decayed in place (every protected
    segment is hashed against its manifest first)."""
    out = ParityOutcome()
    if config.segment_parity is None:
        return out
    for tier_dir in _disk_dirs(path, config):
        pdir, segdir = tier_dir / PARITY_DIR, tier_dir / "segments"
        if not pdir.is_dir():
            continue
        if segdir.is_dir():
            _sweep(segdir, ".seg-*.kvs.rebuild")
        groups = _groups(pdir, out)
        if not groups:
            continue
        referenced = _referenced(tier_dir)
        if referenced is None:
            continue
        full = _full_verify(config, tier_dir.name)
        for _, group in groups:
            status = member_status(group, segdir, full=full)
            lost = [
                n
                for n, why in status.items()
                if why in ("absent", "damaged")
                and (m := _SEG_RE.match(n))
                and int(m.group(1)) in referenced
            ]
            if not lost:
                continue
            erased = [n for n in status if n not in lost]
            try:
                rebuild_files(group, segdir, pdir, lost, erased=erased)
            except (ParityError, OSError) as exc:
                out.unrecoverable += [f"{tier_dir.name}/{n}: {exc}" for n in lost]
                continue
            out.rebuilt += [f"{tier_dir.name}/{n}" for n in lost]
    return out


def _keep_valid_groups(pdir: Path, segdir: Path, out: ParityOutcome) -> set[str]:
    """Drop groups whose members changed or went, damaged manifests and parity files no
    manifest names (a pass killed midway); returns the members still covered. A
    manifest of an unknown format (a newer kvlife's) is left alone, with its parity."""
    covered: set[str] = set()
    for manifest in sorted(pdir.glob(f"*{MANIFEST_SUFFIX}")):
        try:
            group = read_group(manifest)
        except UnknownParityFormat as exc:
            out.unusable.append(str(exc))
            continue
        except ParityError as exc:
            out.unusable.append(str(exc))
            manifest.unlink()
            continue
        if not member_status(group, segdir) and parity_intact(group, pdir):
            covered.update(x.name for x in group.members)
            continue
        manifest.unlink()  # the manifest first: a group without it does not exist
        for x in group.parity:
            (pdir / x.name).unlink(missing_ok=True)
        out.groups_dropped += 1
    _sweep(pdir, ".*.tmp")
    for p in pdir.glob(f"*{PARITY_SUFFIX}"):
        group_name = p.name.rsplit(".", 2)[0]
        if not (pdir / f"{group_name}{MANIFEST_SUFFIX}").exists():
            p.unlink()
    return covered


def protect(path: Path, config: StoreConfig) -> ParityOutcome:
    """Protect every sealed segment not in a valid group (at close, tiers closed)."""
    out = ParityOutcome()
    if config.segment_parity is None:
        return out
    k, m = config.segment_parity
    for tier_dir in _disk_dirs(path, config):
        pdir, segdir = tier_dir / PARITY_DIR, tier_dir / "segments"
        if not segdir.is_dir():
            continue
        covered: set[str] = set()
        if pdir.is_dir():
            covered = _keep_valid_groups(pdir, segdir, out)
        todo = sorted(
            p
            for p in segdir.iterdir()
            if _SEG_RE.match(p.name) and p.name not in covered and p.stat().st_size > 0
        )
        for i in range(0, len(todo), k):
            part = todo[i : i + k]
            name = f"g-{part[0].name[4:12]}-{part[-1].name[4:12]}-{time.time_ns():x}"
            protect_files(part, pdir, name, k=k, m=m)
            out.groups_written += 1
            out.segments_protected += len(part)
    return out

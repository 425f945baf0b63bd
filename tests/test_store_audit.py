"""``check`` runs beside serving (issue 18, hole 7): while an audit is in the middle of
its reads, lookups, disk loads, ``info``, puts and invalidations all complete; a row
deleted while it was being audited is not reported; damage is still found."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from kvlife.core.identity import PUBLIC, ModelIdentity
from kvlife.faults.damage import flip, scan_frames
from kvlife.store import KVStore
from kvlife.tiers.base import AuditReport
from tests.conftest import TINY, prompt_kv

C = TINY.chunk_nbytes
N = TINY.tokens_per_chunk
WAIT = 10.0  # seconds: a bound for "does not wait for the audit", never a speed claim


class PausedAudit:
    """``store.check`` in a thread that stops inside its first replica check (the
    progress callback) until released."""

    def __init__(self, store: KVStore, fix: bool = False) -> None:
        self.inside = threading.Event()
        self.release = threading.Event()
        self.report: list[AuditReport] = []
        self.thread = threading.Thread(
            target=lambda: self.report.append(store.check(fix=fix, progress=self._progress)),
            daemon=True,
        )

    def _progress(self, nbytes: int) -> None:
        if not self.inside.is_set():
            self.inside.set()
            self.release.wait(60)

    def __enter__(self) -> PausedAudit:
        self.thread.start()
        assert self.inside.wait(WAIT), "the audit never reached its first replica"
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.thread.join(60)
        assert not self.thread.is_alive()


def finishes(fn: Callable[[], object]) -> object:
    """Run ``fn`` in a thread; its result if it returns within WAIT (else fail)."""
    box: list[object] = []
    t = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    t.start()
    t.join(WAIT)
    assert not t.is_alive(), "waited for the audit"
    return box[0]


def test_serving_goes_on_while_an_audit_reads(tmp_path: Path, identity: ModelIdentity) -> None:
    prompts = [prompt_kv(seed, 3 * N) for seed in range(4)]
    with KVStore.open(
        tmp_path, dram_bytes=16 * C, disk_bytes=1 << 24, segment_bytes=1 << 20
    ) as store:
        keys = [store.put_prompt(identity, PUBLIC, t, kv).keys for t, kv in prompts[:3]]
        store.evict("dram", 16 * C)  # everything on disk only
        with PausedAudit(store) as audit:
            hit = finishes(lambda: store.lookup(identity, PUBLIC, prompts[0][0]))
            res = finishes(lambda: store.load(hit))  # type: ignore[arg-type]
            assert res.loaded == 3 and res.tiers == {"disk": 3}  # type: ignore[attr-defined]
            info = finishes(store.info)
            assert info.tiers[1].replicas == 9  # type: ignore[attr-defined]
            t3, kv3 = prompts[3]
            put = finishes(lambda: store.put_prompt(identity, PUBLIC, t3, kv3))
            assert put.stored == 3  # type: ignore[attr-defined]
            gone = finishes(lambda: store.invalidate(prefix=keys[1][0]))
            assert gone == 3
            store.drain()
            assert not audit.report
        report = audit.report[0]
        assert report.clean
        assert report.rows == 6, "rows deleted during the audit are not reported"


def test_a_row_deleted_while_audited_is_not_reported_but_damage_is(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    prompts = [prompt_kv(seed, 2 * N) for seed in (10, 11)]
    with KVStore.open(tmp_path, dram_bytes=0, disk_bytes=1 << 24, segment_bytes=1 << 20) as store:
        a, b = (store.put_prompt(identity, PUBLIC, t, kv).keys for t, kv in prompts)
        frames = {f.key: f for f in scan_frames(tmp_path)}
        with PausedAudit(store, fix=True):
            for key in (a[1], b[1]):  # damaged while the audit runs
                f = frames[key]
                flip(f.segment, f.payload_offset + 1, 2)
            assert finishes(lambda: store.invalidate(prefix=a[0])) == 2  # A goes meanwhile
        store.drain()
    with KVStore.open(tmp_path, dram_bytes=0, disk_bytes=1 << 24, segment_bytes=1 << 20) as store:
        assert store.indexed_keys() == [b[0]], "check --fix dropped the damaged row of B"


def test_a_segment_emptied_under_an_audit_is_removed_when_the_audit_leaves(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """Invalidating every row of the sealed segment the audit is reading: its file
    outlives the audit's reads (as under a load) and is removed once the audit leaves."""
    t, kv = prompt_kv(20, 3 * N)
    with KVStore.open(tmp_path, dram_bytes=0, disk_bytes=1 << 24, segment_bytes=1 << 14) as store:
        keys = store.put_prompt(identity, PUBLIC, t, kv).keys
        first = min(f.segment for f in scan_frames(tmp_path))  # two frames, sealed
        with PausedAudit(store) as audit:
            assert finishes(lambda: store.invalidate(prefix=keys[0])) == 3
            assert first.exists(), "a segment was unlinked under the audit's reads"
        assert audit.report[0].problems == []
        assert not first.exists(), "the emptied segment outlived the audit"


def test_the_open_and_the_closed_store_get_the_same_audit(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """One audit: ``check`` of the open store and ``kvlife check`` of the closed one
    report the same damage in the same words (a payload flipped, a superblock copy
    damaged while the store was open)."""
    from kvlife.tiers.disk.audit import audit_directory

    prompts = [prompt_kv(seed, 2 * N) for seed in (30, 31)]
    with KVStore.open(tmp_path, dram_bytes=0, disk_bytes=1 << 24, segment_bytes=1 << 20) as store:
        keys = [store.put_prompt(identity, PUBLIC, t, kv).keys for t, kv in prompts]
        frame = {f.key: f for f in scan_frames(tmp_path)}[keys[1][0]]
        flip(frame.segment, frame.payload_offset + 3, 1)
        flip(tmp_path / "disk" / "superblock", 4096 + 20, 1)  # copy 1 of 2
        opened = store.check()
    closed = audit_directory(tmp_path)
    assert opened.bad_keys == closed.bad_keys == [keys[1][0]]
    assert len(opened.problems) == 2, opened.problems
    assert opened.problems == closed.problems
    assert (opened.rows, opened.ok) == (closed.rows, closed.ok) == (4, 3)
    assert opened.orphan_segments == closed.orphan_segments == []

"""The ceiling of a served disk load into the caller's own buffers that ``kvlife bench
server`` measures beside its disk loads (:class:`kvlife.bench.limits.ReadCopier`): it
reads every byte from the file, copies every byte into the caller's buffer and hashes
every byte, once (the machine's fastest copy and hash: each block hashed, then streamed
from the cache), or it is not that ceiling."""

from __future__ import annotations

import threading
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import xxhash

from kvlife.bench.limits import ReadCopier
from kvlife.native import copies as native_copies
from kvlife.tiers.buffers import aligned_empty
from kvlife.tiers.disk.fileio import probe_direct_io


def _file(tmp_path: Path, sizes: list[int], seed: int) -> tuple[Path, list[bytes]]:
    rng = np.random.default_rng(seed)
    blobs = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    path = tmp_path / "objects"
    path.write_bytes(b"".join(blobs))
    return path, blobs


class _Spy:
    """Where each copy-and-hash call wrote (buffer address, length), from any thread;
    each call's seal is checked against xxhash's own digest of the bytes it copied."""

    def __init__(self) -> None:
        self.spans: list[tuple[int, int]] = []
        self.lock = threading.Lock()
        self.real = native_copies.copy_sealed
        self.wrong: list[int] = []

    def __call__(self, dst: np.ndarray, src: np.ndarray) -> bytes:
        seal = self.real(dst, src)
        with self.lock:
            self.spans.append((dst.ctypes.data, dst.nbytes))
            if seal != xxhash.xxh3_128_digest(np.ascontiguousarray(dst).data):
                self.wrong.append(dst.ctypes.data)
        return seal

    def covered_once(self, outs: list[np.ndarray]) -> bool:
        """Every byte of ``outs`` hashed exactly once, nothing else hashed."""
        hits = [np.zeros(o.nbytes, np.int32) for o in outs]
        for addr, n in self.spans:
            for o, h in zip(outs, hits, strict=True):
                base = o.ctypes.data
                if base <= addr < base + o.nbytes:
                    assert addr + n <= base + o.nbytes
                    h[addr - base : addr - base + n] += 1
                    break
            else:
                return False  # hashed something that is not a copy in the outs
        return not self.wrong and all((h == 1).all() for h in hits)


@pytest.mark.parametrize("copiers", [1, 2])
@pytest.mark.parametrize(
    ("sizes", "piece"),
    [
        ([1 << 16, 3 * 4096, 4096], 4096),
        ([5 * 4096, 2 * 4096], 3 * 4096),
        ([1 << 20], 1 << 22),
        ([9 * 4096 + 100], 4 * 4096),
    ],
)
def test_every_byte_is_read_copied_out_and_hashed_there_once(
    tmp_path: Path, sizes: list[int], piece: int, copiers: int
) -> None:
    path, blobs = _file(tmp_path, sizes, 1)
    stage = [np.zeros(n, np.uint8) for n in sizes]
    outs = [np.zeros(n, np.uint8) for n in sizes]
    spy = _Spy()
    with mock.patch.object(native_copies, "copy_sealed", spy), ReadCopier(piece, copiers) as rc:
        assert rc.read_copy(path, stage, outs, direct=False) > 0
        assert [o.tobytes() for o in outs] == blobs
        assert spy.covered_once(outs)
        assert max(n for _, n in spy.spans) <= piece
        # a second call on the same threads reads the file again
        for o in outs:
            o[:] = 0
        spy.spans.clear()
        rc.read_copy(path, stage, outs, direct=False)
        assert [o.tobytes() for o in outs] == blobs
        assert spy.covered_once(outs)


@pytest.mark.parametrize("copiers", [1, 2])
def test_a_short_file_raises_and_the_next_call_still_works(tmp_path: Path, copiers: int) -> None:
    path, blobs = _file(tmp_path, [3 * 4096], 2)
    stage = [np.zeros(4 * 4096, np.uint8)]
    outs = [np.zeros(4 * 4096, np.uint8)]
    with ReadCopier(2 * 4096, copiers) as rc:
        with pytest.raises(OSError, match="short raw read"):
            rc.read_copy(path, stage, outs, direct=False)
        fits = [np.zeros(3 * 4096, np.uint8)]
        copied = [np.zeros(3 * 4096, np.uint8)]
        rc.read_copy(path, fits, copied, direct=False)  # nothing of the failed call left
        assert copied[0].tobytes() == blobs[0]


def test_buffers_that_do_not_pair_odd_pieces_and_copiers_are_refused(tmp_path: Path) -> None:
    path, _ = _file(tmp_path, [4096], 3)
    with pytest.raises(ValueError, match="4 KiB pages"):
        ReadCopier(1000)
    with pytest.raises(ValueError, match="1 or 2"):
        ReadCopier(4096, copiers=3)
    with ReadCopier(4096) as rc:
        with pytest.raises(ValueError, match="equal sizes"):
            rc.read_copy(path, [np.zeros(4096, np.uint8)], [np.zeros(2048, np.uint8)], False)
        strided = np.zeros((4096, 2), np.uint8)[:, 0]
        with pytest.raises(ValueError, match="C-contiguous"):
            rc.read_copy(path, [np.zeros(4096, np.uint8)], [strided], False)


@pytest.mark.parametrize("copiers", [1, 2])
def test_o_direct_reads_into_aligned_stage_buffers_copy_every_byte(
    tmp_path: Path, copiers: int
) -> None:
    """The way ``kvlife bench server`` runs it: O_DIRECT reads (where the directory
    takes them) into page-aligned stage buffers, pieces of 4 MiB, objects of 1 and 6 MiB
    (one read, and a read of 4 MiB then one of 2)."""
    if not probe_direct_io(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    sizes = [1 << 20, 6 << 20]
    path, blobs = _file(tmp_path, sizes, 4)
    stage = [aligned_empty(n) for n in sizes]
    outs = [np.zeros(n, np.uint8) for n in sizes]
    spy = _Spy()
    with mock.patch.object(native_copies, "copy_sealed", spy), ReadCopier(copiers=copiers) as rc:
        assert rc.read_copy(path, stage, outs, direct=True) > 0
    assert [o.tobytes() for o in outs] == blobs
    assert spy.covered_once(outs)

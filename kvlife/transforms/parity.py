"""Parity: k-of-n erasure coding (pyeclib, ISA-L ``isa_l_rs_vand``) of chunks and of files.

:class:`ParityCode` splits a byte string into ``k`` data and ``m`` parity fragments, any
``k`` of which give it back bit-exact. :func:`protect_files` applies it across a group of
up to ``k`` immutable files (the disk tier's sealed segment files): it writes ``m`` parity
files and a manifest, and :func:`rebuild_files` recreates up to ``m`` lost members (or
parity files) bit-exact from the others, each verified against the xxh3-128 the manifest
recorded before it replaces anything.

The code is systematic: data fragment ``i`` of a stripe is member ``i``'s bytes at that
stripe (zero padded), so only the parity fragments are stored; the data fragments'
pyeclib headers (80 bytes each) are kept in the manifest to hand surviving members back
to the decoder. Files are coded in stripes of ``stripe_bytes`` per member, so memory
stays at ``(k + m) * stripe_bytes`` whatever the file sizes.

Manifest (``<group>.kvpar``): ``b"KVPM"``, xxh3-64 of the body, a msgpack body led by the
manifest format; a damaged manifest is a :class:`ParityError`, a newer format an
:class:`UnknownParityFormat` (a group this reader does not use, never a crash).
Writes are atomic (temporary file, fsync, rename, directory fsync).
"""

from __future__ import annotations

import functools
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import xxhash

from kvlife.core.errors import InvalidArgument, KVLifeError

BACKEND = "isa_l_rs_vand"
"""pyeclib backend: Reed-Solomon (Vandermonde) from Intel ISA-L."""
FRAGMENT_HEADER = 80
"""Bytes of pyeclib's header in front of every fragment."""
MANIFEST_FORMAT = 1
MANIFEST_MAGIC = b"KVPM"
MANIFEST_SUFFIX = ".kvpar"
PARITY_SUFFIX = ".kvp"
STRIPE_BYTES = 1 << 20
_HEAD = struct.Struct("<4sQ")


class ParityError(KVLifeError):
    """A parity group or fragment set that cannot do what was asked (damaged manifest,
    too many losses, a rebuilt file that does not verify)."""


class UnknownParityFormat(ParityError):
    """A manifest of a format (or backend) this reader does not know."""


def _driver(k: int, m: int) -> Any:
    try:
        from pyeclib.ec_iface import ECDriver
    except ImportError as exc:  # the transforms extra
        raise ParityError(
            "parity needs pyeclib (pip install 'kvlife[transforms]' or pip install pyeclib)"
        ) from exc
    return ECDriver(k=k, m=m, ec_type=BACKEND)


@functools.lru_cache(maxsize=32)
def _cached_driver(k: int, m: int) -> Any:
    return _driver(k, m)


class ParityCode:
    """``k`` data + ``m`` parity fragments; any ``k`` rebuild the data bit-exact."""

    def __init__(self, k: int, m: int) -> None:
        if not (isinstance(k, int) and isinstance(m, int)) or k < 1 or m < 1 or k + m > 32:
            raise InvalidArgument(f"parity needs 1 <= k, 1 <= m, k + m <= 32; got k={k}, m={m}")
        self.k = k
        self.m = m
        self._ec = _cached_driver(k, m)

    @property
    def n(self) -> int:
        return self.k + self.m

    def encode(self, data: bytes) -> list[bytes]:
        """``n`` fragments (each with its pyeclib header), data fragments first."""
        frags: list[bytes] = self._ec.encode(data)
        return frags

    def decode(self, fragments: Sequence[bytes]) -> bytes:
        """The data from at least ``k`` of its fragments (any of them)."""
        if len(fragments) < self.k:
            raise ParityError(f"{len(fragments)} fragments given, {self.k} needed")
        try:
            out: bytes = self._ec.decode(list(fragments))
        except Exception as exc:  # pyeclib raises its own hierarchy
            raise ParityError(f"parity decode failed: {exc}") from exc
        return out

    def reconstruct(self, fragments: Sequence[bytes], missing: Sequence[int]) -> list[bytes]:
        """Fragments ``missing`` (indices) from at least ``k`` others."""
        if len(fragments) < self.k:
            raise ParityError(f"{len(fragments)} fragments left, {self.k} needed to rebuild")
        try:
            out: list[bytes] = self._ec.reconstruct(list(fragments), list(missing))
        except Exception as exc:
            raise ParityError(f"parity reconstruct failed: {exc}") from exc
        return out


# ---------------------------------------------------------------------- file groups


@dataclass(frozen=True, slots=True)
class Member:
    """One protected file."""

    name: str
    size: int
    xxh3: bytes
    """xxh3-128 of the whole file."""
    stamp: tuple[int, int] = (0, 0)
    """(inode, mtime in ns) when protected: a file of that name written since (a new
    segment that reuses a name) is not this member any more."""


@dataclass(frozen=True, slots=True)
class ParityGroup:
    """A manifest: which files one set of parity files protects, and how."""

    name: str
    """Group name (the manifest is ``<name>.kvpar`` in the parity directory)."""
    k: int
    m: int
    stripe_bytes: int
    members: tuple[Member, ...]
    """The data files, in fragment order (at most k; fewer use a smaller code)."""
    parity: tuple[Member, ...]
    """The m parity files."""
    headers: tuple[tuple[bytes, ...], ...]
    """Per stripe, the pyeclib header of each member's data fragment."""

    @property
    def stripes(self) -> int:
        return len(self.headers)

    def encode(self) -> bytes:
        body = bytes(
            msgpack.packb(
                [
                    MANIFEST_FORMAT,
                    BACKEND,
                    self.name,
                    self.k,
                    self.m,
                    self.stripe_bytes,
                    [[x.name, x.size, x.xxh3, list(x.stamp)] for x in self.members],
                    [[x.name, x.size, x.xxh3, list(x.stamp)] for x in self.parity],
                    [list(h) for h in self.headers],
                ],
                use_bin_type=True,
            )
        )
        return _HEAD.pack(MANIFEST_MAGIC, xxhash.xxh3_64_intdigest(body)) + body

    @classmethod
    def decode(cls, data: bytes, where: str = "manifest") -> ParityGroup:
        if len(data) < _HEAD.size:
            raise ParityError(f"{where}: {len(data)} bytes, shorter than its header")
        magic, digest = _HEAD.unpack_from(data)
        body = data[_HEAD.size :]
        if magic != MANIFEST_MAGIC or xxhash.xxh3_64_intdigest(body) != digest:
            raise ParityError(f"{where}: bad magic or checksum (damaged)")
        try:
            v = msgpack.unpackb(body, raw=False)
        except (ValueError, msgpack.UnpackException) as exc:
            raise ParityError(f"{where}: not msgpack: {exc}") from exc
        if not isinstance(v, list) or not v:
            raise ParityError(f"{where}: not a manifest")
        if v[0] != MANIFEST_FORMAT or len(v) != 9:
            raise UnknownParityFormat(f"{where}: manifest format {v[0]!r} is not known")
        _, backend, name, k, m, stripe, members, parity, headers = v
        if backend != BACKEND:
            raise UnknownParityFormat(f"{where}: backend {backend!r} is not {BACKEND!r}")
        try:
            group = cls(
                str(name),
                int(k),
                int(m),
                int(stripe),
                tuple(
                    Member(str(a), int(b), bytes(c), (int(d[0]), int(d[1])))
                    for a, b, c, d in members
                ),
                tuple(
                    Member(str(a), int(b), bytes(c), (int(d[0]), int(d[1])))
                    for a, b, c, d in parity
                ),
                tuple(tuple(bytes(x) for x in h) for h in headers),
            )
        except (TypeError, ValueError) as exc:
            raise ParityError(f"{where}: fields have wrong types: {exc}") from exc
        group.check(where)
        return group

    def check(self, where: str) -> None:
        r = len(self.members)
        if not (1 <= r <= self.k and self.m >= 1 and len(self.parity) == self.m):
            raise ParityError(
                f"{where}: {r} members / {len(self.parity)} parity files for k={self.k}, m={self.m}"
            )
        need = -(-max(x.size for x in self.members) // self.stripe_bytes) if r else 0
        if self.stripe_bytes < 1 or len(self.headers) != need:
            raise ParityError(f"{where}: {len(self.headers)} stripes recorded, {need} needed")
        if any(len(h) != r or any(len(x) != FRAGMENT_HEADER for x in h) for h in self.headers):
            raise ParityError(f"{where}: fragment headers do not match the members")
        names = [x.name for x in self.members + self.parity]
        if len(set(names)) != len(names) or any(os.sep in n or n.startswith(".") for n in names):
            raise ParityError(f"{where}: member names are not distinct plain file names")


def stamp_of(path: Path) -> tuple[int, int]:
    st = path.stat()
    return (st.st_ino, st.st_mtime_ns)


def _file_xxh3(path: Path) -> bytes:
    h = xxhash.xxh3_128()
    with path.open("rb") as fh:
        while block := fh.read(1 << 22):
            h.update(block)
    return bytes(h.digest())


def _stripe(fh: Any, j: int, stripe: int) -> bytes:
    fh.seek(j * stripe)
    data: bytes = fh.read(stripe)
    return data.ljust(stripe, b"\0")


def _write_atomic(path: Path, chunks: Callable[[Any], None]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as fh:
        chunks(fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def protect_files(
    files: Sequence[Path],
    parity_dir: Path,
    name: str,
    *,
    k: int,
    m: int,
    stripe_bytes: int = STRIPE_BYTES,
) -> ParityGroup:
    """Write ``m`` parity files and the manifest ``<name>.kvpar`` for ``files`` (at most
    ``k``, each immutable from now on). The manifest is written last: a group exists
    only once all of its parity is durable."""
    if not 1 <= len(files) <= k:
        raise InvalidArgument(f"a parity group holds 1..{k} files, got {len(files)}")
    if stripe_bytes < 4096 or stripe_bytes % 4096:
        raise InvalidArgument(f"stripe_bytes must be a multiple of 4096, got {stripe_bytes}")
    r = len(files)
    code = ParityCode(r, m)
    sizes = [f.stat().st_size for f in files]
    stripes = -(-max(sizes) // stripe_bytes)
    parity_dir.mkdir(parents=True, exist_ok=True)
    ppaths = [parity_dir / f"{name}.p{i}{PARITY_SUFFIX}" for i in range(m)]
    tmps = [p.with_name(f".{p.name}.tmp") for p in ppaths]
    member_hash = [xxhash.xxh3_128() for _ in files]
    parity_hash = [xxhash.xxh3_128() for _ in ppaths]
    headers: list[tuple[bytes, ...]] = []
    fhs = [f.open("rb") for f in files]
    outs = [t.open("wb") for t in tmps]
    try:
        for j in range(stripes):
            parts = [_stripe(fh, j, stripe_bytes) for fh in fhs]
            for i, part in enumerate(parts):
                member_hash[i].update(
                    part[: max(0, min(stripe_bytes, sizes[i] - j * stripe_bytes))]
                )
            frags = code.encode(b"".join(parts))
            if len(frags[0]) != FRAGMENT_HEADER + stripe_bytes:
                raise ParityError(
                    f"pyeclib made {len(frags[0])}-byte fragments for {stripe_bytes}-byte stripes"
                )
            for i in range(r):  # systematic: the data fragment is the member's stripe
                if frags[i][FRAGMENT_HEADER:] != parts[i]:
                    raise ParityError("pyeclib's code is not systematic here")
            headers.append(tuple(frags[i][:FRAGMENT_HEADER] for i in range(r)))
            for p in range(m):
                outs[p].write(frags[r + p])
                parity_hash[p].update(frags[r + p])
        for out in outs:
            out.flush()
            os.fsync(out.fileno())
    finally:
        for fh in fhs:
            fh.close()
        for out in outs:
            out.close()
    for tmp, path in zip(tmps, ppaths, strict=True):
        os.replace(tmp, path)
    for f, size in zip(files, sizes, strict=True):
        if f.stat().st_size != size:
            raise ParityError(f"{f} changed while it was being protected")
    group = ParityGroup(
        name,
        k,
        m,
        stripe_bytes,
        tuple(
            Member(f.name, s, bytes(h.digest()), stamp_of(f))
            for f, s, h in zip(files, sizes, member_hash, strict=True)
        ),
        tuple(
            Member(
                p.name,
                stripes * (FRAGMENT_HEADER + stripe_bytes),
                bytes(h.digest()),
                stamp_of(p),
            )
            for p, h in zip(ppaths, parity_hash, strict=True)
        ),
        tuple(headers),
    )
    blob = group.encode()
    _write_atomic(parity_dir / f"{name}{MANIFEST_SUFFIX}", lambda fh: fh.write(blob))
    return group


def read_group(path: Path) -> ParityGroup:
    """A manifest file (ParityError if damaged, UnknownParityFormat if not known)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ParityError(f"cannot read parity manifest {path}: {exc}") from exc
    return ParityGroup.decode(data, str(path))


def member_status(group: ParityGroup, data_dir: Path, *, full: bool = False) -> dict[str, str]:
    """Members that are not as protected, by name: ``absent``; ``changed`` (another
    size, inode or mtime: rewritten, so not this member any more); with ``full``,
    ``damaged`` (same size, inode and mtime but other bytes: decayed in place). Members
    not listed are intact."""
    out: dict[str, str] = {}
    for x in group.members:
        p = data_dir / x.name
        try:
            if p.stat().st_size != x.size or stamp_of(p) != x.stamp:
                out[x.name] = "changed"
            elif full and _file_xxh3(p) != x.xxh3:
                out[x.name] = "damaged"
        except FileNotFoundError:
            out[x.name] = "absent"
    return out


def parity_intact(group: ParityGroup, parity_dir: Path) -> bool:
    """Every parity file is there as written."""
    for x in group.parity:
        p = parity_dir / x.name
        try:
            if p.stat().st_size != x.size or stamp_of(p) != x.stamp:
                return False
        except FileNotFoundError:
            return False
    return True


def rebuild_files(
    group: ParityGroup,
    data_dir: Path,
    parity_dir: Path,
    lost: Sequence[str],
    *,
    erased: Sequence[str] = (),
) -> list[Path]:
    """Recreate the ``lost`` members bit-exact from the surviving members and parity;
    ``erased`` members are not used (they changed) and not written.

    Survivors must be as protected (size, inode, mtime); every rebuilt file is verified
    against its recorded xxh3-128 before it is renamed into place (a failure leaves
    nothing behind). ParityError if more than ``m`` fragments are gone or a result does
    not verify."""
    names = [x.name for x in group.members]
    unknown = [x for x in (*lost, *erased) if x not in names]
    if unknown:
        raise InvalidArgument(f"{unknown} are not members of parity group {group.name}")
    r = len(group.members)
    code = ParityCode(r, group.m)
    lost_idx = sorted(names.index(x) for x in lost)
    gone = set(lost_idx) | {names.index(x) for x in erased}
    alive = [i for i in range(r) if i not in gone]
    status = member_status(group, data_dir)
    changed = [group.members[i].name for i in alive if group.members[i].name in status]
    if changed:
        raise ParityError(f"members {changed} changed too: more than the lost files are gone")
    parity_ok = [
        p
        for p, x in enumerate(group.parity)
        if (parity_dir / x.name).exists()
        and (parity_dir / x.name).stat().st_size == x.size
        and stamp_of(parity_dir / x.name) == x.stamp
    ]
    if len(alive) + len(parity_ok) < r:
        raise ParityError(
            f"group {group.name}: {len(gone)} members and "
            f"{group.m - len(parity_ok)} parity files lost, only {group.m} can be rebuilt"
        )
    stripe = group.stripe_bytes
    flen = FRAGMENT_HEADER + stripe
    tmps = {i: data_dir / f".{group.members[i].name}.rebuild" for i in lost_idx}
    fhs = {i: (data_dir / group.members[i].name).open("rb") for i in alive}
    phs = {p: (parity_dir / group.parity[p].name).open("rb") for p in parity_ok}
    outs = {i: tmps[i].open("wb") for i in lost_idx}
    hashes = {i: xxhash.xxh3_128() for i in lost_idx}
    try:
        for j in range(group.stripes):
            frags = [group.headers[j][i] + _stripe(fhs[i], j, stripe) for i in alive]
            for q in parity_ok:
                phs[q].seek(j * flen)
                frags.append(phs[q].read(flen))
            got = code.reconstruct(frags[:r], lost_idx) if lost_idx else []
            for i, frag in zip(lost_idx, got, strict=True):
                size = group.members[i].size
                body = frag[FRAGMENT_HEADER:][: max(0, min(stripe, size - j * stripe))]
                outs[i].write(body)
                hashes[i].update(body)
        for i in lost_idx:
            outs[i].flush()
            os.fsync(outs[i].fileno())
    except BaseException:
        for i in lost_idx:
            outs[i].close()
            tmps[i].unlink(missing_ok=True)
        raise
    finally:
        for fh in (*fhs.values(), *phs.values(), *outs.values()):
            fh.close()
    bad = [
        group.members[i].name
        for i in lost_idx
        if bytes(hashes[i].digest()) != group.members[i].xxh3
    ]
    if bad:
        for t in tmps.values():
            t.unlink(missing_ok=True)
        raise ParityError(f"group {group.name}: rebuilt {bad} do not match their checksums")
    done = []
    for i in lost_idx:
        path = data_dir / group.members[i].name
        os.replace(tmps[i], path)
        done.append(path)
    fd = os.open(data_dir, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return done

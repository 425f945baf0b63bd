"""The per-store secret that keys every namespace's salt.

A namespace's salt is BLAKE3 in keyed mode over the namespace's canonical encoding,
keyed with this secret (:attr:`kvlife.core.identity.Namespace.salt_key`). Clients never
see it, so no client can compute, guess or choose another tenant's salt, hence its chunk
keys. It lives in the store's directory (``tenancy.secret``, 32 random bytes, mode 0600,
owned by the server's user), created on first start with ``O_EXCL`` (two starts racing
agree on one) and refused if anyone else could read or replace it.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from kvlife.core.errors import StorePathError
from kvlife.core.identity import KEY_BYTES

SECRET_FILE = "tenancy.secret"


def store_secret(store_dir: Path) -> bytes:
    """The secret of the store in ``store_dir``, created on first use. StorePathError if
    it cannot be made, is not a regular file of :data:`KEY_BYTES` bytes owned by this
    user, or is readable or writable by group or others."""
    path = store_dir / SECRET_FILE
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return _create(path)
    except OSError as exc:
        raise StorePathError(f"cannot open the store's secret {path}: {exc}") from None
    try:
        return _read(path, fd)
    finally:
        os.close(fd)


def _read(path: Path, fd: int) -> bytes:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        raise StorePathError(f"the store's secret {path} is not a file of this user")
    if st.st_mode & 0o077:
        raise StorePathError(
            f"the store's secret {path} has mode {stat.S_IMODE(st.st_mode):o}; it must be "
            "0600 (anyone who reads it can compute every tenant's keys)"
        )
    data = os.read(fd, KEY_BYTES + 1)
    if len(data) != KEY_BYTES:
        raise StorePathError(f"the store's secret {path} is {len(data)} bytes, not {KEY_BYTES}")
    return data


def _create(path: Path) -> bytes:
    secret = os.urandom(KEY_BYTES)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        excl = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(tmp, excl, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            os.write(fd, secret)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # fails if another start made one first: use that one
        except FileExistsError:
            return store_secret(path.parent)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        return secret
    except OSError as exc:
        raise StorePathError(f"cannot create the store's secret {path}: {exc}") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()

"""Typed errors of the device models in :mod:`kvlife.sim`.

A bad configuration (an impossible NAND geometry, an unknown cell type, a negative
bandwidth), a request the model cannot serve (more bytes than the device holds, a clock
that runs backwards) and a malformed trace each get their own class, so that callers can
tell a mistake in their input from a broken invariant inside a model. Every message names
the field or value that was wrong. All inherit from :class:`kvlife.core.errors.KVLifeError`.
"""

from __future__ import annotations

from kvlife.core.errors import KVLifeError


class SimError(KVLifeError):
    """Base class of every error the simulator raises on purpose."""


class DeviceConfigError(SimError, ValueError):
    """A device configuration that cannot describe a real device (named field and value)."""


class UnknownCellTypeError(DeviceConfigError):
    """A NAND cell type name that is not one of SLC, MLC, TLC, QLC."""

    def __init__(self, name: object, known: tuple[str, ...]) -> None:
        self.name = name
        self.known = known
        super().__init__(f"unknown NAND cell type {name!r}; known cell types: {', '.join(known)}")


class ClockOrderError(SimError, ValueError):
    """A request whose ``t_now`` is earlier than one the device already served.

    Device models queue requests first come, first served on a virtual clock; a request
    from the past would silently reorder that queue, so it is refused instead.
    """


class RequestError(SimError, ValueError):
    """A request with an impossible argument (negative size, a time that is not finite)."""


class DeviceFullError(SimError):
    """A write that needs more logical space than the device has free.

    A caller (a tier) is expected to check :meth:`free_bytes` and evict first; writing past
    the logical capacity is a broken contract, not a shortfall to be papered over.
    """


class FtlInvariantError(SimError):
    """The flash translation layer found its own state inconsistent (a bug, never input)."""


class TraceFormatError(SimError, ValueError):
    """A trace line that does not follow the expected format (file, line and field named)."""

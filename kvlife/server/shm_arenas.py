"""Tenants' arenas: on a server with principals (``--tenants``), each principal's private
replicas live in an arena file only its Unix user (or group) can map, and a session maps
its own principal's arena only.

Why: with one arena every client maps every tenant's DRAM replicas read-write
(docs/server.md, "Trust boundary"). Here the server creates ``<arena>-t-<principal>``
owned by the principal's Unix user, mode 0600 (a principal named by ``gids`` only: the
server's user and that group, mode 0660), before any byte is in it; the kernel then
refuses every other user's ``open`` (EACCES). Which arena a replica lives in follows its
namespace (:meth:`TenantArenas.home`): a private scope's (``request:<p>/...``,
``user:<p>``) lives in ``p``'s arena when it has one; organisation and public replicas,
and anything else, in the tier's own arena, which no client of such a server maps (a
reader gets a copy in its own arena, made by the server). So the zero-copy data path
(hints, staged extents, grants, shared buffers) stays within one principal's arena, and
a writer cannot change a shared replica after its commit (it was copied out of the
writer's arena).

A session maps an arena only if its peer's credentials are ones that arena admits (the
owner uid, or for a group arena the primary gid): a principal with no Unix user (a
token only), or a session whose peer is another user than its principal's arena
admits, gets no mapping; it puts and loads through the socket (``put_inline``, a load
with ``inline``), copies both ways.

Arenas are made at a principal's first ``hello``, sparse (each is as large as the
tier's own arena: allocated whole, they would multiply the memory): the pages of each
extent are allocated as it is handed out (:meth:`~kvlife.tiers.shm.Arena.alloc`), and
an extent the filesystem has no room for is no room (counted in ``arena_unbacked``),
never a page whose first write kills the writer with SIGBUS. Clients map them
unpopulated. They are removed with the tier. Their sizes are the tenants file's
(``[arenas]``, :class:`~kvlife.tenancy.principals.ArenaBudget`): each principal's
``arena_bytes``, else ``principal_bytes``, else as large as the tier's own arena (never
larger); all of them together within ``total_bytes``. A principal whose arena would
pass that bound gets none (StorageFullError naming the figures; its sessions then put
and load through the socket, as a token-only principal's do). A principal's arena holds
its staged extents and the replicas of its private scopes: a put it stages into a full
arena is refused with StorageFullError naming the principal and its arena's size (the
client then puts through the socket); a replica copied in (a put through the socket, a
promotion) that does not fit goes to the tier's own arena instead (which no client
maps; counted in :attr:`~kvlife.tiers.shm.ShmTier.home_overflow`, served to its
principal as a copy, through the socket when its arena has no room for that either).
"""

from __future__ import annotations

import os
import threading

from kvlife.core.errors import InvalidArgument, StorageFullError
from kvlife.core.identity import NamespaceKind
from kvlife.core.objects import ObjectInfo
from kvlife.tenancy.names import REQUEST_SEPARATOR
from kvlife.tenancy.principals import ArenaBudget, Principal
from kvlife.tiers.base import ReplicaMeta
from kvlife.tiers.buffers import round_up
from kvlife.tiers.shm import Arena, Owner, ShmTier

PRIVATE_KINDS = (NamespaceKind.USER.value, NamespaceKind.REQUEST.value)
"""Namespace kinds whose objects only their principal reads."""


def owner_of(principal: Principal) -> Owner | None:
    """Who may map ``principal``'s arena: its lowest uid (0600), else the server's user
    and its lowest gid (0660); None for a principal with neither (token only)."""
    if principal.uids:
        return Owner(min(principal.uids), os.getegid(), 0o600)
    if principal.gids:
        return Owner(os.geteuid(), min(principal.gids), 0o660)
    return None


def admits(owner: Owner, uid: int | None, gid: int | None) -> bool:
    """Whether a peer of ``uid``/``gid`` may map an arena of ``owner`` (decided as the
    kernel would for the owner and primary group, conservatively: supplementary groups
    are not counted)."""
    if uid is not None and uid == owner.uid:
        return True
    return owner.mode & 0o060 == 0o060 and gid is not None and gid == owner.gid


def private_owner(namespace: str) -> str | None:
    """The principal whose private scope ``namespace`` (its text, as the store records
    it) is; None for a shared scope (organisation, public) or another text."""
    kind, _, name = namespace.partition(":")
    if kind == NamespaceKind.USER.value:
        return name or None
    if kind == NamespaceKind.REQUEST.value and REQUEST_SEPARATOR in name:
        return name.partition(REQUEST_SEPARATOR)[0] or None
    return None


class TenantArenas:
    """Each principal's arena, made on first use, and the tier's choice of arena for a
    new replica."""

    def __init__(self, shm: ShmTier, budget: ArenaBudget | None = None) -> None:
        self.shm = shm
        self.budget = budget if budget is not None else ArenaBudget()
        self._lock = threading.Lock()
        self._by_name: dict[str, Arena] = {}
        self._owner: dict[int, str] = {}
        """Each arena's principal, by the arena's id (for error messages)."""
        self.made_bytes = 0
        """Bytes of every principal's arena made so far (within ``budget.total_bytes``)."""
        shm.home = self.home

    def size_of(self, principal: Principal) -> int:
        """Bytes of ``principal``'s arena (whole pages): its own ``arena_bytes``, else the
        budget's ``principal_bytes``, at most (and by default) the tier's own arena's."""
        base = self.shm.arena.size
        want = principal.arena_bytes or self.budget.principal_bytes or base
        return round_up(min(want, base))

    def whose(self, arena: Arena) -> str | None:
        """The principal whose arena ``arena`` is (None: the tier's own, or another)."""
        with self._lock:
            return self._owner.get(id(arena))

    def arena_of(self, principal: Principal) -> Arena | None:
        """``principal``'s arena (made now if it has none yet); None without a Unix
        owner. NotPermitted if the server cannot give the file away (no CAP_CHOWN)."""
        owner = owner_of(principal)
        if owner is None:
            return None
        with self._lock:
            arena = self._by_name.get(principal.name)
            if arena is None:
                size = self.size_of(principal)
                total = self.budget.total_bytes
                if total is not None and self.made_bytes + size > total:
                    raise StorageFullError(
                        f"principal {principal.name}'s arena of {size} bytes does not fit: "
                        f"{len(self._by_name)} principals' arenas take {self.made_bytes} of "
                        f"the {total} bytes of [arenas] total_bytes in the tenants file "
                        "(its sessions put and load through the socket)"
                    )
                base = self.shm.arena
                path = base.path.with_name(f"{base.path.name}-t-{principal.name}")
                arena = Arena(path, size, populate_pages=False, owner=owner)
                try:
                    self.shm.add_arena(principal.name, arena)
                except InvalidArgument:
                    arena.unlink()
                    raise
                self._by_name[principal.name] = arena
                self._owner[id(arena)] = principal.name
                self.made_bytes += arena.size
            return arena

    def home(self, meta: ReplicaMeta) -> Arena | None:
        """The arena of a private scope's replica: its principal's, if it has one; None
        (the tier's own) for anything else."""
        try:
            namespace = ObjectInfo.decode(meta.info).namespace
        except InvalidArgument:
            return None
        name = private_owner(namespace)
        if name is None:
            return None
        with self._lock:
            return self._by_name.get(name)

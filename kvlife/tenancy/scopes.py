"""Scopes: request < user < organisation < public, what a principal may read and
write, as namespaces keyed with the store's secret.

A client names a scope, never another tenant: ``request:<id>``, ``user``,
``organisation`` or ``public`` (``user:<own name>`` and ``organisation:<own org>`` are
accepted too). The server turns it into the stored namespace with the principal's own
name: ``request:<principal>/<id>``, ``user:<principal>``,
``organisation:<principal's organisation>``, ``public``; each keyed
(:attr:`~kvlife.core.identity.Namespace.salt_key`), so its chunk keys are the server's
alone to compute.

- **Reads**: a lookup searches, most private first, the named scope and every wider one
  the principal may read (its request, its user, its organisation, public); the scope
  with the longest run of hits answers (a tie: the more private).
- **Writes** go to the named scope, if the principal may write there: its request, its
  user, its organisation (a member writes its organisation's scope); **public only by an
  admin**, so nobody can plant KV that others' lookups would find.

Whether a principal may use a scope depends on the principal and the scope's name only,
never on what is stored, so a refusal (:class:`~kvlife.core.errors.NotPermitted`)
reveals nothing about other tenants' objects.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlife.core.errors import InvalidArgument, NotPermitted
from kvlife.core.identity import KEY_BYTES, Namespace, NamespaceKind
from kvlife.tenancy.names import REQUEST_SEPARATOR, check_name
from kvlife.tenancy.principals import Principal

ORDER = (
    NamespaceKind.REQUEST,
    NamespaceKind.USER,
    NamespaceKind.ORGANISATION,
    NamespaceKind.PUBLIC,
)
"""Most private first."""

_KINDS = {k.value: k for k in NamespaceKind}


@dataclass(frozen=True, slots=True)
class Scopes:
    """The scopes of one store: namespaces keyed with its secret."""

    secret: bytes
    """The store's secret (:func:`kvlife.tenancy.secret.store_secret`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.secret, bytes) or len(self.secret) != KEY_BYTES:
            raise InvalidArgument(f"a store's secret is {KEY_BYTES} bytes")

    def namespace(
        self, principal: Principal, kind: NamespaceKind, request_id: str = ""
    ) -> Namespace:
        """The keyed namespace of ``principal``'s scope ``kind`` (a request's: of
        ``request_id``). NotPermitted for an organisation scope of a principal that has
        none; InvalidArgument for a bad request id."""
        if kind is NamespaceKind.REQUEST:
            rid = check_name("request id", request_id)
            name = f"{principal.name}{REQUEST_SEPARATOR}{rid}"
        elif kind is NamespaceKind.USER:
            name = principal.name
        elif kind is NamespaceKind.ORGANISATION:
            if not principal.organisation:
                raise NotPermitted(f"principal {principal.name} belongs to no organisation")
            name = principal.organisation
        else:
            name = ""
        return Namespace(kind, name, salt_key=self.secret)

    def named(self, principal: Principal, text: str) -> Namespace:
        """The namespace a client names by ``text`` (see the module docstring):
        InvalidArgument for a malformed one, NotPermitted for another principal's."""
        if not isinstance(text, str):
            raise InvalidArgument(f"namespace must be a str, got {type(text).__name__}")
        kind_text, sep, name = text.partition(":")
        kind = _KINDS.get(kind_text)
        if kind is None:
            raise InvalidArgument(f"namespace {text[:64]!a}: scope must be one of {sorted(_KINDS)}")
        if kind is NamespaceKind.REQUEST:
            return self.namespace(principal, kind, name if sep else "")
        if sep:
            check_name("namespace name", name)
        own = {
            NamespaceKind.USER: principal.name,
            NamespaceKind.ORGANISATION: principal.organisation,
            NamespaceKind.PUBLIC: "",
        }[kind]
        if sep and name != own:
            raise NotPermitted(
                f"principal {principal.name} may not use namespace {kind.value}:{name}"
            )
        return self.namespace(principal, kind)

    def for_write(self, principal: Principal, text: str) -> Namespace:
        """The namespace a put names, if ``principal`` may write it (NotPermitted: public
        without admin)."""
        ns = self.named(principal, text)
        if ns.kind is NamespaceKind.PUBLIC and not principal.admin:
            raise NotPermitted(
                f"principal {principal.name} may not write the public scope (admins only)"
            )
        return ns

    def for_read(self, principal: Principal, text: str) -> list[Namespace]:
        """The namespaces a lookup naming ``text`` searches, most private first: the
        named scope and every wider one the principal may read."""
        return self.wider(principal, self.named(principal, text))

    def wider(self, principal: Principal, first: Namespace) -> list[Namespace]:
        """``first`` (one of ``principal``'s namespaces) and every wider scope the
        principal may read, most private first."""
        out = [first]
        for kind in ORDER[ORDER.index(first.kind) + 1 :]:
            if kind is NamespaceKind.ORGANISATION and not principal.organisation:
                continue
            out.append(self.namespace(principal, kind))
        return out

    @staticmethod
    def may_read(principal: Principal, stored: str) -> bool:
        """Whether ``principal`` may read an object stored under the namespace whose
        text is ``stored`` (``str(Namespace)``, as the store records it)."""
        kind, _, name = stored.partition(":")
        if kind == NamespaceKind.PUBLIC.value:
            return name == ""
        if kind == NamespaceKind.USER.value:
            return name == principal.name
        if kind == NamespaceKind.ORGANISATION.value:
            return bool(principal.organisation) and name == principal.organisation
        if kind == NamespaceKind.REQUEST.value:
            return name.startswith(principal.name + REQUEST_SEPARATOR)
        return False

"""Tenants enforced by the store: who is connected (principals), what each may read
and write (scopes), and the per-store secret that keys every namespace's salt.

- :mod:`kvlife.tenancy.names`: the names a tenant may use (no separators, no control
  characters), checked before anything is keyed or stored.
- :mod:`kvlife.tenancy.secret`: the store's secret (``tenancy.secret``, mode 0600,
  created on first start) that keys namespace salts; clients never see it.
- :mod:`kvlife.tenancy.principals`: the server's configuration of principals (Unix
  users and groups, tokens, roles) and the resolution of a connection to one.
- :mod:`kvlife.tenancy.scopes`: request < user < organisation < public, what a
  principal may read (most private first) and write, as keyed namespaces.
- :mod:`kvlife.tenancy.counters`: what each principal's own requests did (the only
  counters a non-admin tenant sees through the server).

An embedded store's process is trusted and names its tenant:
``Scopes(secret).namespace(principal, kind)`` gives it the same keyed namespace the
server would.
"""

from kvlife.tenancy.names import check_name
from kvlife.tenancy.policy import ADMIN_VERBS, Tenancy
from kvlife.tenancy.principals import Principal, TenancyConfig, load_config, token_digest
from kvlife.tenancy.scopes import Scopes
from kvlife.tenancy.secret import store_secret

__all__ = [
    "ADMIN_VERBS",
    "Principal",
    "Scopes",
    "Tenancy",
    "TenancyConfig",
    "check_name",
    "load_config",
    "store_secret",
    "token_digest",
]

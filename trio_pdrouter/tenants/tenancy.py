"""Whose request is this: the key that authenticated it, or a trusted gateway's header.

Rules of this module (pure: the app gives it the bearer token and the header's value):

* A key is required when the router has ``--api-key`` or its tenants file has keys; then a
  request passes with ``--api-key``'s key or any key of the file, and nothing else.
* With ``--tenant-header``, the header names the tenant (the gateway in front authenticated the
  caller); a name the file does not have, or no header, is the default tenant. Otherwise a key of
  the file names its tenant, and ``--api-key``'s key (or no key, where none is required) is the
  default tenant.
* The book in force is read at each request, so a reloaded file takes effect at once.
"""

from __future__ import annotations

import hmac

from .book import Tenant, TenantBook
from .source import TenantsFile


class Tenancy:
    """``api_key``: ``--api-key``; ``source``: the tenants file (None: only the default tenant);
    ``header``: ``--tenant-header`` (lower case, as the app sees header names)."""

    def __init__(
        self, api_key: str | None, source: TenantsFile | None, header: str | None = None
    ) -> None:
        self._api_key = None if api_key is None else api_key.encode()
        self.source = source
        self.header = None if header is None else header.strip().lower()
        self._empty = TenantBook()

    @property
    def book(self) -> TenantBook:
        return self._empty if self.source is None else self.source.book

    def requires_key(self) -> bool:
        return self._api_key is not None or bool(self.book.keys)

    def tenant_of(self, token: bytes | None, named: str | None = None) -> Tenant | None:
        """The request's tenant; None when it is not authorized (no or a wrong key)."""
        book = self.book
        keyed = None if token is None else book.by_key(token)
        if self.requires_key() and keyed is None:
            router_key = self._api_key
            if router_key is None or token is None or not hmac.compare_digest(token, router_key):
                return None
        if self.header is not None:
            return book.named(named) if named else book.default
        return keyed or book.default

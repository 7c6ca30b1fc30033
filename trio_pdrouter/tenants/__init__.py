"""Tenants: who a request is for, and what each tenant holds.

A request's tenant is named by the API key that authenticated it (a key of ``--tenants-file``)
or by the header a trusted gateway sets (``--tenant-header``); every other request is the default
tenant's. :class:`TenantBook` is the file parsed, :class:`TenantsFile` the file reloaded when it
changes, :class:`TenantLedger` each tenant's in-flight, queued and served numbers and its token
pace (:class:`MachineTenantLedger`: the same machine-wide, ``--workers N``). Admission
(:mod:`trio_pdrouter.serve.admission`) decides with them.

Contract: synchronous numbers and a file watch; nothing here admits or refuses. May import the
config and the machine table.
"""

from __future__ import annotations

from .book import (
    DEFAULT,
    DEFAULT_TENANT,
    MAX_TENANTS,
    Tenant,
    TenantBook,
    TenantsFileError,
    parse_book,
)
from .ledger import BURST_SECONDS, MachineTenantLedger, TenantLedger, share, tenant_key
from .source import CHECK_INTERVAL, TenantsFile, load
from .tenancy import Tenancy

__all__ = [
    "BURST_SECONDS",
    "CHECK_INTERVAL",
    "DEFAULT",
    "DEFAULT_TENANT",
    "MAX_TENANTS",
    "MachineTenantLedger",
    "Tenancy",
    "Tenant",
    "TenantBook",
    "TenantLedger",
    "TenantsFile",
    "TenantsFileError",
    "load",
    "parse_book",
    "share",
    "tenant_key",
]

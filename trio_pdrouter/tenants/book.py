"""The tenants file: who the tenants are, their keys, weights and limits.

Rules of this module (pure: reading the file is the caller's, parsing is here):

* The file is TOML (read with the standard library's ``tomllib``): one table per tenant under
  ``[tenants.NAME]``, each with optional ``keys`` (a list of API keys that authenticate as the
  tenant), ``weight`` (a positive number, 1 by default: its share of saturated capacity),
  ``max_concurrent_requests`` and ``tokens_per_second`` (positive integers; absent: no limit).
* A tenant named :data:`DEFAULT` is the **default tenant**: requests that name no tenant of the
  file (no key of the file, or no or an unknown ``--tenant-header``) are its. Absent from the
  file, it has weight 1 and no limits.
* A key belongs to one tenant; a key given twice, an unknown field, a non-positive weight or limit
  is an error (:class:`TenantsFileError`, one line naming the place) — a typo must not silently
  drop a limit.
* Keys are looked up by their SHA-256 digest, so finding a key's tenant does not compare the
  presented key with the stored ones byte by byte.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from collections.abc import Mapping
from typing import Any

import attrs

#: The tenant of requests that name no tenant of the file.
DEFAULT = "default"
#: What a tenant's name may be: it is a metric label value and a log field.
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
#: The most tenants a file may name (each takes a slot of the machine table with --workers N).
MAX_TENANTS = 1000
_FIELDS = frozenset({"keys", "weight", "max_concurrent_requests", "tokens_per_second"})


class TenantsFileError(ValueError):
    """The tenants file cannot be used; the message says where and why (one line)."""


@attrs.frozen
class Tenant:
    """One tenant: its name, weight and limits (None: no limit)."""

    name: str = DEFAULT
    weight: float = 1.0
    max_concurrent_requests: int | None = None
    tokens_per_second: int | None = None


#: The default tenant when the file does not describe one (and of a router without a file).
DEFAULT_TENANT = Tenant()


def key_digest(key: str | bytes) -> bytes:
    raw = key.encode() if isinstance(key, str) else key
    return hashlib.sha256(raw).digest()


@attrs.frozen
class TenantBook:
    """Every tenant of the file by name, and each key's tenant (by the key's digest)."""

    tenants: Mapping[str, Tenant] = attrs.field(factory=lambda: {DEFAULT: DEFAULT_TENANT})
    keys: Mapping[bytes, str] = attrs.field(factory=dict)

    @property
    def default(self) -> Tenant:
        return self.tenants[DEFAULT]

    def by_key(self, key: bytes) -> Tenant | None:
        """The tenant ``key`` authenticates as, None if it is no key of the file."""
        name = self.keys.get(key_digest(key))
        return None if name is None else self.tenants[name]

    def named(self, name: str) -> Tenant:
        """The tenant called ``name``; the default tenant for a name the file does not have."""
        return self.tenants.get(name) or self.default

    def names(self) -> list[str]:
        return sorted(self.tenants)


def parse_book(text: str, where: str = "the tenants file") -> TenantBook:
    """The book ``text`` describes; raises :class:`TenantsFileError`."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TenantsFileError(f"{where} is not valid TOML: {exc}") from None
    extra = set(data) - {"tenants"}
    if extra:
        raise TenantsFileError(f"{where}: unknown top-level key {sorted(extra)[0]!r}")
    tables = data.get("tenants", {})
    if not isinstance(tables, dict):
        raise TenantsFileError(f"{where}: 'tenants' must be a table of [tenants.NAME] tables")
    if len(tables) > MAX_TENANTS:
        raise TenantsFileError(f"{where}: {len(tables)} tenants, at most {MAX_TENANTS}")
    tenants = {DEFAULT: DEFAULT_TENANT}
    keys: dict[bytes, str] = {}
    for name, table in tables.items():
        at = f"{where}: [tenants.{name}]"
        if not NAME.match(name):
            raise TenantsFileError(f"{at}: a name is 1-64 letters, digits, '_', '.', '-'")
        if not isinstance(table, dict):
            raise TenantsFileError(f"{at} must be a table")
        unknown = set(table) - _FIELDS
        if unknown:
            raise TenantsFileError(f"{at}: unknown field {sorted(unknown)[0]!r}")
        tenants[name] = Tenant(
            name,
            _weight(table.get("weight", 1), at),
            _limit(table, "max_concurrent_requests", at),
            _limit(table, "tokens_per_second", at),
        )
        for key in _keys(table.get("keys", []), at):
            digest = key_digest(key)
            if digest in keys:
                raise TenantsFileError(f"{at}: a key is given twice (also for {keys[digest]!r})")
            keys[digest] = name
    if DEFAULT in keys.values():
        raise TenantsFileError(f"{where}: [tenants.{DEFAULT}] is for requests without a key")
    return TenantBook(tenants, keys)


def _weight(value: Any, at: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise TenantsFileError(f"{at}: weight must be a positive number, not {value!r}")
    return float(value)


def _limit(table: Mapping[str, Any], field: str, at: str) -> int | None:
    value = table.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TenantsFileError(f"{at}: {field} must be a positive integer, not {value!r}")
    return value


def _keys(value: Any, at: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(k, str) and k for k in value):
        raise TenantsFileError(f"{at}: keys must be a list of non-empty strings")
    return value

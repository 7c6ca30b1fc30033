"""The effective configuration as an operator reads it: each flag's spelling and value, secrets
redacted (``GET /admin/config``).

A flag whose name ends in ``-key``, ``-token``, ``-password`` or ``-secret`` shows
:data:`REDACTED` when set, and a URL's password (``redis://user:password@host``) is replaced by
it wherever a value holds one. Flags of vllm-router that are refused (see :mod:`.refused`) are
left out: they can only be at their defaults.
"""

from __future__ import annotations

import re
from typing import Any

import attrs

from .flags import Flag, declared
from .router import RouterConfig

__all__ = ["REDACTED", "effective"]

REDACTED = "<redacted>"
_SECRET_NAME = re.compile(r"-(key|token|password|secret)$")
#: ``scheme://user:password@`` in a URL.
_URL_PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.-]*://[^/@:\s]*:)[^/@\s]*(?P<at>@)", re.I)


def effective(config: RouterConfig) -> dict[str, Any]:
    """``{"--flag": value}`` for every flag ``config`` declares, in ``--help``'s order."""
    out: dict[str, Any] = {}
    for path, _field, option in declared(RouterConfig):
        if not isinstance(option, Flag) or option.refused is not None:
            continue  # a switch sets a field its flag also shows
        value: Any = config
        for name in path:
            value = getattr(value, name)
        out[option.spelling] = _shown(option.spelling, value)
    return out


def _shown(spelling: str, value: Any) -> Any:
    if value is not None and _SECRET_NAME.search(spelling):
        return REDACTED
    if isinstance(value, str):
        return _URL_PASSWORD.sub(rf"\g<head>{REDACTED}\g<at>", value)
    if isinstance(value, tuple | list):
        return [_shown(spelling, item) for item in value]
    if attrs.has(type(value)):
        return attrs.asdict(value)
    return value

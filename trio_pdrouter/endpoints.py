"""Endpoints: the unit that routing chooses and that the load ledger counts.

A vLLM server at one URL may run several data-parallel engines ("DP ranks"). Each rank is its own
:class:`Endpoint` with its own load; all ranks of a URL share that URL's connection pool and are
addressed with the ``X-data-parallel-rank`` header.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from urllib.parse import urlsplit

import attrs


class Role(enum.Enum):
    """Which leg an endpoint serves."""

    PREFILL = "prefill"
    DECODE = "decode"
    REGULAR = "regular"


@attrs.frozen
class Endpoint:
    """One schedulable engine: a server URL, optionally one DP rank of it."""

    url: str
    role: Role
    rank: int | None = None

    @property
    def key(self) -> str:
        """The name used in ``/get_loads`` and logs: ``url`` or ``url@rank``."""
        return self.url if self.rank is None else f"{self.url}@{self.rank}"

    def __str__(self) -> str:
        return self.key


def normalize_url(url: str) -> str:
    """Validate an upstream base URL and strip a trailing slash.

    The one check of upstream URLs: the command line and ``POST /workers`` both come here.
    Raises ``ValueError`` with a message fit for a command-line user.
    """
    parts = urlsplit(url)
    if parts.scheme == "https":
        raise ValueError(
            f"{url!r}: https upstreams are not supported yet: the upstream transport speaks"
            " plain HTTP; use http://"
        )
    if parts.scheme != "http":
        raise ValueError(f"{url!r}: the URL must start with http://")
    if not parts.hostname:
        raise ValueError(f"{url!r}: the URL has no host")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{url!r}: {exc}") from None
    if port is None:
        raise ValueError(f"{url!r}: the URL needs an explicit port")
    if parts.query or parts.fragment:
        raise ValueError(f"{url!r}: the URL may not carry a query or fragment")
    return url.rstrip("/")


def expand(urls: Iterable[str], role: Role, dp_size: int) -> tuple[Endpoint, ...]:
    """Turn server URLs into endpoints; ``dp_size > 1`` gives ranks ``0..dp_size-1`` per URL."""
    out: list[Endpoint] = []
    for raw in urls:
        url = normalize_url(raw)
        if dp_size > 1:
            out.extend(Endpoint(url, role, rank) for rank in range(dp_size))
        else:
            out.append(Endpoint(url, role))
    return tuple(out)

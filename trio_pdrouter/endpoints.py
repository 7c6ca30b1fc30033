"""Endpoints: the unit that routing chooses and that the load ledger counts.

A vLLM server at one URL may run several data-parallel engines ("DP ranks"). Each rank is its own
:class:`Endpoint` with its own load; all ranks of a URL share that URL's connection pool and are
addressed with the ``X-data-parallel-rank`` header.
"""

from __future__ import annotations

import enum
import ipaddress
import re
from collections.abc import Iterable
from urllib.parse import urlsplit

import attrs


class Role(enum.Enum):
    """Which leg an endpoint serves."""

    PREFILL = "prefill"
    DECODE = "decode"
    REGULAR = "regular"


@attrs.frozen(cache_hash=True)  # hashed per request in every ledger and routing table
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


#: A host name (RFC 1123 labels, with the underscores container names use) or an IPv4 address;
#: IPv6 literals are checked by ipaddress.
_NUMERIC_LABEL = re.compile(r"0x[0-9a-f]*|[0-9]+")
_HOST_NAME = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)(\.(?!-)[a-z0-9_-]{1,63}(?<!-))*\.?")


def normalize_url(url: str) -> str:
    """Validate an upstream base URL and return its canonical form.

    The one check of upstream URLs: the command line and ``POST /workers`` both come here, so
    whatever reaches the health probes, the scrapes and the transport is a plain
    ``http://host:port[/path]``: lower-case host, explicit port, no trailing slash, no user
    info, no whitespace or control characters. One server spelled two ways gives one form, so
    duplicates are found. Raises ``ValueError`` with a message fit for a command-line user.
    """
    if not url.isascii() or any(not c.isprintable() or c.isspace() for c in url):
        raise ValueError(
            f"{url!r}: the URL may not contain spaces, control or non-ASCII characters"
        )
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "https":
        raise ValueError(
            f"{url!r}: https upstreams are not supported yet: the upstream transport speaks"
            " plain HTTP; use http://"
        )
    if scheme != "http":
        raise ValueError(f"{url!r}: the URL must start with http://")
    if "@" in parts.netloc:
        raise ValueError(f"{url!r}: the URL may not carry a user name or password")
    host = parts.hostname
    if not host:
        raise ValueError(f"{url!r}: the URL has no host")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{url!r}: {exc}") from None
    if port is None or port == 0:
        raise ValueError(f"{url!r}: the URL needs an explicit port (1-65535)")
    if parts.query or parts.fragment or "?" in url or "#" in url:
        raise ValueError(f"{url!r}: the URL may not carry a query or fragment")
    if ":" in host:
        try:
            host = f"[{ipaddress.IPv6Address(host).compressed}]"
        except ValueError:
            raise ValueError(f"{url!r}: {host!r} is not a valid IPv6 address") from None
    elif not _HOST_NAME.fullmatch(host):
        raise ValueError(f"{url!r}: {host!r} is not a valid host name")
    elif _NUMERIC_LABEL.fullmatch(host.rstrip(".").rsplit(".", 1)[-1]):
        # A name ending in a number is an IPv4 address to resolvers, which read 127.1,
        # 0x7f.1, 2130706433 and 0177.0.0.1 alike: only the a.b.c.d form is taken.
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise ValueError(
                f"{url!r}: {host!r} is a numeric address in a form resolvers read differently;"
                " write it as four decimal numbers (a.b.c.d)"
            ) from None
    return f"http://{host}:{port}{parts.path.rstrip('/')}"


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


#: Addresses no inference engine has, refused for servers that arrive at run time: link-local
#: (where clouds serve instance metadata, 169.254.169.254), unspecified, broadcast, multicast.
_NEVER_AN_ENGINE = tuple(
    ipaddress.ip_network(net)
    for net in (
        "169.254.0.0/16",
        "fe80::/10",
        "0.0.0.0/32",
        "::/128",
        "255.255.255.255/32",
        "224.0.0.0/4",
        "ff00::/8",
    )
)


def host_address(url: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address a normalized URL names (an IPv4 address carried in IPv6 as itself);
    None for a host name."""
    host = urlsplit(url).hostname or ""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


@attrs.frozen
class UpstreamPolicy:
    """Which upstream addresses may arrive at run time (``POST /workers``, discovered pods).

    A host that is an address no engine has (:data:`_NEVER_AN_ENGINE`) is refused; with
    ``allowed`` networks (``--allowed-upstream-networks``) the host must be an address inside
    one of them, and a name is refused (it could resolve anywhere). The command line's servers
    are the operator's own: only the allow-list applies to them (:meth:`check_configured`).
    """

    allowed: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()

    def check(self, url: str) -> None:
        """Raise ``ValueError`` naming the rule if ``url`` (normalized) may not be added."""
        address = host_address(url)
        if address is not None and any(address in net for net in _NEVER_AN_ENGINE):
            raise ValueError(
                f"{url}: {address} is a link-local, unspecified, broadcast or multicast address,"
                " where no engine listens (169.254.169.254 is a cloud's metadata service)"
            )
        self.check_configured(url)

    def check_configured(self, url: str) -> None:
        """Raise ``ValueError`` if ``url`` is outside the allow-list (when there is one)."""
        if not self.allowed:
            return
        address = host_address(url)
        if address is None:
            raise ValueError(
                f"{url}: with --allowed-upstream-networks an upstream must be an IP address"
                " (a name could resolve outside them)"
            )
        if not any(address in net for net in self.allowed):
            nets = ", ".join(str(net) for net in self.allowed)
            raise ValueError(f"{url}: {address} is outside --allowed-upstream-networks ({nets})")

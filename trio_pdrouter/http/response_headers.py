"""Which of an upstream's response headers reach the client.

The rule, in one place: everything the engine sent, except what belongs to its connection to the
router or that the router sets itself —

* hop-by-hop headers (RFC 9110 §7.6.1) and every header the upstream's ``Connection`` names;
* ``content-length`` and ``transfer-encoding``: the router frames the client's body itself (it
  may rewrite a body, and it relays a stream chunk by chunk);
* ``date`` and ``server``: hypercorn adds its own;
* the routing headers (``x-request-id``, ``x-trio-pdrouter-*``): the attempt adds them.
"""

from __future__ import annotations

import httpx

from .asgi import Headers

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
    }
)
REPLACED = frozenset({b"content-length", b"date", b"server", b"x-request-id"})
DROPPED = HOP_BY_HOP | REPLACED
ROUTING_PREFIX = b"x-trio-pdrouter-"


def passed_on(headers: httpx.Headers) -> list[tuple[bytes, bytes]]:
    """The headers of an upstream response that the client gets, names in lower case."""
    out = []
    named: set[bytes] = set()
    for raw_name, value in headers.raw:  # one pass: this runs once per response
        name = raw_name.lower()
        if name in DROPPED or name.startswith(ROUTING_PREFIX):
            if name == b"connection":
                named.update(token.strip().lower() for token in value.split(b","))
            continue
        out.append((name, value))
    if named:
        out = [(name, value) for name, value in out if name not in named]
    return out


def with_default(headers: Headers, name: bytes, value: bytes) -> list[tuple[bytes, bytes]]:
    """``headers`` plus ``name: value`` unless a header of that name is there already."""
    out = list(headers)
    if all(n != name for n, _ in out):
        out.append((name, value))
    return out

"""CORS, as vllm-router answers browsers (``--cors-allowed-origins``).

Only requests that carry an ``Origin`` header (browsers) are touched; every other client, and
with it the relay's hot path, goes by untouched.

* No origins given (the default): any origin may call, as in vllm-router — answers carry
  ``Access-Control-Allow-Origin: *`` and preflights allow any method and header.
* Origins given: only those. An allowed origin is echoed back with ``Vary: Origin``; preflights
  allow ``GET, POST, OPTIONS`` and the headers ``content-type, authorization``; answers expose
  ``x-request-id``. Other origins get no CORS headers, so their browsers refuse the answer.

A preflight (``OPTIONS`` with ``Access-Control-Request-Method``) is answered here, 200 with an
empty body, before routing and before the API key check: browsers send preflights without
credentials. Preflight answers may be cached for an hour (``Access-Control-Max-Age``).
"""

from __future__ import annotations

from .asgi import Headers, Message, Reply, Scope, Send

MAX_AGE = b"3600"


class Cors:
    """The CORS answers for ``allowed_origins`` (empty: any origin); see the module doc."""

    def __init__(self, allowed_origins: tuple[str, ...]) -> None:
        self._any = not allowed_origins
        self._allowed = frozenset(origin.encode("latin-1") for origin in allowed_origins)

    def is_preflight(self, scope: Scope) -> bool:
        return scope["method"] == "OPTIONS" and _header(scope, b"access-control-request-method")

    def preflight(self, origin: bytes) -> Reply:
        """The answer to a preflight from ``origin``."""
        if self._any:
            headers: Headers = [
                (b"access-control-allow-origin", b"*"),
                (b"access-control-allow-methods", b"*"),
                (b"access-control-allow-headers", b"*"),
                (b"access-control-max-age", MAX_AGE),
            ]
        elif origin in self._allowed:
            headers = [
                (b"access-control-allow-origin", origin),
                (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                (b"access-control-allow-headers", b"content-type, authorization"),
                (b"access-control-max-age", MAX_AGE),
                (b"vary", b"origin, access-control-request-method, access-control-request-headers"),
            ]
        else:
            headers = [(b"vary", b"origin")]
        return Reply(200, headers, b"")

    def on_response(self, origin: bytes, send: Send) -> Send:
        """``send`` with this origin's CORS headers added to the response head."""
        if self._any:
            extra: Headers = [
                (b"access-control-allow-origin", b"*"),
                (b"access-control-expose-headers", b"*"),
            ]
        elif origin in self._allowed:
            extra = [
                (b"access-control-allow-origin", origin),
                (b"access-control-expose-headers", b"x-request-id"),
                (b"vary", b"origin"),
            ]
        else:
            extra = [(b"vary", b"origin")]

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        return send_with_cors


def origin_of(scope: Scope) -> bytes | None:
    """The request's ``Origin`` header, if it has one."""
    for name, value in scope["headers"]:
        if name == b"origin":
            return bytes(value)
    return None


def _header(scope: Scope, name: bytes) -> bool:
    return any(key == name for key, _ in scope["headers"])

"""Changes to how hypercorn's trio worker serves connections, made once at start-up.

Both patch hypercorn 0.17-0.18 (the versions pyproject allows); each checks that what it
replaces is still there and, on a hypercorn it was not written for, logs a warning and leaves
hypercorn as it is rather than fail.

* :func:`close_connections_when_clients_leave`: a client's FIN closes its connection at once.
* :func:`serve_http1_only`: HTTP/2 is not served. hypercorn switches a cleartext connection to
  HTTP/2 on an ``Upgrade: h2c`` request or on the HTTP/2 preface, undocumented and without a way
  to turn it off; its HTTP/2 streams buffer without the bounds the router keeps per request
  (20 streams with no WINDOW_UPDATE on one connection took ~41 MB each). The router's clients
  and engines speak HTTP/1.1, TLS (the only way to negotiate h2 by ALPN) is not served, so the
  upgrade is ignored (the answer comes in HTTP/1.1, as RFC 9113 §3.1 allows) and a preface
  reaches the app as an ``HTTP/2.0`` request, which it answers 505.
* :func:`expose_connections`: the app can cut its request's connection
  (:func:`~.connection.current_connection`; that module says why).
"""

from __future__ import annotations

import logging

import h11
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.tcp_server import TCPServer

from .connection import Connection, enter

log = logging.getLogger("trio_pdrouter.server")


def close_connections_when_clients_leave() -> None:
    """Make hypercorn close a connection as soon as its client has closed it.

    hypercorn handles a client's FIN by closing the ASGI stream, but the connection's task
    group still waits for the keep-alive idle timer, so the socket stays open, half-closed, for
    up to ``--keep-alive-timeout-secs`` after every client that leaves. Under load that is
    request rate x timeout file descriptors (a 500-stream soak left 182 behind). Stopping the
    idle timer once reading has ended lets the connection close at once.
    """
    original = getattr(TCPServer, "_read_data", None)
    if original is None:
        log.warning("hypercorn changed: client-closed connections linger until keep-alive ends")
        return
    if getattr(original, "_closes_idle_timer", False):
        return

    async def _read_data(self: TCPServer) -> None:
        try:
            await original(self)
        finally:
            await self.idle_task.stop()

    _read_data._closes_idle_timer = True  # type: ignore[attr-defined]
    TCPServer._read_data = _read_data  # type: ignore[method-assign]


def serve_http1_only() -> None:
    """Never switch a connection to HTTP/2 (see the module doc)."""
    original = getattr(H11Protocol, "_check_protocol", None)
    if original is None:
        log.warning("hypercorn changed: it may switch connections to HTTP/2")
        return
    if getattr(original, "_http1_only", False):
        return

    async def _check_protocol(self: H11Protocol, event: h11.Request) -> None:
        """Every request stays HTTP/1.1: no 101 to ``h2c``, no switch on the preface."""

    _check_protocol._http1_only = True  # type: ignore[attr-defined]
    H11Protocol._check_protocol = _check_protocol  # type: ignore[method-assign]


def expose_connections() -> None:
    """Give every connection's tasks their :class:`~.connection.Connection` (module doc)."""
    original = getattr(TCPServer, "run", None)
    if original is None or not hasattr(TCPServer, "protocol_send"):
        log.warning("hypercorn changed: clients that accept nothing cannot be cut off")
        return
    if getattr(original, "_exposes_connection", False):
        return

    async def run(self: TCPServer) -> None:
        enter(Connection(self))
        await original(self)

    run._exposes_connection = True  # type: ignore[attr-defined]
    TCPServer.run = run  # type: ignore[method-assign]

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
* :func:`reuse_keep_alive_timers`: a connection's keep-alive timer is one task for the
  connection's life (:class:`KeepAliveTimer`), not a task started after every response.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import h11
import trio
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
            timer = self.idle_task
            if isinstance(timer, KeepAliveTimer):
                timer.close()
            else:
                await timer.stop()

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


class KeepAliveTimer:
    """A connection's keep-alive timer: one task for the connection's life, re-armed by moving
    a deadline. It stands in for hypercorn's idle task, which hypercorn starts anew (a task
    through ``nursery.start``, with its cancel scopes) after every response and cancels at every
    request: a task started and one torn down per request, about a tenth of the Python calls a
    short request makes.

    The rules are hypercorn's: an idle connection (between :meth:`restart`, after a response,
    and :meth:`stop`, at the next request) is closed ``keep_alive_timeout`` seconds after it
    went idle, or at once when the server shuts down; a busy one never is (hypercorn closes it
    after its answer when the server is shutting down). :meth:`close` ends the timer with its
    connection.
    """

    __slots__ = ("_closed", "_idle", "_scope", "_server")

    def __init__(self, server: TCPServer) -> None:
        self._server = server
        self._scope: trio.CancelScope | None = None
        self._idle = False
        self._closed = False

    async def restart(self, task_group: Any, action: Any) -> None:
        """The connection is idle from now (hypercorn's call; ``action`` is its own close)."""
        self._idle = True
        deadline = trio.current_time() + self._server.config.keep_alive_timeout
        if self._scope is None:
            self._scope = trio.CancelScope(deadline=deadline)
            task_group.spawn(self._watch, self._scope)
        else:
            self._scope.deadline = deadline

    async def stop(self) -> None:
        """The connection is busy from now."""
        self._idle = False
        if self._scope is not None:
            self._scope.deadline = math.inf

    def close(self) -> None:
        """The connection has ended: so does the timer."""
        self._closed = True
        if self._scope is not None:
            self._scope.cancel()

    async def _watch(self, scope: trio.CancelScope) -> None:
        with scope:
            await self._server.context.terminated.wait()
            if not self._idle:
                await trio.sleep_forever()  # busy: hypercorn closes it after its answer
        if self._closed:
            return
        with trio.CancelScope(shield=True):
            await self._server._initiate_server_close()


def reuse_keep_alive_timers() -> None:
    """Give every connection a :class:`KeepAliveTimer` for its idle task. Needs
    :func:`close_connections_when_clients_leave` first: its end of reading closes the timer."""
    original = TCPServer.__init__
    if getattr(original, "_keeps_one_timer", False):
        return
    read_data = getattr(TCPServer, "_read_data", None)
    if not getattr(read_data, "_closes_idle_timer", False) or not hasattr(
        TCPServer, "_initiate_server_close"
    ):
        log.warning("hypercorn changed: keep-alive timers stay a task per response")
        return

    def __init__(self: TCPServer, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.idle_task = KeepAliveTimer(self)  # type: ignore[assignment]

    __init__._keeps_one_timer = True  # type: ignore[attr-defined]
    TCPServer.__init__ = __init__  # type: ignore[method-assign]

"""The client connection a request came on, as the request path sees it: a handle to cut it.

hypercorn shields every send to a client, so a client that accepts nothing holds the request's
task in that send for as long as it stays connected; the only way out is to close the socket
under it (:meth:`Connection.cut`), which makes the send fail and end. The handle reaches the app
through a context variable that the patched hypercorn
(:func:`~.hypercorn_patches.expose_connections`) sets in the connection's task: trio starts each
task with a copy of its parent's context, so the app's tasks for that connection see it.
"""

from __future__ import annotations

from contextvars import ContextVar

import attrs
from h11._writers import ChunkedWriter
from hypercorn.events import RawData
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.tcp_server import TCPServer

__all__ = ["Connection", "current_connection", "enter"]


@attrs.frozen
class Connection:
    """The client connection a request came on."""

    _server: TCPServer

    def cut(self) -> None:
        """Close the socket now: a send blocked on it fails at once, and so does the read."""
        self._server.stream.socket.close()

    def fileno(self) -> int:
        """The socket's file descriptor, for writing body bytes past hypercorn
        (:mod:`trio_pdrouter.serve.pump`); -1 once closed."""
        fd: int = self._server.stream.socket.fileno()
        return fd

    def body_is_chunked(self) -> bool:
        """Whether the response being sent on this connection is framed in HTTP/1.1 chunks
        (h11 chose them: an HTTP/1.1 client, no Content-Length). Only then may body bytes be
        written past hypercorn, framed by the writer; anything unexpected says no."""
        protocol = getattr(getattr(self._server, "protocol", None), "protocol", None)
        if not isinstance(protocol, H11Protocol):
            return False
        return isinstance(getattr(protocol.connection, "_writer", None), ChunkedWriter)

    async def send_raw(self, data: bytes) -> None:
        """Write ``data`` as it is, through hypercorn's own send lock (bytes a writer past
        hypercorn had left half-sent, completed before hypercorn sends anything more)."""
        await self._server.protocol_send(RawData(data=data))


_CONNECTION: ContextVar[Connection | None] = ContextVar("trio_pdrouter_connection", default=None)


def current_connection() -> Connection | None:
    """The connection of the request being served in this task (None outside hypercorn, or
    on a hypercorn :func:`~.hypercorn_patches.expose_connections` could not patch)."""
    return _CONNECTION.get()


def enter(connection: Connection) -> None:
    """Make ``connection`` this task's (and its children's) :func:`current_connection`."""
    _CONNECTION.set(connection)

"""`SendSide`: what a caller can see and do of its request's sending side, on the wire.

Put one in a request's extensions under `SEND_SIDE` before handing the request to the transport:

    side = SendSide()
    request = httpx.Request("POST", url, content=body, extensions={SEND_SIDE: side})
    response = await transport.handle_async_request(request)

* ``side.written`` turns True once the whole request has been written to the socket (by
  `H11Transport`; any transport's caller may also set it when a response head arrived, which a
  server sends only after reading the request). False after a failure means the server never
  had all of it.
* ``side.close()`` half-closes the connection (TCP FIN, ``shutdown(SHUT_WR)``): the server sees
  its client go, as a close would show it, while whatever it already sent can still be read.
  Asked for before the transport has a connection for the request, it happens as soon as it has
  one. A half-closed connection is never reused.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["SEND_SIDE", "SendSide"]

#: The request extension under which a `SendSide` travels.
SEND_SIDE = "trio_pdrouter.send_side"


class _Closable(Protocol):
    def half_close(self) -> None: ...


class SendSide:
    """A request's sending side (see the module doc)."""

    __slots__ = ("_connection", "closed", "written")

    def __init__(self) -> None:
        self._connection: _Closable | None = None
        self.written = False
        self.closed = False

    def attach(self, connection: _Closable) -> None:
        """The transport: ``connection`` carries the request now."""
        self._connection = connection
        if self.closed:
            connection.half_close()

    def close(self) -> None:
        """Stop sending: the server sees the client leave; its answer can still be read."""
        self.closed = True
        if self._connection is not None:
            self._connection.half_close()

"""The few ASGI shapes the router uses, and the client side of one exchange."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs
import trio

from .connection import Connection
from .errors import RouterError

Message = dict[str, Any]
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = Sequence[tuple[bytes, bytes]]

JSON = b"application/json"


@attrs.frozen
class Reply:
    """The last message of a response: a whole response if nothing was sent yet, else the tail
    of the body (``status`` and ``headers`` are then unused)."""

    status: int
    headers: Headers
    body: bytes

    @classmethod
    def error(cls, error: RouterError, headers: Headers = ()) -> Reply:
        out = [(b"content-type", JSON), *headers]
        if error.retry_after is not None:
            out.append((b"retry-after", str(error.retry_after).encode()))
        return cls(error.status, out, error.body())

    @classmethod
    def json(cls, body: bytes, status: int = 200) -> Reply:
        return cls(status, [(b"content-type", JSON)], body)

    @classmethod
    def tail(cls, body: bytes = b"") -> Reply:
        return cls(200, (), body)


class Downstream:
    """Sends a response to the client and remembers how far it got.

    ``sending`` and ``sends_done`` let a watcher tell a client that accepts nothing (one send
    under way, the count not moving) from one that is slow; see :mod:`trio_pdrouter.serve.stalled`.
    """

    __slots__ = (
        "_before_last",
        "_connection",
        "_last",
        "_send",
        "bytes_sent",
        "first_chunk_at",
        "sending",
        "sends_done",
        "started",
        "status",
        "unsent",
    )

    def __init__(self, send: Send, connection: Connection | None = None) -> None:
        self._send = send
        self._connection = connection
        #: Framed body bytes a writer past hypercorn (:mod:`trio_pdrouter.serve.pump`) left
        #: half-written: sent as they are, through ``raw``, before the next message.
        self.unsent = b""
        self.started = False
        self.status = 0
        self.bytes_sent = 0
        #: When the first body chunk of a streamed response was sent (trio time).
        self.first_chunk_at: float | None = None
        self.sending = False
        self.sends_done = 0
        self._last = self._before_last = b""

    async def _out(self, message: Message) -> None:
        self.sending = True
        try:
            if self.unsent:
                assert self._connection is not None
                data, self.unsent = self.unsent, b""
                await self._connection.send_raw(data)
            await self._send(message)
        finally:
            self.sending = False
            self.sends_done += 1

    async def start(self, status: int, headers: Headers) -> None:
        self.started = True
        self.status = status
        await self._out({"type": "http.response.start", "status": status, "headers": headers})

    async def chunk(self, data: bytes) -> None:
        """Send ``data`` (non-empty) as body bytes, more to come."""
        self.passed(data)
        await self._out({"type": "http.response.body", "body": data, "more_body": True})

    def passed(self, data: bytes) -> None:
        """``data`` (non-empty) is sent to the client: by :meth:`chunk`, or past hypercorn (the
        pump's writes)."""
        if self.first_chunk_at is None:
            self.first_chunk_at = trio.current_time()
        self.bytes_sent += len(data)
        self._before_last, self._last = self._last, data

    async def finish(self, reply: Reply) -> None:
        """Send ``reply`` as the response's last message."""
        if not self.started:
            await self.start(reply.status, reply.headers)
        self.bytes_sent += len(reply.body)
        if reply.body:
            self._before_last, self._last = self._last, reply.body
        await self._out({"type": "http.response.body", "body": reply.body, "more_body": False})

    def tail(self) -> bytes:
        """The last two non-empty body messages sent: where an answer's ``usage`` is (see
        :func:`trio_pdrouter.observe.usage_of`)."""
        return self._before_last + self._last


async def answer_lifespan(receive: Receive, send: Send) -> None:
    """Acknowledge ASGI lifespan startup and shutdown (the router has nothing to set up there:
    its background work lives in :func:`trio_pdrouter.server.run_router`'s nursery)."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return

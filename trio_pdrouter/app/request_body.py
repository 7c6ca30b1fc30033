"""Reading a request's body within its limits, and answering in one piece.

Shared by the inference and the admin routes: a body larger than its limit, or one that takes
longer than ``--request-body-timeout-secs``, is refused with :class:`BadRequest` before
anything is parsed.
"""

from __future__ import annotations

import trio

from ..http import Downstream, Headers, Receive, Reply, RouterError, Send, errors

__all__ = ["CLOSE", "BadRequest", "read_body", "send_reply"]

#: Sent with an answer after which the connection cannot be reused (part of the request unread).
CLOSE = ((b"connection", b"close"),)


class BadRequest(Exception):
    """A request refused before it reaches the proxy, with the headers of its answer (and the
    model it named, when it was read, for the access line and the per-model metrics)."""

    def __init__(
        self, error: RouterError, headers: Headers = (), *, model: str | None = None
    ) -> None:
        super().__init__(error.message)
        self.error = error
        self.headers = headers
        self.model = model


async def read_body(receive: Receive, limit: int, seconds: float) -> bytes | None:
    """The whole body, at most ``limit`` bytes, within ``seconds``; ``None`` if the client left
    while sending it."""
    chunks: list[bytes] = []
    size = 0
    with trio.move_on_after(seconds):
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk: bytes = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise BadRequest(errors.payload_too_large(limit))
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
    raise BadRequest(errors.body_timeout(seconds), CLOSE)


async def send_reply(send: Send, reply: Reply) -> None:
    """Send ``reply`` as the whole answer."""
    await Downstream(send).finish(reply)

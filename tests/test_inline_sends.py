"""Sends without waiting (``hypercorn_fixes.write_at_once``), on a real hypercorn and real sockets.

An app sends numbered pieces to a client the way the relay's reader does: each through
``Connection.send_without_waiting`` while nothing is left unsent, and otherwise through an awaited
send (which writes what was left first). The client, with a small receive window, reads nothing
for a while and then everything: it must get every piece, whole and in order, and the sends
without waiting must have left bytes unsent at least once (else the test proves nothing).
"""

from __future__ import annotations

import socket

import hypercorn.trio
import trio
import trio.testing
from hypercorn.config import Config

from trio_pdrouter.asgi import answer_lifespan
from trio_pdrouter.hypercorn_fixes import current_connection, expose_connections, write_at_once

PIECES = 400
PIECE = b"x" * 1000


def piece(i: int) -> bytes:
    return b"%06d:" % i + PIECE + b"\n"


class App:
    """Streams :data:`PIECES` pieces once ``go`` is set; counts what went out at once."""

    def __init__(self) -> None:
        self.at_once = 0
        self.left_unsent = 0
        self.connection_seen = False

    async def __call__(self, scope: dict[str, object], receive: object, send: object) -> None:
        assert callable(receive) and callable(send)
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        conn = current_connection()
        assert conn is not None and conn.writes_at_once
        self.connection_seen = True
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(PIECES):
            message = {"type": "http.response.body", "body": piece(i), "more_body": True}
            if not conn.unsent:
                if await conn.send_without_waiting(send(message)):
                    self.at_once += 1
                    continue
                self.left_unsent += 1
                if i % 2:  # either way out: the rest alone, or the rest before the next piece
                    await conn.write_unsent()
                continue
            await send(message)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def test_pieces_sent_without_waiting_arrive_whole_and_in_order() -> None:
    expose_connections()
    write_at_once()
    app = App()
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.graceful_timeout = 0.1
    async with trio.open_nursery() as nursery:

        async def run(task_status: trio.TaskStatus[list[str]]) -> None:
            await hypercorn.trio.serve(app, config, task_status=task_status)  # type: ignore[arg-type]

        binds: list[str] = await nursery.start(run)
        host, port = binds[0].removeprefix("http://").rsplit(":", 1)
        sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: small window
        await sock.connect((host, int(port)))
        await sock.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        await trio.testing.wait_all_tasks_blocked()  # the app is stuck: nothing is read yet
        received = bytearray()
        with trio.fail_after(30):
            while not received.endswith(b"\r\n0\r\n\r\n"):
                chunk = await sock.recv(65536)
                assert chunk, "connection ended early"
                received += chunk
        sock.close()
        nursery.cancel_scope.cancel()
    assert app.connection_seen
    body = _dechunk(bytes(received))
    assert body == b"".join(piece(i) for i in range(PIECES))
    assert app.at_once > 0 and app.left_unsent > 0, (app.at_once, app.left_unsent)


def _dechunk(raw: bytes) -> bytes:
    body = raw.split(b"\r\n\r\n", 1)[1]
    out = bytearray()
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        out += rest[:size]
        body = rest[size + 2 :]
    return bytes(out)

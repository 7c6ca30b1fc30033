"""The send-path experiment of ``benchmarks/hypercorn_send.py``, on a real hypercorn and sockets.

The experiment's numbers (``floor, write at once`` in the paced benchmark) mean something only if
it relays correctly: an app streams numbered pieces to a client whose small receive window fills
while it reads nothing; the client then reads everything. Every piece must arrive whole and in
order, and both ways out must have been taken (some pieces written at once, some passed on to
hypercorn's own path with what the socket did not take), or the test proves nothing.
"""

from __future__ import annotations

import socket

import hypercorn.trio
import pytest
import trio
import trio.testing
from hypercorn.config import Config
from hypercorn.trio.tcp_server import TCPServer

from benchmarks import hypercorn_send
from tests.http1 import dechunk
from trio_pdrouter.http import answer_lifespan

PIECES = 400
PIECE = b"x" * 1000


def piece(i: int) -> bytes:
    return b"%06d:" % i + PIECE + b"\n"


async def app(scope: dict[str, object], receive: object, send: object) -> None:
    assert callable(receive) and callable(send)
    if scope["type"] == "lifespan":
        await answer_lifespan(receive, send)
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for i in range(PIECES):
        await send({"type": "http.response.body", "body": piece(i), "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def test_pieces_arrive_whole_and_in_order_through_both_ways_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The patch is for this test only: the rest of the suite runs on hypercorn as shipped.
    monkeypatch.setattr(TCPServer, "protocol_send", TCPServer.protocol_send)
    hypercorn_send.write_at_once()
    before = dict(hypercorn_send.counts)
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
    assert dechunk(bytes(received)) == b"".join(piece(i) for i in range(PIECES))
    at_once = hypercorn_send.counts["at_once"] - before["at_once"]
    passed_on = hypercorn_send.counts["passed_on"] - before["passed_on"]
    assert at_once > 0 and passed_on > 0, (at_once, passed_on)

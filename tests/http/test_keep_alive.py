"""Keep-alive with :class:`~trio_pdrouter.http.hypercorn_patches.KeepAliveTimer`, on a real
hypercorn and sockets, in virtual time: hypercorn's rules hold (an idle connection closes
``keep_alive_timeout`` after its last response, re-armed by every response; a busy one never
does; at shutdown an idle one closes at once and a busy one once its answer is out), with one
timer task for a connection's life, gone with its connection."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import hypercorn.trio
import pytest
import trio
import trio.testing
from hypercorn.config import Config
from hypercorn.trio.tcp_server import TCPServer

from trio_pdrouter.http import (
    answer_lifespan,
    close_connections_when_clients_leave,
    reuse_keep_alive_timers,
)

TIMEOUT = 5.0
SLOW = 2 * TIMEOUT
REQUEST = b"GET /%s HTTP/1.1\r\nHost: t\r\n\r\n"


async def app(scope: dict[str, object], receive: object, send: object) -> None:
    assert callable(receive) and callable(send)
    if scope["type"] == "lifespan":
        await answer_lifespan(receive, send)
        return
    if scope["path"] == "/slow":
        await trio.sleep(SLOW)
    headers = [(b"content-length", b"2")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"ok", "more_body": False})


@pytest.fixture
def patched(monkeypatch: pytest.MonkeyPatch) -> None:
    """The patches for this module only: restored afterwards."""
    monkeypatch.setattr(TCPServer, "__init__", TCPServer.__init__)
    monkeypatch.setattr(TCPServer, "_read_data", TCPServer._read_data)
    close_connections_when_clients_leave()
    reuse_keep_alive_timers()


@asynccontextmanager
async def server(shutdown: trio.Event | None = None) -> AsyncIterator[tuple[str, int]]:
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.keep_alive_timeout = TIMEOUT
    config.graceful_timeout = 3 * SLOW
    trigger: Callable[[], object] | None = None if shutdown is None else shutdown.wait
    # Virtual seconds: a connection that never closes fails the test rather than hanging it.
    with trio.fail_after(100 * SLOW):
        async with trio.open_nursery() as nursery:

            async def run(task_status: trio.TaskStatus[list[str]]) -> None:
                await hypercorn.trio.serve(
                    app,  # type: ignore[arg-type]
                    config,
                    shutdown_trigger=trigger,  # type: ignore[arg-type]
                    task_status=task_status,
                )

            binds: list[str] = await nursery.start(run)
            host, port = binds[0].removeprefix("http://").rsplit(":", 1)
            yield host, int(port)
            nursery.cancel_scope.cancel()


async def connect(address: tuple[str, int]) -> trio.SocketStream:
    return await trio.open_tcp_stream(*address)


async def ask(conn: trio.SocketStream, path: bytes) -> None:
    """One request, and its whole answer (a 200 with ``ok``)."""
    await conn.send_all(REQUEST % path)
    got = b""
    while not got.endswith(b"\r\n\r\nok"):
        data = await conn.receive_some(65536)
        assert data, f"closed before the answer: {got!r}"
        got += data
    assert got.startswith(b"HTTP/1.1 200")


async def closed_at(conn: trio.SocketStream) -> float:
    """When the server closes the connection (nothing else may arrive before)."""
    assert await conn.receive_some(65536) == b""
    return trio.current_time()


def timer_tasks() -> set[trio.lowlevel.Task]:
    """Every keep-alive timer task running now."""
    found: set[trio.lowlevel.Task] = set()
    todo = [trio.lowlevel.current_root_task()]
    while todo:
        task = todo.pop()
        if task is None:
            continue
        if "KeepAliveTimer._watch" in task.name:
            found.add(task)
        for nursery in task.child_nurseries:
            todo.extend(nursery.child_tasks)
    return found


@pytest.mark.usefixtures("patched")
async def test_an_idle_connection_closes_its_timeout_after_its_last_answer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with server() as address:
        conn = await connect(address)
        await ask(conn, b"a")
        await trio.sleep(0.6 * TIMEOUT)
        await ask(conn, b"b")  # re-armed: its timeout counts from here
        await trio.sleep(0.6 * TIMEOUT)
        await ask(conn, b"c")
        last = trio.current_time()
        assert await closed_at(conn) == pytest.approx(last + TIMEOUT)


@pytest.mark.usefixtures("patched")
async def test_a_busy_connection_stays_past_its_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with server() as address:
        conn = await connect(address)
        await ask(conn, b"a")
        await ask(conn, b"slow")  # twice the timeout without an answer
        last = trio.current_time()
        assert await closed_at(conn) == pytest.approx(last + TIMEOUT)


@pytest.mark.usefixtures("patched")
async def test_shutdown_closes_an_idle_connection_at_once_and_a_busy_one_after_its_answer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    shutdown = trio.Event()
    async with server(shutdown) as address:
        idle, busy = await connect(address), await connect(address)
        await ask(idle, b"a")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, busy, b"slow")
            asked = trio.current_time()
            await trio.sleep(1.0)
            shutdown.set()
            assert await closed_at(idle) == pytest.approx(asked + 1.0)
        assert trio.current_time() == pytest.approx(asked + SLOW)  # answered in full
        assert await closed_at(busy) == pytest.approx(asked + SLOW)


@pytest.mark.usefixtures("patched")
async def test_one_timer_task_serves_a_connection_and_leaves_with_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with server() as address:
        conn = await connect(address)
        await ask(conn, b"a")
        await trio.testing.wait_all_tasks_blocked()
        timers = timer_tasks()
        assert len(timers) == 1
        for path in (b"b", b"c", b"d"):
            await ask(conn, path)
            await trio.testing.wait_all_tasks_blocked()
            assert timer_tasks() == timers, "a new timer task for a response"
        await conn.aclose()
        await trio.testing.wait_all_tasks_blocked()
        assert timer_tasks() == set(), "the timer outlived its connection"

"""Clients that accept nothing are cut off after the write timeout; slow readers never are."""

from __future__ import annotations

import logging

import httpx
import pytest
import trio
import trio.testing

from tests.harness import (
    PREFILL_ANSWER,
    REQUEST,
    Exchange,
    call,
    json_response,
    make_app,
    pd_config,
)
from tests.harness import streaming as streaming_response
from tests.observe.test_access_log import access_lines, parse
from trio_pdrouter.http import connection as client_connection
from trio_pdrouter.serve import StallWatch

TIMEOUT = 30.0
EVENT = b'data: {"choices":[{"index":0,"text":"x"}]}\n\n'


class FakeConnection:
    """What trio_pdrouter.http.Connection does to a stalled client, on the in-memory harness."""

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange
        self.cut_at: float | None = None

    def cut(self) -> None:
        self.cut_at = trio.current_time()
        self.exchange.leave()  # the send blocked on the socket ends, and the read sees EOF


async def _engine(request: httpx.Request) -> httpx.Response:
    if request.url.host == "prefill":
        return json_response(PREFILL_ANSWER)
    response, body = streaming_response()
    for _ in range(5):
        body.push(EVENT)
    body.push(b"data: [DONE]\n\n")
    body.end()
    return response


async def _serve(app: object, ex: Exchange, conn: FakeConnection, body: dict[str, object]) -> None:
    token = client_connection._CONNECTION.set(conn)  # type: ignore[arg-type]
    try:
        with trio.fail_after(20 * TIMEOUT):  # a guard: a client never cut fails the test
            await call(app, "POST", "/v1/completions", body, exchange=ex)  # type: ignore[arg-type]
    finally:
        client_connection._CONNECTION.reset(token)


async def test_a_client_that_accepts_nothing_is_cut_off_and_logged_as_stalled(
    background: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="trio_pdrouter.access")
    app, _ = make_app(pd_config(), _engine, background)
    ex = Exchange()
    ex.stop_reading()
    conn = FakeConnection(ex)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(StallWatch(TIMEOUT, app.proxy.in_flight).run)
        await _serve(app, ex, conn, {**REQUEST, "stream": True})
        nursery.cancel_scope.cancel()
    assert conn.cut_at is not None and TIMEOUT <= conn.cut_at <= 1.25 * TIMEOUT + 1
    assert app.ledger.total() == 0 and not app.proxy.in_flight
    [line] = access_lines(caplog)
    assert parse(line)["outcome"] == "client_stalled"


async def test_a_client_that_reads_slowly_is_never_cut_off(
    background: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    async def paced_engine(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        response, body = streaming_response()

        async def produce() -> None:  # faster than the client reads: always a send under way
            for _ in range(100):
                body.push(EVENT)
                await trio.sleep(1)
            body.push(b"data: [DONE]\n\n")
            body.end()

        background.start_soon(produce)
        return response

    app, _ = make_app(pd_config(), paced_engine, background)
    ex = Exchange()
    conn = FakeConnection(ex)

    async def slow_reader() -> None:
        # Each send takes most of the timeout to be accepted, but each is accepted.
        for _ in range(20):  # bounded
            ex.stop_reading()
            await trio.sleep(0.9 * TIMEOUT)
            ex.resume_reading()
            await trio.testing.wait_all_tasks_blocked()
            if ex.finished.is_set():
                return

    async with trio.open_nursery() as nursery:
        nursery.start_soon(StallWatch(TIMEOUT, app.proxy.in_flight).run)
        nursery.start_soon(slow_reader)
        await _serve(app, ex, conn, {**REQUEST, "stream": True})
        nursery.cancel_scope.cancel()
    assert conn.cut_at is None
    assert ex.body.endswith(b"data: [DONE]\n\n") and ex.complete
    assert trio.current_time() > 3 * TIMEOUT  # it was slow for far longer than the timeout

"""HTTP edges a hostile client or a broken upstream finds: each is answered, none slips past."""

from __future__ import annotations

import httpx
import pytest
import trio
import trio.testing

from tests.cluster import start_cluster
from tests.harness import (
    PREFILL_ANSWER,
    REQUEST,
    call,
    json_response,
    make_app,
    pd_config,
    streaming,
)


async def engine(request: httpx.Request) -> httpx.Response:
    if request.url.host == "prefill":
        return json_response(PREFILL_ANSWER)
    response, body = streaming()
    body.push(b'data: {"choices":[]}\n\ndata: [DONE]\n\n')
    body.end()
    return response


async def test_upstreams_are_asked_for_uncompressed_answers(background: trio.Nursery) -> None:
    app, upstream = make_app(pd_config(), engine, background)
    assert (await call(app, "POST", "/v1/completions", REQUEST)).status == 200
    assert [r.headers["accept-encoding"] for r in upstream.requests] == ["identity", "identity"]


async def test_a_stream_answered_as_plain_text_is_a_502(
    background: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    async def plain(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        response, body = streaming(content_type="text/plain")
        body.push(b"not an event stream")
        body.end()
        return response

    app, upstream = make_app(pd_config(), plain, background)
    ex = await call(app, "POST", "/v1/completions", REQUEST)
    message = ex.json()["error"]["message"]
    assert ex.status == 502 and "the decode upstream gave an answer the router cannot" in message
    assert "a stream answered as text/plain" in caplog.text  # the cause, for the operator
    assert upstream.bodies[0].closed


async def test_an_upstream_event_that_never_ends_ends_the_stream_with_an_error(
    background: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    limit = 64 * 1024

    async def endless(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        response, body = streaming()
        body.push(b'data: {"choices":[]}\n\n')
        for _ in range(2 * limit // 4096):  # bounded: twice the limit, no separator
            body.push(b"x" * 4096)
        return response

    app, upstream = make_app(pd_config(max_buffered_bytes=limit), endless, background)
    ex = await call(app, "POST", "/v1/completions", {**REQUEST, "stream": True})
    assert ex.status == 200
    first, error, done = ex.body.split(b"\n\n", 2)
    assert first == b'data: {"choices":[]}'
    assert b"cannot use" in error and done == b"data: [DONE]\n\n"
    assert "grew past" in caplog.text
    assert b"xxxx" not in ex.body
    assert upstream.bodies[0].closed
    assert app.ledger.total() == 0


async def test_a_body_that_trickles_past_the_body_timeout_gets_408(
    background: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    app, upstream = make_app(pd_config(), engine, background)
    sent: list[dict[str, object]] = []
    pieces = iter([b'{"model": "m", ', b'"prompt": "hi"'])

    async def receive() -> dict[str, object]:
        piece = next(pieces, None)
        if piece is None:  # the rest never comes
            await trio.sleep_forever()
        await trio.sleep(1)  # a byte now and then
        return {"type": "http.request", "body": piece, "more_body": True}

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    with trio.fail_after(pd_config().server.body_timeout + 5):
        await app(scope, receive, send)
    assert sent[0]["status"] == 408
    assert (b"connection", b"close") in sent[0]["headers"]  # type: ignore[operator]
    assert upstream.requests == [] and app.ledger.total() == 0


async def test_a_head_larger_than_the_limit_gets_431(background: trio.Nursery) -> None:
    config = pd_config()
    app, _ = make_app(config, engine, background)
    limit = config.server.max_header_bytes
    ex = await call(app, "GET", "/health", headers={"x-big": "a" * (limit // 2)})
    assert ex.status == 200
    ex = await call(app, "GET", "/health", headers={"x-big": "a" * limit})
    assert ex.status == 431 and ex.headers["connection"] == "close"


async def test_content_length_with_transfer_encoding_is_refused_and_closed(
    background: trio.Nursery,
) -> None:
    app, upstream = make_app(pd_config(), engine, background)
    ex = await call(
        app,
        "POST",
        "/v1/completions",
        REQUEST,
        headers={"content-length": "10", "transfer-encoding": "chunked"},
    )
    assert ex.status == 400 and ex.headers["connection"] == "close"
    assert upstream.requests == []


async def test_the_bearer_scheme_is_case_insensitive(background: trio.Nursery) -> None:
    app, _ = make_app(pd_config(api_key="k3y"), engine, background)
    for scheme in ("Bearer", "bearer", "BEARER"):
        ex = await call(app, "GET", "/get_loads", headers={"authorization": f"{scheme} k3y"})
        assert ex.status == 200, scheme
    assert (
        await call(app, "GET", "/get_loads", headers={"authorization": "Basic k3y"})
    ).status == 401


async def test_without_the_key_no_route_can_be_told_apart(background: trio.Nursery) -> None:
    app, _ = make_app(pd_config(api_key="k3y"), engine, background)
    for method, path in [("GET", "/nowhere"), ("DELETE", "/get_loads"), ("GET", "/get_loads")]:
        ex = await call(app, method, path)
        assert ex.status == 401, (method, path)
        assert ex.headers["www-authenticate"] == "Bearer"
    assert (await call(app, "GET", "/health")).status == 200


async def test_an_answer_past_the_cap_is_a_502_not_a_memory_spike(
    background: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    async def huge(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        response, body = streaming(status=500, content_type="application/json")
        for _ in range(20):
            body.push(b"x" * 1000)
        body.end()
        return response

    config = pd_config(max_upstream_answer_bytes=4096, max_buffered_bytes=4096)
    app, upstream = make_app(config, huge, background)
    for request in ({"prompt": "x"}, REQUEST):  # buffered, then a stream's error body
        ex = await call(app, "POST", "/v1/completions", request)
        assert ex.status == 502 and "cannot use" in ex.json()["error"]["message"]
        assert "larger than 4096 bytes" in caplog.text
    await trio.testing.wait_all_tasks_blocked()  # the KV reclaims (background) end too
    assert all(body.closed and not body.read_to_end for body in upstream.bodies)


async def _exchange(url: str, request: bytes) -> bytes:
    """Send raw bytes to the router; everything it answers until it closes (bounded)."""
    host, port = url.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(request)
        answer = b""
        with trio.fail_after(10):
            while len(answer) < 1 << 20 and (data := await stream.receive_some()):
                answer += data
                if b"\r\n\r\n" in answer and b"connection: close" not in answer.lower():
                    break  # a keep-alive answer: its head is all this test reads
        return answer


async def test_http2_is_not_served_neither_by_upgrade_nor_by_preface() -> None:
    async with trio.open_nursery() as nursery:
        cluster = await start_cluster(nursery)
        url = cluster.router.url
        upgrade = await _exchange(
            url,
            b"GET /health HTTP/1.1\r\nHost: r\r\nConnection: Upgrade, HTTP2-Settings\r\n"
            b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n",
        )
        assert upgrade.startswith(b"HTTP/1.1 200"), upgrade[:80]
        # The preface's first half only: the rest (SM, then frames) would stay unread when the
        # router closes, and the kernel's RST could then drop the 505 before the test reads it.
        preface = await _exchange(url, b"PRI * HTTP/2.0\r\n\r\n")
        assert preface.startswith(b"HTTP/1.1 505"), preface[:80]
        assert b"HTTP/2 is not served" in preface
        nursery.cancel_scope.cancel()

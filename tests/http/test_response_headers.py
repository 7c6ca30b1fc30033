"""What an engine answered reaches the client: its errors (status, body, headers), its custom
response headers, and a ``Retry-After`` on every 429."""

from __future__ import annotations

import httpx
import orjson
import pytest
import trio
import trio.testing

from tests.harness import (
    EVENT,
    PREFILL_ANSWER,
    REQUEST,
    Exchange,
    call,
    json_response,
    make_app,
    pd_config,
    streaming,
    total_load,
)
from trio_pdrouter.config import AdmissionSettings, BreakerSettings, RetrySettings
from trio_pdrouter.http import DONE, passed_on

ENGINE_ERROR = b'{"error": "the engine broke", "detail": [1, 2]}'
NO_RETRY = RetrySettings(max_retries=1)


def test_hop_by_hop_length_and_router_headers_are_dropped() -> None:
    headers = httpx.Headers(
        [
            ("Content-Type", "text/event-stream"),
            ("X-Engine-Note", "kept"),
            ("Connection", "keep-alive, X-Private"),
            ("X-Private", "connection-scoped"),
            ("Keep-Alive", "timeout=5"),
            ("Transfer-Encoding", "chunked"),
            ("Content-Length", "12"),
            ("Date", "yesterday"),
            ("Server", "uvicorn"),
            ("X-Request-Id", "engine-id"),
            ("X-Trio-Pdrouter-Decode", "forged"),
            ("Set-Cookie", "a=1"),
            ("Set-Cookie", "b=2"),
        ]
    )
    assert passed_on(headers) == [
        (b"content-type", b"text/event-stream"),
        (b"x-engine-note", b"kept"),
        (b"set-cookie", b"a=1"),
        (b"set-cookie", b"b=2"),
    ]


@pytest.mark.parametrize(("retry", "attempts"), [(NO_RETRY, 1), (RetrySettings(), 5)])
@pytest.mark.parametrize("stage", ["prefill", "decode"])
async def test_an_engine_500_reaches_the_client_unchanged(
    stage: str,
    retry: RetrySettings,
    attempts: int,
    autojump_clock: trio.testing.MockClock,
    background: trio.Nursery,
) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill" and stage == "decode":
            return json_response(PREFILL_ANSWER)
        headers = {"content-type": "application/json", "x-engine-note": "sorry"}
        return httpx.Response(500, headers=headers, content=ENGINE_ERROR)

    app, upstream = make_app(
        pd_config(retry=retry, expose_routing_headers=True), handler, background
    )
    ex = await call(app, "POST", "/v1/completions", REQUEST)
    assert ex.status == 500
    assert bytes(ex.body) == ENGINE_ERROR
    assert ex.headers["x-engine-note"] == "sorry"
    assert ex.headers["content-type"] == "application/json"
    assert "x-trio-pdrouter-decode" in ex.headers  # the routing headers come along
    legs = [orjson.loads(r.content) for r in upstream.requests if r.url.host == stage]
    # Decode's own legs: not the one-token decode that frees the prefill's KV blocks after.
    failing = [leg for leg in legs if stage == "prefill" or leg["max_tokens"] == 8]
    assert len(failing) == attempts
    assert total_load(app) == 0


async def test_engine_500s_open_the_circuit_breaker(background: trio.Nursery) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, content=ENGINE_ERROR)

    breaker = BreakerSettings(failure_threshold=2)
    app, upstream = make_app(pd_config(retry=NO_RETRY, breaker=breaker), handler, background)
    for _ in range(2):
        assert (await call(app, "POST", "/v1/completions", REQUEST)).status == 500
    ex = await call(app, "POST", "/v1/completions", REQUEST)
    assert ex.status == 503  # no prefill endpoint left: its circuit is open
    assert ex.json()["error"]["type"] == "service_unavailable"
    assert len(upstream.requests) == 2


async def test_custom_engine_headers_reach_the_client_of_a_stream(
    background: trio.Nursery,
) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        response, body = streaming()
        response.headers["x-engine-note"] = "from decode"
        response.headers["connection"] = "keep-alive"
        body.push(EVENT + DONE)
        body.end()
        return response

    app, _ = make_app(pd_config(expose_routing_headers=True), handler, background)
    ex = await call(app, "POST", "/v1/completions", REQUEST)
    assert bytes(ex.body) == EVENT + DONE
    assert ex.headers["x-engine-note"] == "from decode"
    assert ex.headers["content-type"] == "text/event-stream"
    assert ex.headers["cache-control"] == "no-cache"
    assert "connection" not in ex.headers
    assert ex.headers["x-trio-pdrouter-decode"] == "http://decode:8200"


async def test_custom_engine_headers_reach_the_client_of_a_whole_answer(
    background: trio.Nursery,
) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        return httpx.Response(200, json={"choices": []}, headers={"x-engine-note": "from decode"})

    app, _ = make_app(pd_config(), handler, background)
    body = {key: value for key, value in REQUEST.items() if key != "stream_options"}
    ex = await call(app, "POST", "/v1/completions", {**body, "stream": False})
    assert ex.status == 200 and ex.json() == {"choices": []}
    assert ex.headers["x-engine-note"] == "from decode"
    assert "content-length" not in ex.headers


@pytest.mark.parametrize(
    ("engine_headers", "retry_after"), [({}, "1"), ({"retry-after": "7"}, "7")]
)
async def test_an_engine_429_keeps_its_headers_and_has_retry_after(
    engine_headers: dict[str, str],
    retry_after: str,
    background: trio.Nursery,
) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        headers = {"content-type": "application/json", "x-engine-note": "busy", **engine_headers}
        return httpx.Response(429, headers=headers, content=b'{"error": "busy"}')

    app, _ = make_app(pd_config(retry=NO_RETRY), handler, background)
    ex = await call(app, "POST", "/v1/completions", REQUEST)
    assert ex.status == 429 and bytes(ex.body) == b'{"error": "busy"}'
    assert ex.headers["x-engine-note"] == "busy"
    assert ex.headers["retry-after"] == retry_after


async def test_the_admission_429_has_retry_after(background: trio.Nursery) -> None:
    held = trio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        response, _ = streaming()
        held.set()
        return response  # never ends: holds the only admission slot

    admission = AdmissionSettings(max_concurrent_requests=1, queue_size=0)
    app, _ = make_app(pd_config(admission=admission), handler, background)
    first = Exchange()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: call(app, "POST", "/v1/completions", REQUEST, exchange=first))
        await held.wait()
        ex = await call(app, "POST", "/v1/completions", REQUEST)
        assert ex.status == 429
        assert ex.headers["retry-after"] == "1"
        assert ex.json()["error"]["type"] == "rate_limit_error"
        first.leave()

"""Nothing internal reaches a client: across every error the router answers with, no header and
no body names an upstream's address, an exception or a traceback; the log keeps the detail."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
import trio

from tests.harness import (
    EVENT,
    PREFILL_ANSWER,
    REQUEST,
    call,
    json_response,
    make_app,
    pd_config,
    streaming,
)
from trio_pdrouter.config import RetrySettings

NO_RETRY = RetrySettings(max_retries=1)
ASK = {"model": "m", "prompt": "hello there", "max_tokens": 8}
#: What a client must never see: the upstreams' addresses (pd_config's), a URL, the router's
#: own routing headers, an exception's name, a traceback.
SECRETS = ("prefill:8100", "decode:8200", "http://", "x-trio-pdrouter", "Error:", "Traceback")

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


async def prefill_then(decode: Handler) -> Handler:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        return await decode(request)

    return handler


async def refused(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError(f"connect to {request.url.host}:{request.url.port} failed")


async def reset(request: httpx.Request) -> httpx.Response:
    raise httpx.ReadError(f"read from {request.url.host}:{request.url.port}: reset by peer")


async def too_slow(request: httpx.Request) -> httpx.Response:
    raise httpx.ReadTimeout(f"read from {request.url.host}:{request.url.port} timed out")


async def not_json(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, content=b"<html>http://decode:8200</html>")


async def engine_500(request: httpx.Request) -> httpx.Response:
    return json_response({"error": {"message": "engine fault", "code": 500}}, 500)


async def crash(request: httpx.Request) -> httpx.Response:
    raise RuntimeError(f"a bug while calling {request.url}")


async def broken_stream(request: httpx.Request) -> httpx.Response:
    response, body = streaming()
    body.push(EVENT)
    body.fail(httpx.ReadError("read from decode:8200: reset by peer"))
    return response


async def fine(request: httpx.Request) -> httpx.Response:
    if request.url.host == "prefill":
        return json_response(PREFILL_ANSWER)
    return json_response({"choices": [{"text": "ok"}]})


#: (name, config changes, upstream handler, how the client asks, expected status)
CASES: list[tuple[str, dict[str, Any], Handler | None, dict[str, Any], int]] = [
    ("bad json", {}, fine, {"raw": b"{"}, 400),
    ("no api key", {"api_key": "k"}, fine, {}, 401),
    ("unknown route", {}, fine, {"path": "/v1/nothing"}, 404),
    ("wrong method", {}, fine, {"method": "GET"}, 405),
    ("too large", {"max_payload_size": 8}, fine, {}, 413),
    ("not json type", {}, fine, {"headers": {"content-type": "text/plain"}}, 415),
    ("prefill refused", {}, refused, {}, 502),
    ("decode refused", {}, None, {"decode": refused}, 502),
    ("prefill reset", {}, reset, {}, 502),
    ("decode reset", {}, None, {"decode": reset}, 502),
    ("prefill timeout", {}, too_slow, {}, 504),
    ("decode timeout", {}, None, {"decode": too_slow}, 504),
    ("prefill not json", {}, not_json, {}, 502),
    ("engine 500", {}, engine_500, {}, 500),
    ("router bug", {}, crash, {}, 500),
    ("stream broke", {}, None, {"decode": broken_stream}, 200),
    ("no endpoint", {}, fine, {"withdraw": "http://decode:8200"}, 503),
]


@pytest.mark.parametrize(("name", "changes", "handler", "ask", "status"), CASES)
async def test_no_error_a_client_gets_names_an_upstream(
    name: str,
    changes: dict[str, Any],
    handler: Handler | None,
    ask: dict[str, Any],
    status: int,
    background: trio.Nursery,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    if handler is None:
        handler = await prefill_then(ask["decode"])
    config = pd_config(retry=NO_RETRY, **changes)
    app, _ = make_app(config, handler, background)
    if "withdraw" in ask:
        app.fleet.withdraw(ask["withdraw"])
    body = None if "raw" in ask else (REQUEST if name == "stream broke" else ASK)
    ex = await call(
        app,
        ask.get("method", "POST"),
        ask.get("path", "/v1/completions"),
        body,
        raw=ask.get("raw"),
        headers={"x-request-id": "rid-1", **ask.get("headers", {})},
    )
    assert ex.status == status
    seen = " ".join(f"{k}: {v}" for k, v in ex.headers.items()) + bytes(ex.body).decode()
    for secret in SECRETS:
        assert secret not in seen, f"{name}: {secret!r} reached the client: {seen}"
    if status in (502, 504) or name == "stream broke":
        assert "upstream" in seen and "(request id rid-1)" in seen  # which stage, which request
        assert ":8" in caplog.text, "the log keeps the failing upstream"
    if name == "router bug":
        assert "(request id rid-1)" in seen and "Traceback" in caplog.text


async def test_with_the_flag_the_routing_headers_name_the_endpoints(
    background: trio.Nursery,
) -> None:
    hidden, _ = make_app(pd_config(), fine, background)
    shown, _ = make_app(pd_config(expose_routing_headers=True), fine, background)
    ex = await call(hidden, "POST", "/v1/completions", ASK)
    assert [h for h in ex.headers if h.startswith("x-trio-pdrouter")] == []
    assert ex.headers["x-request-id"]
    ex = await call(shown, "POST", "/v1/completions", ASK)
    assert ex.headers["x-trio-pdrouter-prefill"] == "http://prefill:8100"
    assert ex.headers["x-trio-pdrouter-decode"] == "http://decode:8200"

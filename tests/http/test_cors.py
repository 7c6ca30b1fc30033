"""CORS headers and preflight answers, as vllm-router gives them to browsers."""

from __future__ import annotations

import attrs
import httpx
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

UI = "http://ui.example"


async def handler(request: httpx.Request) -> httpx.Response:
    if request.url.host == "prefill":
        return json_response(PREFILL_ANSWER)
    response, body = streaming()
    body.push(EVENT + b"data: [DONE]\n\n")
    body.end()
    return response


PREFLIGHT = {
    "origin": UI,
    "access-control-request-method": "POST",
    "access-control-request-headers": "content-type, authorization",
}


async def test_an_allowed_origin_is_answered_and_its_preflight_too(
    background: trio.Nursery,
) -> None:
    config = attrs.evolve(pd_config(), cors_allowed_origins=(UI,), api_key="secret")
    app, upstream = make_app(config, handler, background)
    pre = await call(app, "OPTIONS", "/v1/completions", headers=PREFLIGHT)
    assert pre.status == 200 and bytes(pre.body) == b""  # before the API key check
    assert pre.headers["access-control-allow-origin"] == UI
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert "authorization" in pre.headers["access-control-allow-headers"]
    assert pre.headers["access-control-max-age"] == "3600"
    assert upstream.requests == []
    auth = {"origin": UI, "authorization": "Bearer secret"}
    ex = await call(app, "POST", "/v1/completions", REQUEST, headers=auth)
    assert ex.status == 200 and bytes(ex.body).endswith(b"[DONE]\n\n")
    assert ex.headers["access-control-allow-origin"] == UI
    assert ex.headers["access-control-expose-headers"] == "x-request-id"
    assert ex.headers["vary"] == "origin"


async def test_another_origin_gets_no_cors_headers(background: trio.Nursery) -> None:
    app, _ = make_app(attrs.evolve(pd_config(), cors_allowed_origins=(UI,)), handler, background)
    evil = {**PREFLIGHT, "origin": "http://evil.example"}
    pre = await call(app, "OPTIONS", "/v1/completions", headers=evil)
    assert "access-control-allow-origin" not in pre.headers
    ex = await call(app, "GET", "/health", headers={"origin": "http://evil.example"})
    assert ex.status == 200 and "access-control-allow-origin" not in ex.headers


async def test_without_origins_any_origin_may_call_as_in_vllm_router(
    background: trio.Nursery,
) -> None:
    app, _ = make_app(pd_config(), handler, background)
    pre = await call(app, "OPTIONS", "/v1/chat/completions", headers=PREFLIGHT)
    assert pre.headers["access-control-allow-origin"] == "*"
    assert pre.headers["access-control-allow-headers"] == "*"
    ex = await call(app, "GET", "/health", headers={"origin": UI})
    assert ex.headers["access-control-allow-origin"] == "*"


async def test_clients_without_origin_get_no_cors_headers(background: trio.Nursery) -> None:
    app, _ = make_app(pd_config(), handler, background)
    ex = await call(app, "POST", "/v1/completions", REQUEST)
    assert not [name for name in ex.headers if name.startswith("access-control")]
    ex = await call(app, "OPTIONS", "/v1/completions")
    assert ex.status == 405  # not a preflight: routed as usual

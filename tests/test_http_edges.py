"""HTTP edges a hostile client or a broken upstream finds: each is answered, none slips past."""

from __future__ import annotations

import httpx
import trio
import trio.testing

from .harness import PREFILL_ANSWER, REQUEST, call, json_response, make_app, pd_config, streaming


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


async def test_a_stream_answered_as_plain_text_is_a_502(background: trio.Nursery) -> None:
    async def plain(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        response, body = streaming(content_type="text/plain")
        body.push(b"not an event stream")
        body.end()
        return response

    app, upstream = make_app(pd_config(), plain, background)
    ex = await call(app, "POST", "/v1/completions", REQUEST)
    assert ex.status == 502 and "text/plain" in ex.json()["error"]["message"]
    assert upstream.bodies[0].closed


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
    assert (await call(app, "GET", "/health")).status == 200


async def test_an_answer_past_the_cap_is_a_502_not_a_memory_spike(
    background: trio.Nursery,
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
        assert ex.status == 502 and "larger than 4096 bytes" in ex.json()["error"]["message"]
    await trio.testing.wait_all_tasks_blocked()  # the KV reclaims (background) end too
    assert all(body.closed and not body.read_to_end for body in upstream.bodies)

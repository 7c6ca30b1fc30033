"""Runtime endpoint management and the admin routes, in memory."""

from __future__ import annotations

import httpx
import trio
import trio.testing

from tests.harness import (
    EVENT,
    PREFILL_ANSWER,
    REQUEST,
    Exchange,
    call,
    json_response,
    loads,
    make_app,
    pd_config,
    streaming,
    total_load,
)
from trio_pdrouter.http import DONE


async def ok_handler(request: httpx.Request) -> httpx.Response:
    if request.url.port == 8100 or request.url.host.startswith("p"):
        return json_response(PREFILL_ANSWER)
    return json_response({"choices": [{"text": "ok"}]})


async def test_added_worker_takes_traffic_once_its_first_probe_passes(
    background: trio.Nursery,
) -> None:
    app, upstream = make_app(pd_config(admin_from_loopback=True, dp_size=2), ok_handler, background)
    ex = await call(app, "POST", "/workers", {"url": "http://decode2:9000/", "role": "decode"})
    assert ex.status == 201
    assert ex.json() == {
        "url": "http://decode2:9000",
        "role": "decode",
        "endpoints": ["http://decode2:9000@0", "http://decode2:9000@1"],
    }
    workers = (await call(app, "GET", "/workers")).json()["workers"]
    assert {w["key"]: w["routable"] for w in workers if "decode2" in w["url"]} == {
        "http://decode2:9000@0": False,
        "http://decode2:9000@1": False,
    }
    async with trio.open_nursery() as nursery:
        await nursery.start(app.health.run, httpx.AsyncClient(transport=upstream))
        await trio.testing.wait_all_tasks_blocked()  # the new URL is probed at once
        probes = [r for r in upstream.requests if r.url.path == "/health"]
        assert {r.url.host for r in probes} >= {"decode2"}
        for _ in range(8):
            assert (await call(app, "POST", "/v1/completions", {"prompt": "x"})).status == 200
        nursery.cancel_scope.cancel()
    decode_hosts = {
        r.url.host
        for r in upstream.requests
        if r.url.path == "/v1/completions" and r.url.port in (8200, 9000)
    }
    assert decode_hosts == {"decode", "decode2"}


async def test_bad_worker_requests_are_refused(background: trio.Nursery) -> None:
    app, _ = make_app(pd_config(admin_from_loopback=True), ok_handler, background)
    cases = [
        ({"url": "http://decode:8200", "role": "decode"}, 409),
        ({"url": "ftp://x:1", "role": "decode"}, 400),
        # Each of these once answered 201, then its health probe ended the process.
        ({"url": "http://a\tb:1", "role": "decode"}, 400),
        ({"url": "http://a\x7fb:1", "role": "decode"}, 400),
        ({"url": "http://a\u2000b:1", "role": "decode"}, 400),
        ({"url": "http://user:secret@x:1", "role": "decode"}, 400),
        ({"url": "http://x:0", "role": "decode"}, 400),
        (
            {"url": "HTTP://DECODE:8200/", "role": "decode"},
            409,
        ),  # the same server, spelled otherwise
        ({"url": "http://x", "role": "decode"}, 400),
        ({"url": "http://x:1", "role": "regular"}, 400),
        ({"url": "http://x:1", "role": "boss"}, 400),
        ({"role": "decode"}, 400),
    ]
    for body, status in cases:
        ex = await call(app, "POST", "/workers", body)
        assert ex.status == status, (body, ex.json())
        assert set(ex.json()["error"]) == {"message", "type", "param", "code"}
    assert (
        await call(app, "POST", "/workers", raw=b"{", headers={"content-type": "application/json"})
    ).status == 400
    assert (await call(app, "DELETE", "/workers/http://nowhere:1")).status == 404
    # Percent-decoded once: "%252F" is "%2F" in the URL, not a slash (decoding twice would
    # turn it into the decode server's own URL and remove it).
    assert (await call(app, "DELETE", "/workers/http%3A%2F%2Fdecode%3A8200%252F")).status == 404
    assert (await call(app, "GET", "/workers")).json()["workers"], "nothing was removed"


async def test_https_workers_are_refused_with_the_command_lines_message(
    background: trio.Nursery,
) -> None:
    app, _ = make_app(pd_config(admin_from_loopback=True), ok_handler, background)
    ex = await call(app, "POST", "/workers", {"url": "https://x:1", "role": "decode"})
    assert ex.status == 400
    assert "https upstreams are not supported yet" in ex.json()["error"]["message"]
    assert loads(app)["decode"] == {"http://decode:8200": 0}


async def test_removal_stops_new_traffic_and_waits_for_in_flight_requests(
    background: trio.Nursery,
) -> None:
    bodies = []

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host.startswith("p"):
            return json_response(PREFILL_ANSWER)
        if request.url.host == "decode2":
            return json_response({"choices": []})
        response, body = streaming()
        bodies.append(body)
        return response

    app, upstream = make_app(
        pd_config(
            admin_from_loopback=True,
            decode_urls=("http://decode:8200", "http://decode2:9000"),
            policy="round_robin",
            expose_routing_headers=True,
        ),
        handler,
        background,
    )
    stream = Exchange()
    removal = Exchange()
    async with trio.open_nursery() as nursery:
        # Round robin: keep starting until the stream lands on the first decode server.
        while not bodies:
            probe = Exchange()
            nursery.start_soon(
                lambda ex=probe: call(app, "POST", "/v1/completions", REQUEST, exchange=ex)
            )
            await trio.testing.wait_all_tasks_blocked()
            if not bodies:
                await probe.finished.wait()
            else:
                stream = probe
        nursery.start_soon(
            lambda: call(app, "DELETE", "/workers/http%3A%2F%2Fdecode%3A8200", exchange=removal)
        )
        await trio.testing.wait_all_tasks_blocked()
        assert not removal.finished.is_set(), "removal waits for the in-flight stream"
        after = await call(app, "POST", "/v1/completions", {"prompt": "x"})
        assert after.headers["x-trio-pdrouter-decode"] == "http://decode2:9000"
        bodies[0].push(EVENT + DONE)
        bodies[0].end()
    assert stream.complete and removal.status == 200
    assert removal.json() == {"removed": ["http://decode:8200"], "in_flight": 0}
    assert "http://decode:8200" not in loads(app)["decode"]
    assert total_load(app) == 0
    assert upstream.requests


async def test_api_key_guards_everything_but_the_probes(background: trio.Nursery) -> None:
    app, upstream = make_app(pd_config(api_key="s3cret"), ok_handler, background)
    for path in ("/health", "/liveness", "/readiness"):
        assert (await call(app, "GET", path)).status == 200
    for method, path, body in [
        ("GET", "/get_loads", None),
        ("GET", "/workers", None),
        ("POST", "/v1/completions", {"prompt": "x"}),
    ]:
        denied = await call(app, method, path, body)
        assert denied.status == 401 and denied.json()["error"]["type"] == "authentication_error"
        wrong = await call(app, method, path, body, headers={"authorization": "Bearer nope"})
        assert wrong.status == 401
    assert not upstream.requests
    ok = await call(
        app, "POST", "/v1/completions", {"prompt": "x"}, headers={"authorization": "Bearer s3cret"}
    )
    assert ok.status == 200
    # The router's own key is never sent upstream.
    assert all("s3cret" not in r.headers.get("authorization", "") for r in upstream.requests)


async def test_the_routes_that_change_the_router_need_the_admin_key_not_the_clients(
    background: trio.Nursery,
) -> None:
    app, upstream = make_app(
        pd_config(api_key="client", admin_api_key="admin"), ok_handler, background
    )
    client, admin = {"authorization": "Bearer client"}, {"authorization": "Bearer admin"}
    new = {"url": "http://a:1", "role": "decode"}
    for method, path, body in [
        ("POST", "/workers", new),
        ("DELETE", "/workers/http://decode:8200", None),
        ("GET", "/debug/kv-index", None),
    ]:
        denied = await call(app, method, path, body, headers=client)
        assert denied.status == 401, (method, path)
        assert denied.headers["www-authenticate"] == "Bearer"
        assert "admin API key" in denied.json()["error"]["message"]
    assert [ep.url for ep in app.fleet.endpoints()] == ["http://prefill:8100", "http://decode:8200"]
    assert (await call(app, "GET", "/workers", headers=client)).status == 200  # reading stays
    assert (await call(app, "GET", "/workers", headers=admin)).status == 401  # the clients' key
    assert (await call(app, "POST", "/workers", new, headers=admin)).status == 201
    assert (await call(app, "GET", "/debug/kv-index", headers=admin)).status == 200
    assert not upstream.requests


async def test_without_an_admin_key_the_routes_that_change_the_router_are_off(
    background: trio.Nursery,
) -> None:
    app, _ = make_app(pd_config(), ok_handler, background)
    new = {"url": "http://a:1", "role": "decode"}
    for method, path, body in [
        ("POST", "/workers", new),
        ("DELETE", "/workers/http://decode:8200", None),
        ("GET", "/debug/kv-index", None),
    ]:
        off = await call(app, method, path, body)
        assert off.status == 403 and "--admin-api-key" in off.json()["error"]["message"]
    assert len(app.fleet.endpoints()) == 2
    loopback, _ = make_app(pd_config(admin_from_loopback=True), ok_handler, background)
    for peer, status in [("10.0.0.9", 403), ("::1", 201), ("::ffff:127.0.0.1", 409)]:
        ex = await call(loopback, "POST", "/workers", new, client=(peer, 1))
        assert ex.status == status, peer


async def test_addresses_no_engine_has_and_those_outside_the_allowed_networks_are_refused(
    background: trio.Nursery,
) -> None:
    app, _ = make_app(pd_config(admin_from_loopback=True), ok_handler, background)
    for url in [
        "http://169.254.169.254:80",  # a cloud's metadata service
        "http://[::ffff:169.254.169.254]:80",
        "http://[fe80::1]:8000",
        "http://0.0.0.0:8000",
        "http://255.255.255.255:8000",
        "http://0x7f.1:8000",
    ]:
        ex = await call(app, "POST", "/workers", {"url": url, "role": "decode"})
        assert ex.status == 400, url
    assert len(app.fleet.endpoints()) == 2
    fenced, _ = make_app(
        pd_config(
            admin_from_loopback=True,
            allowed_upstream_networks=("10.0.0.0/8",),
            prefill_urls=("http://10.0.0.1:8100",),
            decode_urls=("http://10.0.0.2:8200",),
        ),
        ok_handler,
        background,
    )
    for url, status in [
        ("http://10.9.9.9:1", 201),
        ("http://11.0.0.1:1", 400),
        ("http://e:1", 400),
    ]:
        ex = await call(fenced, "POST", "/workers", {"url": url, "role": "decode"})
        assert ex.status == status, (url, ex.json())


async def test_upstream_api_key_replaces_the_clients(background: trio.Nursery) -> None:
    app, upstream = make_app(
        pd_config(admin_from_loopback=True, upstream_api_key="engine-key"), ok_handler, background
    )
    await call(
        app, "POST", "/v1/completions", {"prompt": "x"}, headers={"authorization": "Bearer client"}
    )
    assert {r.headers["authorization"] for r in upstream.requests} == {"Bearer engine-key"}

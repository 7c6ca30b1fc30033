"""Circuit breakers and health checks steer real routing decisions (in memory)."""

from __future__ import annotations

import httpx
import trio
import trio.testing

from tests.harness import PREFILL_ANSWER, call, json_response, make_app, pd_config, total_load
from trio_pdrouter.config import BreakerSettings, HealthSettings, RetrySettings
from trio_pdrouter.endpoints import Endpoint, Role

TWO_PREFILLS = ("http://p1:1", "http://p2:2")


async def test_breaker_opens_on_failures_and_policies_skip_the_endpoint(
    autojump_clock: trio.testing.MockClock,
    background: trio.Nursery,
) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "p1":
            return json_response({"error": "broken"}, 500)
        if request.url.host == "p2":
            return json_response(PREFILL_ANSWER)
        return json_response({"choices": []})

    config = pd_config(
        prefill_urls=TWO_PREFILLS,
        breaker=BreakerSettings(failure_threshold=2, timeout_duration_secs=60),
    )
    app, upstream = make_app(config, handler, background)
    for _ in range(10):
        assert (await call(app, "POST", "/v1/completions", {"prompt": "x"})).status == 200
    p1_calls = [r for r in upstream.requests if r.url.host == "p1"]
    assert len(p1_calls) == 2, "after two failures the circuit is open and p1 gets nothing"
    workers = {w["key"]: w for w in (await call(app, "GET", "/workers")).json()["workers"]}
    assert workers["http://p1:1"]["circuit"] == "open"
    assert workers["http://p1:1"]["routable"] is False
    assert workers["http://p2:2"]["circuit"] == "closed"
    assert total_load(app) == 0


async def test_half_open_trial_closes_the_circuit_after_recovery(
    autojump_clock: trio.testing.MockClock,
    background: trio.Nursery,
) -> None:
    broken = True

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "p1" and broken:
            raise httpx.ConnectError("refused")
        if request.url.host in ("p1", "p2"):
            return json_response(PREFILL_ANSWER)
        return json_response({"choices": []})

    config = pd_config(
        prefill_urls=TWO_PREFILLS,
        breaker=BreakerSettings(failure_threshold=1, success_threshold=1, timeout_duration_secs=5),
        retry=RetrySettings(max_retries=2),
    )
    app, upstream = make_app(config, handler, background)
    for _ in range(4):
        await call(app, "POST", "/v1/completions", {"prompt": "x"})
    workers = {w["key"]: w for w in (await call(app, "GET", "/workers")).json()["workers"]}
    assert workers["http://p1:1"]["circuit"] == "open"
    broken = False
    await trio.sleep(6)  # MockClock: past the open timeout, the next choice may try p1
    for _ in range(6):
        assert (await call(app, "POST", "/v1/completions", {"prompt": "x"})).status == 200
    workers = {w["key"]: w for w in (await call(app, "GET", "/workers")).json()["workers"]}
    assert workers["http://p1:1"]["circuit"] == "closed"
    late = [r for r in upstream.requests[-12:] if r.url.host == "p1"]
    assert late, "p1 takes traffic again once it recovered"


async def test_unhealthy_endpoint_gets_no_traffic_and_readiness_says_so(
    autojump_clock: trio.testing.MockClock,
    background: trio.Nursery,
) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(503 if request.url.host == "p1" else 200)
        if request.url.host in ("p1", "p2"):
            return json_response(PREFILL_ANSWER)
        return json_response({"choices": []})

    config = pd_config(
        prefill_urls=TWO_PREFILLS,
        health=HealthSettings(interval_secs=1, failure_threshold=2, success_threshold=1),
    )
    app, upstream = make_app(config, handler, background)
    async with trio.open_nursery() as nursery:
        await nursery.start(app.health.run, httpx.AsyncClient(transport=upstream))
        await trio.sleep(2.5)  # MockClock: two failed probes of p1
        assert not app.health.is_healthy(Endpoint("http://p1:1", Role.PREFILL))
        before = len(
            [r for r in upstream.requests if r.url.host == "p1" and r.url.path != "/health"]
        )
        for _ in range(6):
            assert (await call(app, "POST", "/v1/completions", {"prompt": "x"})).status == 200
        after = len(
            [r for r in upstream.requests if r.url.host == "p1" and r.url.path != "/health"]
        )
        assert after == before
        nursery.cancel_scope.cancel()


async def test_no_routable_endpoint_is_503_and_readiness_fails(
    autojump_clock: trio.testing.MockClock,
    background: trio.Nursery,
) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503)

    config = pd_config(health=HealthSettings(interval_secs=1, failure_threshold=1))
    app, upstream = make_app(config, handler, background)
    async with trio.open_nursery() as nursery:
        await nursery.start(app.health.run, httpx.AsyncClient(transport=upstream))
        await trio.sleep(1.5)
        ex = await call(app, "POST", "/v1/completions", {"prompt": "x"})
        assert ex.status == 503 and ex.json()["error"]["type"] == "service_unavailable"
        ready = await call(app, "GET", "/readiness")
        assert ready.status == 503
        assert set(ready.json()["no_healthy_endpoint"]) == {"prefill", "decode"}
        assert (await call(app, "GET", "/health")).status == 200  # liveness of the router itself
        nursery.cancel_scope.cancel()
    assert not [r for r in upstream.requests if r.url.path == "/v1/completions"]

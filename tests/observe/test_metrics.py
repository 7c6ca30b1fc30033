"""Prometheus metrics: a private registry per router, names and labels, and movement under
traffic (in memory and against real simulators)."""

from __future__ import annotations

import contextlib
import socket

import httpx
import pytest
import trio
import trio.testing
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster import start_cluster
from tests.harness import call, json_response, make_app, pd_config
from tests.serve.test_integration_pd import CHAT, COMPLETION
from trio_pdrouter.config import ConfigError, RouterConfig
from trio_pdrouter.endpoints import Endpoint, Role
from trio_pdrouter.http import BindError
from trio_pdrouter.ledger import LoadLedger
from trio_pdrouter.observe import CONTENT_TYPE, RequestRecord, RouterMetrics
from trio_pdrouter.server import metrics_socket

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(text: str) -> Samples:
    """Every sample of an exposition, keyed by (name, labels)."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(all_samples: Samples, name: str, **labels: str) -> float | None:
    return all_samples.get((name, frozenset(labels.items())))


def test_each_router_has_its_own_registry() -> None:
    a, b = RouterMetrics(), RouterMetrics()
    a.policy_decision("decode", "cache_hit")
    assert (
        a.registry.get_sample_value(
            "trio_pdrouter_policy_decisions_total", {"stage": "decode", "reason": "cache_hit"}
        )
        == 1
    )
    assert (
        b.registry.get_sample_value(
            "trio_pdrouter_policy_decisions_total", {"stage": "decode", "reason": "cache_hit"}
        )
        is None
    )
    assert not [m for m in REGISTRY.collect() if m.name.startswith("trio_pdrouter_")]


def test_observe_request_counts_times_and_errors() -> None:
    m = RouterMetrics()
    rec = RequestRecord("r1", "/v1/completions", True, started=0.0)
    rec.prefill, rec.decode = "http://p:1@0", "http://d:2@1"
    rec.status, rec.outcome = 200, "ok"
    rec.prefill_ms, rec.ttfb_ms, rec.total_ms = 40.0, 60.0, 1040.0
    rec.retries = 2
    rec.upstream_errors = [
        ("prefill", "http://p:1@1", "connect"),
        ("prefill", "http://p:1@1", "connect"),
    ]
    m.observe_request(rec)
    get = m.registry.get_sample_value
    labels = {"route": "/v1/completions", "status": "200", "stream": "true", "outcome": "ok"}
    assert get("trio_pdrouter_requests_total", labels) == 1
    assert get("trio_pdrouter_ttfb_seconds_count", {"route": "/v1/completions"}) == 1
    assert get("trio_pdrouter_ttfb_seconds_sum", {"route": "/v1/completions"}) == 0.06
    assert (
        get(
            "trio_pdrouter_request_duration_seconds_sum",
            {"route": "/v1/completions", "stream": "true"},
        )
        == 1.04
    )
    assert get("trio_pdrouter_prefill_duration_seconds_sum") == 0.04
    assert get("trio_pdrouter_decode_duration_seconds_sum") == 1.0
    assert get("trio_pdrouter_retries_total", {"route": "/v1/completions"}) == 2
    errors = {"stage": "prefill", "endpoint": "http://p:1@1", "kind": "connect"}
    assert get("trio_pdrouter_upstream_errors_total", errors) == 2


def test_a_request_that_never_reached_prefill_times_no_legs() -> None:
    m = RouterMetrics()
    rec = RequestRecord("r2", "/v1/chat/completions", False, started=0.0)
    rec.status, rec.outcome, rec.total_ms = 503, "no_endpoint", 0.5
    m.observe_request(rec)
    get = m.registry.get_sample_value
    assert get("trio_pdrouter_prefill_duration_seconds_count") == 0
    assert get("trio_pdrouter_decode_duration_seconds_count") == 0
    assert get("trio_pdrouter_ttfb_seconds_count", {"route": "/v1/chat/completions"}) is None
    labels = {"route": "/v1/chat/completions", "status": "503", "stream": "false"}
    assert get("trio_pdrouter_requests_total", {**labels, "outcome": "no_endpoint"}) == 1


def test_in_flight_mirrors_the_ledger_per_endpoint_and_stage() -> None:
    prefill, decode = Endpoint("http://p:1", Role.PREFILL), Endpoint("http://d:2", Role.DECODE)
    ledger = LoadLedger([prefill, decode])
    m = RouterMetrics()
    m.watch_ledger(ledger, [prefill, decode])
    get = m.registry.get_sample_value

    def in_flight(ep: Endpoint) -> float | None:
        m.exposition()  # what a scrape shows: the gauge is read from the ledger then
        return get("trio_pdrouter_in_flight", {"endpoint": ep.key, "stage": ep.role.value})

    assert (in_flight(prefill), in_flight(decode)) == (0, 0)
    with ledger.lease(prefill, decode) as lease:
        assert (in_flight(prefill), in_flight(decode)) == (1, 1)
        lease.release(prefill)
        assert (in_flight(prefill), in_flight(decode)) == (0, 1)
    assert (in_flight(prefill), in_flight(decode)) == (0, 0)
    late = Endpoint("http://d:3", Role.DECODE)
    ledger.add_endpoint(late)
    with ledger.lease(late):
        assert in_flight(late) == 1
        ledger.forget_when_idle(late)
        assert in_flight(late) == 1
    assert in_flight(late) == 0  # no longer counted by the ledger: shown idle, not stale


def test_hooks_for_breakers_health_admission_policies_and_stranded_kv() -> None:
    m = RouterMetrics()
    m.breaker_state("http://d:2", "open")
    m.health("http://d:2", False)
    m.watch_admission(lambda: 7)
    m.policy_decision("decode", "cache_hit")
    m.policy_decision("decode", "unbalanced")
    m.policy_decision("decode", "unbalanced")
    m.stranded_kv(Endpoint("http://d:2", Role.DECODE, 1))
    get = m.registry.get_sample_value
    assert get("trio_pdrouter_circuit_breaker_state", {"endpoint": "http://d:2"}) == 2
    assert get("trio_pdrouter_endpoint_healthy", {"endpoint": "http://d:2"}) == 0
    assert get("trio_pdrouter_admission_queue_depth") == 7
    decisions = "trio_pdrouter_policy_decisions_total"
    assert get(decisions, {"stage": "decode", "reason": "cache_hit"}) == 1
    assert get(decisions, {"stage": "decode", "reason": "unbalanced"}) == 2
    assert get("trio_pdrouter_load_balance_events_total", {"stage": "decode"}) == 2
    assert get("trio_pdrouter_stranded_kv_handoffs_total", {"endpoint": "http://d:2@1"}) == 1
    m.breaker_state("http://d:2", "half_open")
    assert get("trio_pdrouter_circuit_breaker_state", {"endpoint": "http://d:2"}) == 1


async def test_retried_prefill_errors_are_counted_in_memory(
    autojump_clock: trio.testing.MockClock,
    background: trio.Nursery,
) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        return json_response({"error": "busy"}, 503)

    app, upstream = make_app(pd_config(), handler, background)
    ex = await call(app, "POST", "/v1/completions", {**COMPLETION, "max_tokens": 2})
    assert ex.status == 503
    attempts = len(upstream.requests)
    assert attempts > 1
    reply = await call(app, "GET", "/metrics")
    assert reply.status == 200 and reply.headers["content-type"] == CONTENT_TYPE
    s = samples(bytes(reply.body).decode())
    kind = {"stage": "prefill", "endpoint": "http://prefill:8100", "kind": "status_503"}
    assert value(s, "trio_pdrouter_upstream_errors_total", **kind) == attempts
    assert value(s, "trio_pdrouter_retries_total", route="/v1/completions") == attempts - 1
    labels = {"route": "/v1/completions", "status": "503", "stream": "false"}
    assert value(s, "trio_pdrouter_requests_total", **labels, outcome="upstream_error") == 1


async def test_metrics_move_under_traffic_against_simulators() -> None:
    async with trio.open_nursery() as nursery:
        c = await start_cluster(nursery, dp_size=2, expose_routing_headers=True)
        for route, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
            for stream in (True, False, True):
                resp = await c.client.post(
                    c.url + route, json={**body, "max_tokens": 4, "stream": stream}
                )
                assert resp.status_code == 200
        resp = await c.client.get(c.url + "/metrics")
        assert resp.headers["content-type"] == CONTENT_TYPE
        s = samples(resp.text)
        for route in ("/v1/completions", "/v1/chat/completions"):
            ok = {"route": route, "status": "200", "outcome": "ok"}
            assert value(s, "trio_pdrouter_requests_total", **ok, stream="true") == 2
            assert value(s, "trio_pdrouter_requests_total", **ok, stream="false") == 1
            assert value(s, "trio_pdrouter_ttfb_seconds_count", route=route) == 2
            assert (
                value(s, "trio_pdrouter_request_duration_seconds_count", route=route, stream="true")
                == 2
            )
        assert value(s, "trio_pdrouter_prefill_duration_seconds_count") == 6
        assert value(s, "trio_pdrouter_decode_duration_seconds_count") == 6
        in_flight = {
            dict(labels)["endpoint"]: v
            for (name, labels), v in s.items()
            if name == "trio_pdrouter_in_flight"
        }
        keys = {ep.key for ep in c.router.app.fleet.endpoints()}
        assert set(in_flight) == keys and set(in_flight.values()) == {0}
        # Scrape-driven series exist once a scrape ran (the first one runs at start).
        await c.router.app.engine_truth.scrape()  # type: ignore[union-attr]
        s = samples((await c.client.get(c.url + "/metrics")).text)
        drift = {
            dict(k[1])["endpoint"]: v for k, v in s.items() if k[0] == "trio_pdrouter_load_drift"
        }
        assert drift == dict.fromkeys(keys, 0)

        # A stream held open shows as in flight on the decode endpoint the router chose.
        body = {**COMPLETION, "max_tokens": 2000, "stream": True}
        async with c.client.stream("POST", c.url + "/v1/completions", json=body) as resp:
            chunks = resp.aiter_raw()
            await chunks.__anext__()
            decode = resp.headers["x-trio-pdrouter-decode"]
            s = samples((await c.client.get(c.url + "/metrics")).text)
            assert value(s, "trio_pdrouter_in_flight", endpoint=decode, stage="decode") == 1
        nursery.cancel_scope.cancel()


async def test_separate_metrics_listener_serves_only_metrics() -> None:
    async with trio.open_nursery() as nursery:
        c = await start_cluster(nursery, prometheus_port=0)
        metrics_url = c.router.metrics_url
        assert metrics_url is not None and metrics_url != c.url
        resp = await c.client.post(c.url + "/v1/completions", json={**COMPLETION, "max_tokens": 2})
        assert resp.status_code == 200
        resp = await c.client.get(metrics_url + "/metrics")
        assert resp.status_code == 200 and resp.headers["content-type"] == CONTENT_TYPE
        labels = {"route": "/v1/completions", "status": "200", "stream": "false", "outcome": "ok"}
        assert value(samples(resp.text), "trio_pdrouter_requests_total", **labels) == 1
        assert (await c.client.get(metrics_url + "/get_loads")).status_code == 404
        assert (await c.client.post(metrics_url + "/metrics")).status_code == 405
        nursery.cancel_scope.cancel()


def test_the_default_listener_is_vllm_routers_port_and_gives_way_when_taken(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = RouterConfig(worker_urls=("http://w:1",))
    assert config.metrics_listener() == ("127.0.0.1", 29000, False)
    holder = socket.socket()
    with contextlib.suppress(OSError):  # held already by another process: just as taken
        holder.bind(("127.0.0.1", 29000))
        holder.listen()
    try:
        assert metrics_socket(config, 16) is None
        assert "metrics listener not opened: cannot listen on 127.0.0.1:29000" in caplog.text
    finally:
        holder.close()


def test_a_given_metrics_port_must_open_and_the_listener_can_be_turned_off() -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        config = RouterConfig(worker_urls=("http://w:1",), prometheus_port=port)
        with pytest.raises(
            BindError, match=f"--prometheus-port: cannot listen on 127.0.0.1:{port}"
        ):
            metrics_socket(config, 16)
    finally:
        holder.close()
    off = RouterConfig(worker_urls=("http://w:1",), prometheus_listener=False)
    assert off.metrics_listener() is None and metrics_socket(off, 16) is None
    with pytest.raises(ConfigError, match="--no-prometheus-listener"):
        RouterConfig(worker_urls=("http://w:1",), prometheus_port=1, prometheus_listener=False)

"""Retries, timeouts and the stranded-KV release, in memory."""

from __future__ import annotations

import attrs
import httpx
import orjson
import pytest
import trio
import trio.testing

from tests.harness import (
    EVENT,
    KV,
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
from trio_pdrouter.config import RetrySettings, Timeouts
from trio_pdrouter.http import DONE

TWO_PREFILLS = {"prefill_urls": ("http://p1:1", "http://p2:2")}


async def test_prefill_5xx_is_retried_on_another_endpoint(
    autojump_clock: trio.testing.MockClock,
    background: trio.Nursery,
) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "p1":
            return json_response({"error": "down"}, 503)
        if request.url.host == "p2":
            return json_response(PREFILL_ANSWER)
        return json_response({"choices": [{"text": "ok"}]})

    app, upstream = make_app(
        pd_config(**TWO_PREFILLS, expose_routing_headers=True), handler, background
    )
    for _ in range(4):
        ex = await call(app, "POST", "/v1/completions", {"prompt": "x"})
        assert ex.status == 200
        assert ex.headers["x-trio-pdrouter-prefill"] == "http://p2:2"
    hosts = [r.url.host for r in upstream.requests]
    # round_robin sends some first attempts to p1; each is retried once, on p2.
    assert hosts.count("p1") >= 1 and hosts.count("p2") == 4 and hosts.count("decode") == 4
    assert total_load(app) == 0


async def test_decode_failure_before_any_byte_retries_decode_with_the_same_kv(
    autojump_clock: trio.testing.MockClock,
    background: trio.Nursery,
) -> None:
    decode_calls = 0

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal decode_calls
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        decode_calls += 1
        if decode_calls == 1:
            raise httpx.ConnectError("refused")
        response, body = streaming()
        body.push(EVENT + DONE)
        body.end()
        return response

    app, upstream = make_app(pd_config(), handler, background)
    ex = await call(app, "POST", "/v1/completions", REQUEST)
    assert ex.status == 200 and bytes(ex.body) == EVENT + DONE
    # The prefill's blocks were still held: no second prefill, the same params to decode.
    assert [r.url.host for r in upstream.requests] == ["prefill", "decode", "decode"]
    assert upstream.json_of(1) == upstream.json_of(2) == {**REQUEST, "kv_transfer_params": KV}
    assert len({r.headers["x-request-id"] for r in upstream.requests}) == 1
    assert total_load(app) == 0


async def test_no_retry_after_the_first_byte(background: trio.Nursery) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        response, body = streaming()
        body.push(EVENT)
        body.fail(httpx.RemoteProtocolError("peer closed"))
        return response

    app, upstream = make_app(pd_config(), handler, background)
    ex = await call(app, "POST", "/v1/completions", REQUEST)
    assert ex.status == 200 and bytes(ex.body).startswith(EVENT) and bytes(ex.body).endswith(DONE)
    assert len(upstream.requests) == 2
    assert total_load(app) == 0


async def test_429_is_retried_then_passed_through(
    autojump_clock: trio.testing.MockClock, background: trio.Nursery
) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        return json_response({"error": {"message": "slow down", "code": 429}}, 429)

    config = pd_config(retry=RetrySettings(max_retries=3))
    app, upstream = make_app(config, handler, background)
    ex = await call(app, "POST", "/v1/completions", {"prompt": "x"})
    assert ex.status == 429 and ex.json()["error"]["message"] == "slow down"
    assert len(upstream.requests) == 3


async def test_decode_first_byte_timeout_is_504(
    autojump_clock: trio.testing.MockClock, background: trio.Nursery
) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        await trio.sleep_forever()
        raise AssertionError

    config = pd_config(timeouts=Timeouts(first_byte=2.0), retry=RetrySettings(max_retries=2))
    app, _ = make_app(config, handler, background)
    for body in (REQUEST, {"prompt": "x"}):  # streaming, then buffered
        started = trio.current_time()
        ex = await call(app, "POST", "/v1/completions", body)
        assert ex.status == 504 and ex.json()["error"]["type"] == "timeout_error"
        assert 4.0 <= trio.current_time() - started < 5.0  # two attempts of 2 s plus backoff
    assert total_load(app) == 0


async def test_client_leaving_before_a_retry_releases_the_stranded_kv(
    background: trio.Nursery,
) -> None:
    stranded_seen = trio.Event()
    first_decode = trio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        if not first_decode.is_set():
            first_decode.set()  # refused: the blocks stay the router's, for the retry
            return json_response({"error": {"message": "busy", "code": 503}}, 503)
        stranded_seen.set()
        response, body = streaming()
        body.push(EVENT)
        return response  # never ends: the router must close it after the first event

    config = pd_config(retry=RetrySettings(max_retries=2, initial_backoff_ms=600_000))
    app, upstream = make_app(config, handler, background)
    ex = Exchange()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: call(app, "POST", "/v1/completions", REQUEST, exchange=ex))
        await first_decode.wait()
        await trio.testing.wait_all_tasks_blocked()  # waiting out the retry's backoff
        ex.disconnect.set()
    with trio.fail_after(5):  # a guard against hanging if no release is sent, not a sync
        await stranded_seen.wait()
    await trio.testing.wait_all_tasks_blocked()  # the reclaim reads its first event and ends
    stranded = orjson.loads(upstream.requests[-1].content)
    assert stranded["kv_transfer_params"] == KV
    assert stranded["max_tokens"] == 1 and stranded["stream"] is True
    assert "min_tokens" not in stranded and "stream_options" not in stranded
    assert upstream.bodies[-1].closed
    handoffs = app.metrics.registry.get_sample_value(
        "trio_pdrouter_stranded_kv_handoffs_total", {"endpoint": "http://decode:8200"}
    )
    assert handoffs == 1
    assert total_load(app) == 0


@pytest.mark.parametrize("head", [False, True])
async def test_a_stream_has_taken_the_kv_once_its_request_was_written(
    head: bool, background: trio.Nursery
) -> None:
    """vLLM adds a stream's request to its engine once it has read it (right after sending the
    head), and then every end of it frees the prefill's blocks: a client that leaves before or
    after the head arrived costs no reclaim (one would read freed blocks a second time)."""
    heads = trio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        if not head:
            await heads.wait()  # the engine has the request; its head never comes
        response, _body = streaming()
        return response

    app, upstream = make_app(pd_config(), handler, background)
    ex = Exchange()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: call(app, "POST", "/v1/completions", REQUEST, exchange=ex))
        await trio.testing.wait_all_tasks_blocked()
        assert [r.url.host for r in upstream.requests] == ["prefill", "decode"]
        ex.disconnect.set()
    await trio.testing.wait_all_tasks_blocked()
    assert len(upstream.requests) == 2, "decode has the blocks: nothing to reclaim"
    assert loads(app)["decode"] == {"http://decode:8200": 0}


@pytest.mark.parametrize("status", [400, 503])
async def test_decode_refusing_after_prefill_reclaims_the_kv_once(
    status: int, background: trio.Nursery
) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        if orjson.loads(request.content)["max_tokens"] == 1:  # the reclaim
            response, body = streaming()
            body.push(EVENT)
            return response
        return json_response({"error": {"message": "no", "code": status}}, status)

    config = pd_config(retry=RetrySettings(max_retries=2, initial_backoff_ms=0))
    app, upstream = make_app(config, handler, background)
    ex = await call(app, "POST", "/v1/completions", REQUEST)
    await trio.testing.wait_all_tasks_blocked()
    assert ex.status == status  # the engine's answer, once retries are exhausted
    hosts = [r.url.host for r in upstream.requests]
    # A 503 is retried on decode with the same blocks; then they are reclaimed, once.
    decodes = 1 if status == 400 else 2
    assert hosts == ["prefill"] + ["decode"] * (decodes + 1)
    reclaim = upstream.json_of(len(hosts) - 1)
    assert reclaim["max_tokens"] == 1 and reclaim["kv_transfer_params"] == KV
    assert upstream.bodies[-1].closed
    assert total_load(app) == 0


async def test_a_non_streaming_decode_is_never_reclaimed_once_sent(
    background: trio.Nursery,
) -> None:
    """A reclaim after decode pulled the blocks would make decode prefill twice."""
    decode_waiting = trio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        decode_waiting.set()
        await trio.sleep_forever()
        raise AssertionError

    app, upstream = make_app(pd_config(), handler, background)
    ex = Exchange()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            lambda: call(app, "POST", "/v1/completions", {"prompt": "x"}, exchange=ex)
        )
        await decode_waiting.wait()
        ex.disconnect.set()
    await trio.testing.wait_all_tasks_blocked()
    assert len(upstream.requests) == 2
    assert total_load(app) == 0


def test_retry_settings_are_vllm_routers() -> None:
    assert attrs.asdict(RetrySettings()) == {
        "max_retries": 5,
        "initial_backoff_ms": 50,
        "max_backoff_ms": 30000,
        "backoff_multiplier": 1.5,
        "jitter_factor": 0.2,
    }

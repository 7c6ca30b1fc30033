"""The request lifecycle in memory: every leg's outcome, every disconnect point, exact load."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

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
    ScriptedBody,
    StreamingDecode,
    call,
    json_response,
    loads,
    make_app,
    pd_config,
    streaming,
    total_load,
)
from trio_pdrouter.app import RouterApp
from trio_pdrouter.http import DONE
from trio_pdrouter.serve import TAKEOVER_AFTER


async def test_pd_stream_shapes_both_legs_and_holds_decode_load_until_the_last_byte(
    background: trio.Nursery,
) -> None:
    decode_bodies = []

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        response, body = streaming()
        decode_bodies.append(body)
        return response

    app, upstream = make_app(pd_config(expose_routing_headers=True), handler, background)
    ex = Exchange()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            lambda: call(
                app,
                "POST",
                "/v1/completions",
                REQUEST,
                headers={"x-request-id": "rid-7", "authorization": "Bearer k"},
                exchange=ex,
            )
        )
        await ex.started.wait()
        assert ex.status == 200 and ex.headers["content-type"] == "text/event-stream"
        # Headers arrived; the engine is still generating: decode load must still count.
        assert loads(app) == {
            "prefill": {"http://prefill:8100": 0},
            "decode": {"http://decode:8200": 1},
        }
        decode_bodies[0].push(EVENT)
        await trio.testing.wait_all_tasks_blocked()
        assert bytes(ex.body) == EVENT and not ex.complete
        assert loads(app)["decode"]["http://decode:8200"] == 1
        decode_bodies[0].push(DONE)
        decode_bodies[0].end()
    assert bytes(ex.body) == EVENT + DONE and ex.complete
    assert total_load(app) == 0
    prefill, decode = upstream.json_of(0), upstream.json_of(1)
    assert prefill["stream"] is False and prefill["max_tokens"] == 1
    assert "stream_options" not in prefill and "min_tokens" not in prefill
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True
    assert decode == {**REQUEST, "kv_transfer_params": KV}
    for request in upstream.requests:
        assert request.headers["x-request-id"] == "rid-7"
        assert request.headers["authorization"] == "Bearer k"
    assert str(upstream.requests[1].url) == "http://decode:8200/v1/completions"
    assert ex.headers["x-trio-pdrouter-decode"] == "http://decode:8200"
    assert decode_bodies[0].closed


@contextlib.asynccontextmanager
async def a_stream_nobody_reads(
    background: trio.Nursery,
) -> AsyncIterator[tuple[RouterApp, Exchange, ScriptedBody]]:
    """A PD stream whose head reached a client that then stopped reading, and the engine's
    body the test feeds; the request runs until the block ends."""
    engine = StreamingDecode()
    app, _ = make_app(pd_config(), engine, background)
    ex = Exchange()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: call(app, "POST", "/v1/completions", REQUEST, exchange=ex))
        await ex.started.wait()
        ex.stop_reading()
        [body] = engine.bodies
        yield app, ex, body


async def test_a_client_that_accepts_nothing_holds_decode_load_no_longer_than_the_takeover(
    background: trio.Nursery, mock_clock: trio.testing.MockClock
) -> None:
    """The request's task sends each event itself; once one send has been under way for
    ``TAKEOVER_AFTER`` a reader of its own drains the engine, so its EOF releases decode load
    while the client still reads nothing, and the client later gets every byte."""
    async with a_stream_nobody_reads(background) as (app, ex, body):
        for _ in range(4):
            body.push(EVENT)
        body.push(DONE)
        body.end()
        await trio.testing.wait_all_tasks_blocked()
        assert not body.read_to_end  # the first event's send is under way and blocks
        mock_clock.jump(1.5 * TAKEOVER_AFTER)
        await trio.testing.wait_all_tasks_blocked()
        read, load, complete = body.read_to_end, total_load(app), ex.complete
        held = app.metrics.registry.get_sample_value("trio_pdrouter_buffered_bytes")
        ex.resume_reading()  # before any assert: a client that never reads again hangs the test
    assert read and load == 0 and not complete
    assert held == 4 * len(EVENT) + len(DONE)  # the event under way and the queue behind it
    assert bytes(ex.body) == 4 * EVENT + DONE and ex.complete
    assert app.metrics.registry.get_sample_value("trio_pdrouter_buffered_bytes") == 0


async def test_a_shutdown_while_a_send_holds_the_request_closes_the_engine_at_once(
    background: trio.Nursery, mock_clock: trio.testing.MockClock
) -> None:
    """No time passes, so no sweep runs: ``Request.on_cancel`` hands the answer to a reader
    whose cancellation closes the engine's response and releases decode load right away."""
    async with a_stream_nobody_reads(background) as (app, ex, body):
        body.push(EVENT)
        await trio.testing.wait_all_tasks_blocked()
        held = (body.closed, total_load(app))
        ended = app.proxy.shut_down()
        await trio.testing.wait_all_tasks_blocked()
        closed, load = body.closed, total_load(app)
        ex.resume_reading()  # before any assert: a client that never reads again hangs the test
    assert held == (False, 1) and ended == 1
    assert closed and load == 0
    assert b"shutting down" in bytes(ex.body) and bytes(ex.body).endswith(DONE)


async def test_the_historic_bug_switch_releases_decode_at_headers(background: trio.Nursery) -> None:
    """The test-only switch reproduces the bug, so the assertion above can fail."""
    handler = StreamingDecode()
    bodies = handler.bodies

    app, _ = make_app(pd_config(release_decode_at_headers=True), handler, background)
    ex = Exchange()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: call(app, "POST", "/v1/completions", REQUEST, exchange=ex))
        await ex.started.wait()
        assert loads(app)["decode"]["http://decode:8200"] == 0
        bodies[0].push(DONE)
        bodies[0].end()
    assert total_load(app) == 0


@pytest.mark.parametrize("phase", ["during_prefill", "before_decode_head", "mid_stream"])
async def test_client_disconnect_closes_upstream_and_releases_everything(
    phase: str, background: trio.Nursery
) -> None:
    prefill_waiting = trio.Event()
    decode_waiting = trio.Event()
    bodies = []

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            if phase == "during_prefill":
                prefill_waiting.set()
                await trio.sleep_forever()
            return json_response(PREFILL_ANSWER)
        if phase == "before_decode_head" and not decode_waiting.is_set():
            decode_waiting.set()
            await trio.sleep_forever()
        response, body = streaming()
        bodies.append(body)
        return response

    app, _ = make_app(pd_config(), handler, background)
    ex = Exchange()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: call(app, "POST", "/v1/completions", REQUEST, exchange=ex))
        if phase == "during_prefill":
            await prefill_waiting.wait()
            assert total_load(app) == 2
        elif phase == "before_decode_head":
            await decode_waiting.wait()
            assert loads(app)["decode"]["http://decode:8200"] == 1
        else:
            await ex.started.wait()
            bodies[0].push(EVENT)
            await trio.testing.wait_all_tasks_blocked()
        ex.disconnect.set()
    if phase == "before_decode_head":
        # The decode engine had the whole request: aborted, it frees the prefill's blocks
        # itself, so nothing is reclaimed (that would be a second pull).
        await trio.testing.wait_all_tasks_blocked()
        assert bodies == []
    assert total_load(app) == 0
    assert not ex.complete, "nothing is sent to a client that left"
    if phase == "mid_stream":
        assert bodies[0].closed and not bodies[0].read_to_end


async def test_decode_failure_mid_stream_ends_with_error_event_and_done(
    background: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    handler = StreamingDecode()
    bodies = handler.bodies

    app, _ = make_app(pd_config(), handler, background)
    ex = Exchange()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            lambda: call(
                app, "POST", "/v1/completions", REQUEST, headers={"x-request-id": "r1"}, exchange=ex
            )
        )
        await ex.started.wait()
        bodies[0].push(EVENT + b'data: {"choices":[{"te')  # a partial event, then the reset
        await trio.testing.wait_all_tasks_blocked()
        bodies[0].fail(httpx.ReadError("connection reset"))
    body = bytes(ex.body)
    assert body.startswith(EVENT) and body.endswith(DONE) and ex.complete
    events = body.split(b"\n\n")
    error = orjson.loads(events[1][len(b"data: ") :])
    assert error["error"] == {
        "message": "the decode upstream dropped the connection (request id r1)",
        "type": "upstream_error",
        "param": None,
        "code": 502,
    }
    assert "connection reset" in caplog.text  # the log keeps what the client is not told
    assert total_load(app) == 0


async def test_stream_that_ends_without_done_is_reported(
    background: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        response, body = streaming()
        body.push(EVENT)
        body.end()
        return response

    app, _ = make_app(pd_config(), handler, background)
    ex = await call(app, "POST", "/v1/completions", REQUEST)
    assert bytes(ex.body).startswith(EVENT) and bytes(ex.body).endswith(DONE)
    assert b"the decode upstream gave an answer the router cannot use" in bytes(ex.body)
    assert "without [DONE]" in caplog.text
    assert total_load(app) == 0


@pytest.mark.parametrize(
    ("prefill", "status", "error_type", "attempts"),
    [
        (lambda: json_response({"error": {"message": "bad", "code": 400}}, 400), 400, None, 1),
        (lambda: json_response({"error": {"message": "boom", "code": 500}}, 500), 500, None, 5),
        (lambda: json_response({"error": {"message": "busy", "code": 503}}, 503), 503, None, 5),
        (lambda: httpx.Response(200, content=b"not json"), 502, "upstream_error", 1),
    ],
)
async def test_prefill_answers_are_mapped(  # type: ignore[no-untyped-def]
    prefill,
    status: int,
    error_type: str | None,
    attempts: int,
    autojump_clock: trio.testing.MockClock,
    background: trio.Nursery,
) -> None:
    """4xx passes through at once; 5xx is retried (5 attempts by default), then passed through
    too (as vllm-router does); an answer the router cannot use is a 502."""

    async def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.host == "prefill", "decode must not run after a failed prefill"
        return prefill()

    app, upstream = make_app(pd_config(), handler, background)
    ex = await call(app, "POST", "/v1/completions", REQUEST)
    assert ex.status == status
    body = ex.json()
    if error_type is None:
        message = body["error"]["message"]
        assert body == {"error": {"message": message, "code": status}}  # passed through unchanged
    else:
        assert body["error"]["type"] == error_type and body["error"]["code"] == status
    assert len(upstream.requests) == attempts
    assert total_load(app) == 0


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (httpx.ConnectError("refused"), 502),
        (httpx.ConnectTimeout("slow"), 504),
        (httpx.RemoteProtocolError("garbage"), 502),
    ],
)
async def test_prefill_transport_errors(
    exc: Exception,
    status: int,
    autojump_clock: trio.testing.MockClock,
    background: trio.Nursery,
) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        raise exc

    app, _ = make_app(pd_config(), handler, background)
    ex = await call(
        app, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
    )
    assert ex.status == status
    assert ex.json()["error"]["code"] == status
    assert total_load(app) == 0


async def test_prefill_timeout_is_504(
    autojump_clock: trio.testing.MockClock, background: trio.Nursery
) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        await trio.sleep_forever()
        raise AssertionError

    config = pd_config()
    import attrs

    from trio_pdrouter.config import Timeouts

    app, _ = make_app(attrs.evolve(config, timeouts=Timeouts(request=5.0)), handler, background)
    ex = await call(app, "POST", "/v1/completions", {"prompt": "x"})
    assert ex.status == 504
    assert total_load(app) == 0


async def test_decode_4xx_before_streaming_is_passed_through(background: trio.Nursery) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        return json_response({"error": {"message": "too long", "code": 400}}, 400)

    app, _ = make_app(pd_config(), handler, background)
    ex = await call(app, "POST", "/v1/completions", REQUEST)
    assert ex.status == 400 and ex.json()["error"]["message"] == "too long"
    assert total_load(app) == 0


async def test_prefill_stop_token_sends_decode_without_params(background: trio.Nursery) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response({**PREFILL_ANSWER, "kv_transfer_params": None})
        return json_response({"choices": [{"text": "done"}]})

    app, upstream = make_app(pd_config(), handler, background)
    ex = await call(app, "POST", "/v1/completions", {"prompt": "x"})
    assert ex.status == 200 and ex.json() == {"choices": [{"text": "done"}]}
    assert "kv_transfer_params" not in upstream.json_of(1)


async def test_non_streaming_merges_prompt_logprobs_from_prefill(background: trio.Nursery) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(
                {
                    **PREFILL_ANSWER,
                    "prompt_logprobs": [None, {"5": -1.5}],
                    "usage": {"prompt_tokens_details": {"cached_tokens": 4}},
                }
            )
        return json_response(
            {"choices": [{"text": "ok"}], "prompt_logprobs": None, "usage": {"prompt_tokens": 2}}
        )

    app, _ = make_app(pd_config(), handler, background)
    ex = await call(app, "POST", "/v1/completions", {"prompt": "x", "prompt_logprobs": 1})
    body = ex.json()
    assert body["prompt_logprobs"] == [None, {"5": -1.5}]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 4
    assert total_load(app) == 0


async def test_non_streaming_disconnect_while_decode_is_buffering(background: trio.Nursery) -> None:
    decode_waiting = trio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        if decode_waiting.is_set():  # the stranded-KV reclaim: its first event ends it
            response, body = streaming()
            body.push(EVENT)
            return response
        decode_waiting.set()
        await trio.sleep_forever()
        raise AssertionError

    app, _ = make_app(pd_config(), handler, background)
    ex = Exchange()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            lambda: call(
                app,
                "POST",
                "/v1/completions",
                {"prompt": "x", "echo": True, "logprobs": 1},
                exchange=ex,
            )
        )
        await decode_waiting.wait()
        assert loads(app)["decode"]["http://decode:8200"] == 1
        ex.disconnect.set()
    await trio.testing.wait_all_tasks_blocked()
    assert total_load(app) == 0


async def test_regular_mode_relays_one_leg(background: trio.Nursery) -> None:
    from trio_pdrouter.config import RouterConfig

    async def handler(request: httpx.Request) -> httpx.Response:
        response, body = streaming()
        body.push(EVENT + DONE)
        body.end()
        return response

    config = RouterConfig(worker_urls=("http://w:1",), policy="round_robin")
    app, upstream = make_app(config, handler, background)
    ex = await call(app, "POST", "/v1/completions", REQUEST)
    assert bytes(ex.body) == EVENT + DONE
    assert upstream.json_of(0) == REQUEST, "regular mode sends the body unchanged"
    assert loads(app) == {"regular": {"http://w:1": 0}}


async def test_dp_ranks_are_separate_endpoints_with_the_rank_header(
    background: trio.Nursery,
) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        return json_response({"choices": []})

    app, upstream = make_app(pd_config(dp_size=2), handler, background)
    for _ in range(4):
        await call(app, "POST", "/v1/completions", {"prompt": "x"})
    ranks = [r.headers["x-data-parallel-rank"] for r in upstream.requests]
    assert sorted(ranks) == ["0", "0", "0", "0", "1", "1", "1", "1"]
    assert set(loads(app)["decode"]) == {"http://decode:8200@0", "http://decode:8200@1"}

"""The legs and the prefill's KV: the prefill leg when its client leaves (stop sending, read an
answer already on its way for ``--prefill-answer-grace-secs``, reclaim its blocks); a decode leg
owns the blocks once its request is written; retries reuse them only while they are held."""

from __future__ import annotations

import httpx
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
)
from trio_pdrouter.config import RetrySettings, Timeouts
from trio_pdrouter.transport import SEND_SIDE, SendSide


def decode_reclaim() -> httpx.Response:
    response, body = streaming()
    body.push(EVENT)
    return response


@pytest.mark.parametrize("answers", [True, False])
async def test_a_client_leaving_during_prefill_stops_the_send_and_reads_for_the_grace(
    answers: bool, autojump_clock: trio.testing.MockClock, background: trio.Nursery
) -> None:
    """The engine sees the client go at once (a half-close); an answer that still comes within
    the grace is read and its blocks reclaimed; none, and the leg ends with the grace."""
    sides: list[SendSide] = []
    release = trio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            sides.append(request.extensions[SEND_SIDE])
            await release.wait()  # the prefill finishes only when the test says
            return json_response(PREFILL_ANSWER)
        return decode_reclaim()

    config = pd_config(timeouts=Timeouts(prefill_grace=2.0))
    app, upstream = make_app(config, handler, background)
    ex = Exchange()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: call(app, "POST", "/v1/completions", REQUEST, exchange=ex))
        await trio.testing.wait_all_tasks_blocked()
        assert len(sides) == 1 and not sides[0].closed
        ex.leave()
        await trio.testing.wait_all_tasks_blocked()
        assert sides[0].closed, "the prefill engine is told at once"
        assert loads(app)["prefill"] == {"http://prefill:8100": 1}, "the leg still reads"
        if answers:
            await trio.sleep(1.5)  # within the grace
            release.set()
        else:
            await trio.sleep(2.5)  # past it
            assert loads(app)["prefill"] == {"http://prefill:8100": 0}
            release.set()
    await trio.testing.wait_all_tasks_blocked()
    hosts = [r.url.host for r in upstream.requests]
    if answers:
        assert hosts == ["prefill", "decode"], "the late answer's blocks are reclaimed"
        reclaim = upstream.json_of(1)
        assert reclaim["kv_transfer_params"] == KV and reclaim["max_tokens"] == 1
    else:
        assert hosts == ["prefill"], "no answer within the grace: nothing to reclaim"
    assert app.metrics.late_prefill_answers._value.get() == (1 if answers else 0)
    assert loads(app)["prefill"] == {"http://prefill:8100": 0}
    assert loads(app)["decode"] == {"http://decode:8200": 0}


async def test_no_grace_closes_the_prefill_at_once(background: trio.Nursery) -> None:
    released = trio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        try:
            await trio.sleep_forever()
        finally:
            released.set()

    app, upstream = make_app(pd_config(timeouts=Timeouts(prefill_grace=0)), handler, background)
    ex = Exchange()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: call(app, "POST", "/v1/completions", REQUEST, exchange=ex))
        await trio.testing.wait_all_tasks_blocked()
        ex.leave()
        await released.wait()
    assert [r.url.host for r in upstream.requests] == ["prefill"]
    assert loads(app)["prefill"] == {"http://prefill:8100": 0}


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("written", [True, False])
async def test_a_decode_owns_the_kv_once_the_engine_has_the_whole_request(
    written: bool, stream: bool, background: trio.Nursery
) -> None:
    """Reset after the request was written: decode has it, and vLLM frees the blocks itself.
    Failed before it was all written: the engine never had it, so the router reclaims."""
    decodes = 0

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal decodes
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        decodes += 1
        if decodes == 1:
            request.extensions[SEND_SIDE].written = written
            raise httpx.ReadError("reset", request=request)
        return decode_reclaim()

    body = {"model": "m", "prompt": "hello there", "max_tokens": 8, "stream": stream}
    config = pd_config(retry=RetrySettings(max_retries=1))
    app, upstream = make_app(config, handler, background)
    ex = await call(app, "POST", "/v1/completions", body)
    assert ex.status == 502
    await trio.testing.wait_all_tasks_blocked()
    hosts = [r.url.host for r in upstream.requests]
    assert hosts == (["prefill", "decode"] if written else ["prefill", "decode", "decode"])
    assert loads(app)["decode"] == {"http://decode:8200": 0}


@pytest.mark.parametrize("decode_takes", [0.1, 3.0])
async def test_a_decode_retry_reuses_the_kv_only_while_the_prefill_holds_it(
    decode_takes: float, autojump_clock: trio.testing.MockClock, background: trio.Nursery
) -> None:
    """Past ``--prefill-kv-hold-secs`` the engine has let the blocks go: reading them would be
    a second pull, so the retry runs a fresh prefill (and nothing is reclaimed)."""
    decodes = 0

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal decodes
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        decodes += 1
        if decodes == 1:
            await trio.sleep(decode_takes)
            return json_response({"error": {"message": "busy", "code": 503}}, 503)
        response, body = streaming()
        body.push(EVENT)
        body.push(b"data: [DONE]\n\n")
        body.end()
        return response

    config = pd_config(
        retry=RetrySettings(max_retries=2, initial_backoff_ms=0),
        timeouts=Timeouts(prefill_kv_hold=2.0),
    )
    app, upstream = make_app(config, handler, background)
    ex = await call(app, "POST", "/v1/completions", REQUEST)
    assert ex.status == 200
    hosts = [r.url.host for r in upstream.requests]
    if decode_takes < 2.0:
        assert hosts == ["prefill", "decode", "decode"], "the same KV, on the retry"
    else:
        assert hosts == ["prefill", "decode", "prefill", "decode"], "a fresh prefill"
    assert loads(app)["decode"] == {"http://decode:8200": 0}


async def test_a_reclaim_answered_with_an_error_is_counted(background: trio.Nursery) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        return json_response({"error": {"message": "no", "code": 503}}, 503)

    app, upstream = make_app(pd_config(retry=RetrySettings(max_retries=1)), handler, background)
    ex = await call(app, "POST", "/v1/completions", REQUEST)
    assert ex.status == 503
    await trio.testing.wait_all_tasks_blocked()
    assert [r.url.host for r in upstream.requests] == ["prefill", "decode", "decode"]
    refused = app.metrics.stranded_kv_refused.labels("http://decode:8200")._value.get()
    assert refused == 1
    assert loads(app)["decode"] == {"http://decode:8200": 0}

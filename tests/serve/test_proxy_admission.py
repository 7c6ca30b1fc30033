"""--max-concurrent-requests holds for the whole response; the queue behind it is FIFO."""

from __future__ import annotations

import trio
import trio.testing

from tests.harness import (
    EVENT,
    REQUEST,
    Exchange,
    StreamingDecode,
    call,
    make_app,
    pd_config,
    total_load,
)
from trio_pdrouter.config import AdmissionSettings
from trio_pdrouter.http import DONE


def app_with_cap(background: trio.Nursery, cap: int, queue: int, timeout: float = 60.0):  # type: ignore[no-untyped-def]
    handler = StreamingDecode()
    bodies = handler.bodies
    admission = AdmissionSettings(
        max_concurrent_requests=cap, queue_size=queue, queue_timeout_secs=timeout
    )
    app, upstream = make_app(pd_config(admission=admission), handler, background)
    return app, upstream, bodies


async def test_a_stream_holds_its_slot_until_its_end_then_the_queue_moves(
    background: trio.Nursery,
) -> None:
    app, upstream, bodies = app_with_cap(background, cap=1, queue=1)
    first, second = Exchange(), Exchange()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: call(app, "POST", "/v1/completions", REQUEST, exchange=first))
        await first.started.wait()
        nursery.start_soon(lambda: call(app, "POST", "/v1/completions", REQUEST, exchange=second))
        await trio.testing.wait_all_tasks_blocked()
        assert len(upstream.requests) == 2, "the second request waits, unsent"
        third = await call(app, "POST", "/v1/completions", REQUEST)
        assert third.status == 429 and third.json()["error"]["type"] == "rate_limit_error"
        bodies[0].push(EVENT + DONE)
        bodies[0].end()
        await second.started.wait()
        bodies[1].push(DONE)
        bodies[1].end()
    assert first.complete and second.complete
    assert total_load(app) == 0


async def test_queue_timeout_is_408(
    autojump_clock: trio.testing.MockClock, background: trio.Nursery
) -> None:
    app, _, bodies = app_with_cap(background, cap=1, queue=4, timeout=3.0)
    first = Exchange()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: call(app, "POST", "/v1/completions", REQUEST, exchange=first))
        await first.started.wait()
        waited = await call(app, "POST", "/v1/completions", REQUEST)
        assert waited.status == 408 and waited.json()["error"]["type"] == "timeout_error"
        bodies[0].push(DONE)
        bodies[0].end()
    assert total_load(app) == 0


async def test_a_client_leaving_the_queue_frees_its_place(background: trio.Nursery) -> None:
    app, _, bodies = app_with_cap(background, cap=1, queue=1)
    first, quitter = Exchange(), Exchange()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: call(app, "POST", "/v1/completions", REQUEST, exchange=first))
        await first.started.wait()
        nursery.start_soon(lambda: call(app, "POST", "/v1/completions", REQUEST, exchange=quitter))
        await trio.testing.wait_all_tasks_blocked()
        quitter.disconnect.set()
        await quitter.finished.wait()
        # Its queue place is free again: another request may wait there instead of a 429.
        waiting = Exchange()
        nursery.start_soon(lambda: call(app, "POST", "/v1/completions", REQUEST, exchange=waiting))
        await trio.testing.wait_all_tasks_blocked()
        assert not waiting.finished.is_set()
        bodies[0].push(DONE)
        bodies[0].end()
        await waiting.started.wait()
        bodies[1].push(DONE)
        bodies[1].end()
    assert waiting.status == 200 and not quitter.complete
    assert total_load(app) == 0

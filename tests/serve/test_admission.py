"""Admission: the concurrency cap, its FIFO queue, 429/408 refusals, and exact slot release."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trio_pdrouter.config import AdmissionSettings
from trio_pdrouter.serve import (
    QUEUE_FULL,
    QUEUE_TIMEOUT,
    RATE_LIMITED,
    Admission,
    Rejected,
)


def admission(limit: int = 1, queue: int = 10, timeout: float = 60.0) -> Admission:
    return Admission(AdmissionSettings(limit, queue, timeout))


async def hold(adm: Admission, release: trio.Event, admitted: list[str], name: str) -> None:
    async with adm.slot():
        admitted.append(name)
        await release.wait()


async def test_slots_up_to_the_limit_are_granted_at_once() -> None:
    adm = admission(limit=2)
    async with adm.slot(), adm.slot():
        assert adm.in_flight == 2
        assert adm.queued == 0
    assert adm.in_flight == 0


async def test_waiters_are_admitted_in_arrival_order() -> None:
    adm = admission(limit=1)
    admitted: list[str] = []
    releases = {name: trio.Event() for name in "xabc"}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, adm, releases["x"], admitted, "x")
        await trio.testing.wait_all_tasks_blocked()
        # Arrival order a, b, c, while x holds the only slot.
        for name in "abc":
            nursery.start_soon(hold, adm, releases[name], admitted, name)
            await trio.testing.wait_all_tasks_blocked()
        assert (adm.in_flight, adm.queued) == (1, 3)
        # Release in an order unrelated to arrival; the queue still decides who goes next.
        for done in "xcba":
            if done == "c":
                # c is still queued; releasing its event must not let it in.
                releases["c"].set()
                await trio.testing.wait_all_tasks_blocked()
                continue
            releases[done].set()
            await trio.testing.wait_all_tasks_blocked()
    assert admitted == ["x", "a", "b", "c"]
    assert (adm.in_flight, adm.queued) == (0, 0)


async def test_a_newcomer_does_not_overtake_a_waiter_handed_a_slot() -> None:
    adm = admission(limit=1)
    holder = adm.slot()
    await holder.__aenter__()
    admitted: list[str] = []
    release = trio.Event()
    release.set()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, adm, release, admitted, "waiter")
        await trio.testing.wait_all_tasks_blocked()
        # The slot goes to the waiter; the newcomer, arriving in the same instant, must queue.
        await holder.__aexit__(None, None, None)
        assert (adm.in_flight, adm.queued) == (1, 0)
        nursery.start_soon(hold, adm, release, admitted, "newcomer")
    assert admitted == ["waiter", "newcomer"]
    assert adm.in_flight == 0


async def test_full_queue_is_refused_with_429() -> None:
    adm = admission(limit=1, queue=1)
    release = trio.Event()
    admitted: list[str] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, adm, release, admitted, "x")
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(hold, adm, release, admitted, "queued")
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(Rejected) as info:
            async with adm.slot():
                pytest.fail("admitted past a full queue")
        assert info.value.error.status == 429
        assert info.value.error.type == "rate_limit_error"
        assert adm.rejections == {QUEUE_FULL: 1, QUEUE_TIMEOUT: 0, RATE_LIMITED: 0}
        assert (adm.in_flight, adm.queued) == (1, 1)
        release.set()
    assert admitted == ["x", "queued"]
    assert adm.in_flight == 0


async def test_queue_size_zero_refuses_at_once_when_full() -> None:
    adm = admission(limit=1, queue=0)
    async with adm.slot():
        with pytest.raises(Rejected) as info:
            async with adm.slot():
                pytest.fail("admitted past the limit")
        assert info.value.error.status == 429
        assert adm.queued == 0
    assert adm.in_flight == 0
    async with adm.slot():  # a free slot is still granted
        assert adm.in_flight == 1


async def test_queue_timeout_is_refused_with_408(autojump_clock: trio.testing.MockClock) -> None:
    adm = admission(limit=1, timeout=5.0)
    async with adm.slot():
        start = trio.current_time()
        with pytest.raises(Rejected) as info:
            async with adm.slot():
                pytest.fail("admitted past the limit")
        assert trio.current_time() - start == pytest.approx(5.0)
        assert info.value.error.status == 408
        assert adm.rejections == {QUEUE_FULL: 0, QUEUE_TIMEOUT: 1, RATE_LIMITED: 0}
        assert (adm.in_flight, adm.queued) == (1, 0)
    assert adm.in_flight == 0


async def test_waiter_admitted_before_its_timeout_keeps_its_slot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    adm = admission(limit=1, timeout=5.0)
    admitted: list[str] = []
    release = trio.Event()
    release.set()

    async def holder() -> None:
        async with adm.slot():
            await trio.sleep(4.0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(holder)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(hold, adm, release, admitted, "waiter")
    assert admitted == ["waiter"]
    assert adm.rejections[QUEUE_TIMEOUT] == 0
    assert adm.in_flight == 0


async def test_cancelled_waiter_leaves_the_queue_without_a_slot() -> None:
    adm = admission(limit=1)
    admitted: list[str] = []
    release = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, adm, release, admitted, "x")
        await trio.testing.wait_all_tasks_blocked()
        with trio.CancelScope() as gone:
            nursery.start_soon(_cancel_when_blocked, gone)
            async with adm.slot():
                pytest.fail("admitted while the slot was held")
        assert gone.cancelled_caught
        assert (adm.in_flight, adm.queued) == (1, 0)
        release.set()
    assert admitted == ["x"]
    assert adm.in_flight == 0


async def _cancel_when_blocked(scope: trio.CancelScope) -> None:
    await trio.testing.wait_all_tasks_blocked()
    scope.cancel()


async def test_slot_handed_to_a_waiter_cancelled_in_the_same_instant_passes_on() -> None:
    adm = admission(limit=1)
    holder = adm.slot()
    await holder.__aenter__()
    admitted: list[str] = []
    release = trio.Event()

    async def doomed(task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            async with adm.slot():
                admitted.append("doomed")

    async with trio.open_nursery() as nursery:
        scope: trio.CancelScope = await nursery.start(doomed)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(hold, adm, release, admitted, "next")
        await trio.testing.wait_all_tasks_blocked()
        assert adm.queued == 2
        # No checkpoint between these two: "doomed" is cancelled while queued, and is handed
        # the slot before it can resume and leave the queue.
        scope.cancel()
        await holder.__aexit__(None, None, None)
        await trio.testing.wait_all_tasks_blocked()
        assert admitted == ["next"]
        assert (adm.in_flight, adm.queued) == (1, 0)
        release.set()
    assert adm.in_flight == 0


async def test_slot_is_released_once_when_the_block_raises() -> None:
    adm = admission(limit=2)
    slot = adm.slot()
    with pytest.raises(RuntimeError):
        async with slot:
            raise RuntimeError("boom")
    assert adm.in_flight == 0
    await slot.__aexit__(None, None, None)  # a second exit releases nothing
    assert adm.in_flight == 0


async def test_slot_is_released_when_the_block_is_cancelled() -> None:
    adm = admission(limit=1)
    with trio.CancelScope() as scope:
        async with adm.slot():
            scope.cancel()
            await trio.sleep_forever()
    assert adm.in_flight == 0

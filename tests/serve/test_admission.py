"""Admission: the concurrency cap, its queue (priority, aging, arrival), 429/408 refusals, and exact
slot release."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trio_pdrouter.config import AdmissionSettings
from trio_pdrouter.serve import (
    QUEUE_FULL,
    QUEUE_TIMEOUT,
    REASONS,
    Admission,
    Rejected,
)


def admission(
    limit: int = 1, queue: int = 10, timeout: float = 60.0, aging: float = 1.0
) -> Admission:
    return Admission(AdmissionSettings(limit, queue, timeout, priority_aging_secs=aging))


async def hold(
    adm: Admission, release: trio.Event, admitted: list[str], name: str, priority: int = 0
) -> None:
    async with adm.slot(priority):
        admitted.append(name)
        await release.wait()


async def _queue_then_drain(
    adm: Admission, arrivals: list[tuple[str, int]], between: float = 0.0
) -> list[str]:
    """One holder, then ``arrivals`` (name, priority) queue ``between`` seconds apart; each
    admitted request leaves at once. The order they were admitted in."""
    admitted: list[str] = []
    release = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, adm, release, admitted, "holder")
        await trio.testing.wait_all_tasks_blocked()
        done = trio.Event()
        done.set()
        for name, priority in arrivals:
            await trio.sleep(between)
            nursery.start_soon(hold, adm, done, admitted, name, priority)
            await trio.testing.wait_all_tasks_blocked()
        assert adm.queued == len(arrivals)
        release.set()
    assert (adm.in_flight, adm.queued) == (0, 0)
    return admitted[1:]


async def test_the_lowest_priority_goes_first_then_arrival_order() -> None:
    adm = admission(aging=0)
    order = await _queue_then_drain(adm, [("a", 0), ("b", 5), ("c", -10), ("d", 0), ("e", -10)])
    assert order == ["c", "e", "a", "d", "b"]


async def test_waiting_ages_a_request_so_it_is_not_overtaken_forever(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # b (priority 5) has waited 10 s when c (priority 0) comes: at 1 s per level it is sooner.
    aged = await _queue_then_drain(admission(aging=1.0), [("b", 5), ("c", 0)], between=10.0)
    assert aged == ["b", "c"]
    unaged = await _queue_then_drain(admission(aging=0), [("b", 5), ("c", 0)], between=10.0)
    assert unaged == ["c", "b"]


async def test_a_waiter_that_left_is_skipped_and_not_counted() -> None:
    adm = admission(limit=1)
    admitted: list[str] = []
    release, never = trio.Event(), trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, adm, release, admitted, "x")
        await trio.testing.wait_all_tasks_blocked()
        with trio.CancelScope() as leaving:
            async with trio.open_nursery() as inner:
                inner.start_soon(hold, adm, never, admitted, "gone", -5)
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(hold, adm, release, admitted, "next", 0)
                await trio.testing.wait_all_tasks_blocked()
                assert adm.queued == 2
                leaving.cancel()
        assert adm.queued == 1
        release.set()
    assert admitted == ["x", "next"] and (adm.in_flight, adm.queued) == (0, 0)


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
        assert adm.rejections == {**dict.fromkeys(REASONS, 0), QUEUE_FULL: 1}
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
        assert adm.rejections == {**dict.fromkeys(REASONS, 0), QUEUE_TIMEOUT: 1}
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

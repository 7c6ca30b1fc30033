"""Health checks: thresholds and timing on a virtual clock, runtime URLs, and one real simulator."""

from __future__ import annotations

import math
from pathlib import Path

import attrs
import httpx
import trio
import trio.testing

from trio_pdrouter.config import HealthSettings
from trio_pdrouter.endpoints import Endpoint, Role
from trio_pdrouter.fleet import HealthBoard, MachineVerdicts
from trio_pdrouter.machine import MachineTable
from trio_pdrouter_sim.config import SimConfig
from trio_pdrouter_sim.server import SimServer

URL = "http://decode:8200"
OTHER = "http://decode:8300"
SETTINGS = HealthSettings(
    endpoint="/health",
    interval_secs=10.0,
    timeout_secs=2.0,
    failure_threshold=3,
    success_threshold=2,
)

#: A probe's scripted outcome: an HTTP status, "refuse" (connection refused) or "hang".
Outcome = int | str


@attrs.define
class Upstream:
    """Answers probes from a script per URL (the last outcome repeats); records every probe."""

    script: dict[str, list[Outcome]]
    probes: list[tuple[float, str]] = attrs.Factory(list)

    async def handler(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        self.probes.append((trio.current_time(), str(request.url)))
        outcomes = self.script[base]
        outcome = outcomes.pop(0) if len(outcomes) > 1 else outcomes[0]
        if outcome == "refuse":
            raise httpx.ConnectError("connection refused", request=request)
        if outcome == "hang":
            await trio.sleep_forever()
        if outcome == "bug":  # not an httpx.HTTPError: what an odd URL made httpx raise
            raise httpx.InvalidURL("scripted: invalid URL")
        assert isinstance(outcome, int)
        return httpx.Response(outcome, json={})

    def probe_times(self, url: str) -> list[float]:
        return [t for t, u in self.probes if u.startswith(url)]


@attrs.define
class Changes:
    """on_change calls with their virtual times; ``next()`` waits for the next one."""

    seen: list[tuple[str, bool, float]] = attrs.Factory(list)
    _send: trio.MemorySendChannel[tuple[str, bool, float]] | None = None
    _receive: trio.MemoryReceiveChannel[tuple[str, bool, float]] | None = None

    def __attrs_post_init__(self) -> None:
        self._send, self._receive = trio.open_memory_channel(math.inf)

    def __call__(self, url: str, healthy: bool) -> None:
        change = (url, healthy, trio.current_time())
        self.seen.append(change)
        assert self._send is not None
        self._send.send_nowait(change)

    async def next(self) -> tuple[str, bool, float]:
        assert self._receive is not None
        return await self._receive.receive()


@attrs.define
class Rig:
    board: HealthBoard
    upstream: Upstream
    changes: Changes


def ep(url: str = URL, rank: int | None = None) -> Endpoint:
    return Endpoint(url, Role.DECODE, rank)


async def start(
    nursery: trio.Nursery,
    script: dict[str, list[Outcome]],
    settings: HealthSettings = SETTINGS,
    urls: tuple[str, ...] = (URL,),
) -> Rig:
    upstream = Upstream(script)
    changes = Changes()
    board = HealthBoard(settings, urls, on_change=changes)
    client = httpx.AsyncClient(transport=httpx.MockTransport(upstream.handler))
    await nursery.start(board.run, client)
    return Rig(board, upstream, changes)


async def test_startup_urls_are_healthy_before_any_probe() -> None:
    board = HealthBoard(SETTINGS, [URL])
    assert board.is_healthy(ep())
    assert board.health(URL) == "healthy"
    assert not board.is_healthy(ep(OTHER))
    assert board.health(OTHER) is None


async def test_probes_are_gets_of_the_health_path_every_interval(
    autojump_clock: trio.testing.MockClock,
) -> None:
    settings = attrs.evolve(SETTINGS, endpoint="/ping")
    async with trio.open_nursery() as nursery:
        rig = await start(nursery, {URL: [200]}, settings)
        await trio.sleep(35.0)
        nursery.cancel_scope.cancel()
    assert [u for _, u in rig.upstream.probes] == [URL + "/ping"] * 4
    assert rig.upstream.probe_times(URL) == [0.0, 10.0, 20.0, 30.0]
    assert rig.changes.seen == []


async def test_consecutive_failures_make_every_rank_unhealthy(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with trio.open_nursery() as nursery:
        rig = await start(nursery, {URL: [503]})
        assert await rig.changes.next() == (URL, False, 20.0)  # third failure, at 0, 10, 20
        assert not rig.board.is_healthy(ep(URL, 0))
        assert not rig.board.is_healthy(ep(URL, 1))
        assert rig.board.health(URL) == "unhealthy"
        nursery.cancel_scope.cancel()


async def test_a_success_breaks_a_failure_streak(autojump_clock: trio.testing.MockClock) -> None:
    async with trio.open_nursery() as nursery:
        rig = await start(nursery, {URL: [500, "refuse", 200, 500, 500, 200]})
        await trio.sleep(100.0)
        nursery.cancel_scope.cancel()
    assert rig.changes.seen == []
    assert rig.board.is_healthy(ep())


async def test_unhealthy_recovers_after_consecutive_successes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    script: list[Outcome] = ["refuse", "refuse", "refuse", 200, 500, 200, 200]
    async with trio.open_nursery() as nursery:
        rig = await start(nursery, {URL: script})
        assert await rig.changes.next() == (URL, False, 20.0)
        # 30: success, 40: failure resets the count, 50 and 60: two successes.
        assert await rig.changes.next() == (URL, True, 60.0)
        assert rig.board.is_healthy(ep())
        nursery.cancel_scope.cancel()


async def test_a_hanging_probe_fails_at_its_timeout(autojump_clock: trio.testing.MockClock) -> None:
    settings = attrs.evolve(SETTINGS, failure_threshold=1)
    async with trio.open_nursery() as nursery:
        rig = await start(nursery, {URL: ["hang"]}, settings)
        assert await rig.changes.next() == (URL, False, settings.timeout_secs)
        await trio.sleep(11.0)
        nursery.cancel_scope.cancel()
    # The next probe starts one interval after the timed-out one ended.
    assert rig.upstream.probe_times(URL)[:2] == [0.0, 12.0]


async def test_urls_are_probed_independently(autojump_clock: trio.testing.MockClock) -> None:
    async with trio.open_nursery() as nursery:
        rig = await start(nursery, {URL: [200], OTHER: [500]}, urls=(URL, OTHER))
        assert await rig.changes.next() == (OTHER, False, 20.0)
        assert rig.board.is_healthy(ep(URL))
        assert not rig.board.is_healthy(ep(OTHER))
        nursery.cancel_scope.cancel()


async def test_added_url_is_pending_until_its_first_success(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with trio.open_nursery() as nursery:
        rig = await start(nursery, {URL: [200], OTHER: ["refuse", 500, 200]})
        await trio.sleep(5.0)
        rig.board.add_url(OTHER)
        assert rig.board.health(OTHER) == "pending"
        assert not rig.board.is_healthy(ep(OTHER))
        # Probed at once (t=5), then at 15 and 25; failures keep it pending, one success admits it.
        assert await rig.changes.next() == (OTHER, True, 25.0)
        assert rig.upstream.probe_times(OTHER) == [5.0, 15.0, 25.0]
        assert rig.board.is_healthy(ep(OTHER, 3))
        nursery.cancel_scope.cancel()


async def test_added_url_is_probed_at_once(autojump_clock: trio.testing.MockClock) -> None:
    async with trio.open_nursery() as nursery:
        rig = await start(nursery, {URL: [200], OTHER: [200]})
        await trio.sleep(3.0)
        rig.board.add_url(OTHER)
        assert await rig.changes.next() == (OTHER, True, 3.0)
        nursery.cancel_scope.cancel()


async def test_url_added_before_run_is_probed_when_it_starts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    upstream = Upstream({OTHER: [200]})
    changes = Changes()
    board = HealthBoard(SETTINGS, on_change=changes)
    board.add_url(OTHER)
    assert not board.is_healthy(ep(OTHER))
    client = httpx.AsyncClient(transport=httpx.MockTransport(upstream.handler))
    async with trio.open_nursery() as nursery:
        await nursery.start(board.run, client)
        assert await changes.next() == (OTHER, True, 0.0)
        nursery.cancel_scope.cancel()


async def test_adding_a_known_url_keeps_its_state(autojump_clock: trio.testing.MockClock) -> None:
    async with trio.open_nursery() as nursery:
        rig = await start(nursery, {URL: [200]})
        rig.board.add_url(URL)
        assert rig.board.is_healthy(ep())
        await trio.sleep(15.0)
        nursery.cancel_scope.cancel()
    assert rig.upstream.probe_times(URL) == [0.0, 10.0]  # one probe loop, not two


async def test_removed_url_is_no_longer_probed_nor_admitted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with trio.open_nursery() as nursery:
        rig = await start(nursery, {URL: ["hang"]})
        await trio.testing.wait_all_tasks_blocked()
        rig.board.remove_url(URL)  # cancels the probe in flight too
        assert not rig.board.is_healthy(ep())
        assert rig.board.urls == []
        await trio.sleep(100.0)
        nursery.cancel_scope.cancel()
    assert rig.upstream.probe_times(URL) == [0.0]
    assert rig.changes.seen == []


async def test_url_removed_before_its_probe_started_is_never_probed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with trio.open_nursery() as nursery:
        rig = await start(nursery, {URL: [200], OTHER: [200]})
        rig.board.add_url(OTHER)
        rig.board.remove_url(OTHER)
        await trio.sleep(30.0)
        nursery.cancel_scope.cancel()
    assert rig.upstream.probe_times(OTHER) == []


async def test_health_follows_a_real_simulator_going_down_and_up() -> None:
    settings = HealthSettings(
        interval_secs=0.02, timeout_secs=2.0, failure_threshold=1, success_threshold=1
    )
    changes = Changes()
    sim = SimServer(SimConfig.fast(port=0, role="decode"))
    async with trio.open_nursery() as nursery, httpx.AsyncClient() as client:
        await nursery.start(sim.run)
        board = HealthBoard(settings, [sim.url], on_change=changes)
        await nursery.start(board.run, client)
        with trio.fail_after(10):
            sim.down()
            assert (await changes.next())[:2] == (sim.url, False)
            assert not board.is_healthy(ep(sim.url))
            sim.up()
            assert (await changes.next())[:2] == (sim.url, True)
            assert board.is_healthy(ep(sim.url))
        nursery.cancel_scope.cancel()


async def test_a_probe_failing_in_an_unexpected_way_is_a_failure_not_a_crash(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rig = await start(nursery, {URL: ["bug"]})
    assert await rig.changes.next() == (URL, False, 2 * SETTINGS.interval_secs)
    assert len(rig.upstream.probe_times(URL)) == SETTINGS.failure_threshold


async def test_one_prober_per_machine_its_verdicts_reach_the_other_workers(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    table = MachineTable.create(2, str(tmp_path / "lock"), slots=8)
    view = MachineTable.attach(table.name, table.lock_path)
    try:
        async with trio.open_nursery() as nursery:
            upstream = Upstream({URL: [503, 503, 503, 200]})
            prober = HealthBoard(SETTINGS, [URL], verdicts=MachineVerdicts(table, 0))
            client = httpx.AsyncClient(transport=httpx.MockTransport(upstream.handler))
            await nursery.start(prober.run, client)
            changes = Changes()
            follower = HealthBoard(
                SETTINGS, [URL], on_change=changes, verdicts=MachineVerdicts(view, 1), publish=False
            )
            nursery.start_soon(follower.follow, 0.05)
            (url, healthy, at) = await changes.next()
            assert (url, healthy) == (URL, False) and 20.0 <= at <= 20.1  # the third failure
            assert not follower.is_healthy(ep(URL))
            (url, healthy, at) = await changes.next()
            assert (url, healthy) == (URL, True) and 40.0 <= at <= 40.1  # two successes
            nursery.cancel_scope.cancel()
        # the follower sent no probe of its own: four intervals, four probes, all the prober's
        assert len(upstream.probes) == 5
        assert table.holders() == {f"health {URL}": 2}
        prober.remove_url(URL)
        follower.remove_url(URL)
        assert table.holders() == {}  # the URL's verdict slot is free again
    finally:
        view.close()
        table.destroy()

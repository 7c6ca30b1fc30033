"""The watch loop against the fake API server: a session lists once and resumes each watch
the server ends from the last version seen; the period starts a new list; failures back off
briefly."""

from __future__ import annotations

import random

import httpx
import trio

from tests.discovery.test_reconcile import discovered, reconciler
from tests.fleet.test_servers import rig
from tests.kube_fake import FakeKube, serve_fake
from tests.pods import pod
from trio_pdrouter.config import Selector
from trio_pdrouter.discovery import BACKOFF_MAX, Credentials, PodsApi, PodWatch
from trio_pdrouter.endpoints import Role


class Seen:
    def __init__(self) -> None:
        self.lists = 0
        self.reasons: list[str] = []

    def listed(self, role: Role, pods: int, pages: int) -> None:
        self.lists += 1

    def restarted(self, role: Role, reason: str) -> None:
        self.reasons.append(reason)

    def applied(self, role: Role, kind: str, seconds: float) -> None:
        pass


async def test_sessions_resume_watches_from_the_last_version_and_list_each_period(
    nursery: trio.Nursery,
) -> None:
    fake = FakeKube()
    await nursery.start(serve_fake, fake)
    fake.max_watch_seconds = 0.2  # the server ends every watch early
    fake.put(pod("a", "10.0.0.1", labels={"role": "d"}))
    r = rig()
    selectors = {Role.DECODE: Selector.parse(("role=d",))}
    rec, _, _ = reconciler(r.fleet, selectors)
    seen = Seen()
    api = PodsApi(httpx.AsyncClient(timeout=10), Credentials(fake.url), None)
    watch = PodWatch(api, rec, selectors, resync=1.0, observer=seen, rng=random.Random(0))
    await nursery.start(watch.run)
    assert len(discovered(r.fleet)) == 1 and seen.lists == 1
    version = fake.put(pod("b", "10.0.0.2", labels={"role": "d"}))
    with trio.fail_after(5):
        while len(discovered(r.fleet)) != 2:  # noqa: ASYNC110 - bounded poll of the fleet
            await trio.sleep(0.01)
        while seen.lists < 2:  # noqa: ASYNC110 - the period: a new list
            await trio.sleep(0.01)
    watches = [q for _, q, _ in fake.requests if q.get("watch")]
    assert len(watches) >= 3 and watches[0]["resourceVersion"] == str(version - 1)
    assert any(q["resourceVersion"] == str(version) for q in watches)
    assert seen.reasons[0] == "resync"


async def test_a_failing_api_server_is_retried_with_a_short_jittered_backoff(
    nursery: trio.Nursery,
) -> None:
    fake = FakeKube()
    await nursery.start(serve_fake, fake)
    fake.fail_lists = 4
    r = rig()
    selectors = {Role.DECODE: Selector.parse(("role=d",))}
    rec, _, _ = reconciler(r.fleet, selectors)
    seen = Seen()
    api = PodsApi(httpx.AsyncClient(timeout=10), Credentials(fake.url), None)
    watch = PodWatch(api, rec, selectors, resync=30.0, observer=seen, rng=random.Random(0))
    fake.put(pod("a", "10.0.0.1", labels={"role": "d"}))
    start = trio.current_time()
    await nursery.start(watch.run)  # started after the first try, failed or not
    with trio.fail_after(4 * BACKOFF_MAX):
        while not discovered(r.fleet):  # noqa: ASYNC110 - bounded poll of the fleet
            await trio.sleep(0.01)
    assert seen.reasons == ["ApiError"] * 4
    assert trio.current_time() - start < 0.2 + 0.4 + 0.8 + 1.6 + 1.0  # doubling from 0.1 s

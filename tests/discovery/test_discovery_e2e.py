"""Discovery end to end: the router follows pods served by the fake API server, the pods being
simulators on their own loopback addresses (127.0.0.11, 127.0.0.12, ...) on one port.

Each lifecycle has its convergence bound (:data:`CONVERGE` from the change in the API to the
routing change; a lost event: the resync period), measured by bounded polls of the router's
own state; in-flight requests on a removed pod finish, and its load leaves the ledger.
"""

from __future__ import annotations

import pathlib
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
import httpx
import pytest
import trio

from tests.kube_fake import FakeKube, serve_fake
from tests.pods import pod
from trio_pdrouter.cli import parse_config
from trio_pdrouter.endpoints import Endpoint
from trio_pdrouter.server import RunningRouter, run_router
from trio_pdrouter_sim import SimConfig
from trio_pdrouter_sim.server import SimServer

#: From a change in the API server to the routing change it makes (seconds).
CONVERGE = 1.0
#: For the steps that set a lifecycle up (not what is measured): generous, for loaded machines.
SETUP = 10.0
RESYNC = 2.0


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def kubeconfig(path: pathlib.Path, server: str) -> pathlib.Path:
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
        f"clusters: [{{name: fake, cluster: {{server: '{server}'}}}}]\n"
        "users: [{name: me, user: {token: t}}]\n"
        "contexts: [{name: fake, context: {cluster: fake, user: me}}]\n"
    )
    return path


@attrs.define
class Rig:
    fake: FakeKube
    router: RunningRouter
    client: httpx.AsyncClient
    port: int
    nursery: trio.Nursery
    sims: dict[str, SimServer] = attrs.field(factory=dict)
    withdrawn: dict[str, float] = attrs.field(factory=dict)
    charged: list[tuple[str, float]] = attrs.field(factory=list)

    async def sim(self, ip: str, **changes: Any) -> SimServer:
        base = SimConfig.fast(host=ip, port=self.port, role="both", **changes)
        server = SimServer(base)
        await self.nursery.start(server.run)
        self.sims[ip] = server
        return server

    def urls(self, routable: bool = True) -> set[str]:
        return {
            w["url"]
            for w in self.router.app.fleet.workers()
            if w["source"] == "discovery" and (w["routable"] or not routable)
        }

    async def converge(self, predicate: Callable[[], bool], bound: float = CONVERGE) -> float:
        """Seconds until ``predicate`` (of the router's state) holds; fails past ``bound``."""
        start = trio.current_time()
        with trio.fail_after(bound):
            while not predicate():  # noqa: ASYNC110 - bounded poll of the router's state
                await trio.sleep(0.005)
        return trio.current_time() - start

    async def complete(self, max_tokens: int = 3, stream: bool = False) -> httpx.Response:
        body = {"model": "sim-model", "prompt": "hi", "max_tokens": max_tokens, "stream": stream}
        return await self.client.post(self.router.url + "/v1/completions", json=body)


def url(ip: str, port: int) -> str:
    return f"http://{ip}:{port}"


@pytest.fixture
async def rig(nursery: trio.Nursery, tmp_path: pathlib.Path) -> AsyncIterator[Rig]:
    fake = FakeKube()
    await nursery.start(serve_fake, fake)
    port = free_port("127.0.0.11")
    argv = [
        "--host", "127.0.0.1", "--port", "0", "--no-prometheus-listener",
        "--service-discovery", "--selector", "app=vllm",
        "--service-discovery-port", str(port), "--service-discovery-namespace", "default",
        "--service-discovery-resync-secs", str(RESYNC), "--kubeconfig",
        str(kubeconfig(tmp_path / "config", fake.url)), "--health-check-interval-secs", "0.2",
        "--policy", "round_robin", "--graceful-timeout-secs", "30",
    ]  # fmt: skip
    router: RunningRouter = await nursery.start(run_router, parse_config(argv))
    client = httpx.AsyncClient(timeout=30)
    r = Rig(fake, router, client, port, nursery)
    fleet = router.app.fleet
    withdraw = fleet.withdraw

    def recording_withdraw(u: str) -> list[Endpoint]:
        r.withdrawn[u] = trio.current_time()
        return withdraw(u)

    fleet.withdraw = recording_withdraw  # type: ignore[method-assign]

    last: dict[Endpoint, int] = {}

    def charged(ep: Endpoint, load: int) -> None:
        if load > last.get(ep, 0):  # a charge (a release lowers it)
            r.charged.append((ep.url, trio.current_time()))
        last[ep] = load

    router.ledger.observe(charged)
    yield r
    await client.aclose()


async def test_a_ready_pod_is_routed_within_a_second_and_the_api_reports_it(rig: Rig) -> None:
    sim = await rig.sim("127.0.0.11")
    rig.fake.put(pod("w-1", "127.0.0.11", uid="u1", annotations={"vllm.ai/bootstrap-port": "1"}))
    await rig.converge(lambda: rig.urls() == {sim.url})
    resp = await rig.complete()
    assert resp.status_code == 200
    workers = (await rig.client.get(rig.router.url + "/workers")).json()["workers"]
    assert workers[0]["source"] == "discovery"
    assert workers[0]["pod"] == {"namespace": "default", "name": "w-1", "uid": "u1"}
    metrics = (await rig.client.get(rig.router.url + "/metrics")).text
    assert 'trio_pdrouter_discovery_server_changes_total{change="added",reason="ready"} 1.0' in (
        metrics
    )


def not_ready(p: dict[str, Any], fake: FakeKube) -> None:
    p["status"]["conditions"][1]["status"] = "False"
    fake.put(p)


def evicted(p: dict[str, Any], fake: FakeKube) -> None:
    p["status"]["phase"] = "Failed"
    p["status"].pop("podIP")
    p["status"].pop("podIPs")
    fake.put(p)


def relabelled(p: dict[str, Any], fake: FakeKube) -> None:
    p["metadata"]["labels"] = {"app": "retired"}
    fake.put(p)


def graceful_delete(p: dict[str, Any], fake: FakeKube) -> None:
    fake.delete("default", p["metadata"]["name"])


def force_delete(p: dict[str, Any], fake: FakeKube) -> None:
    fake.delete("default", p["metadata"]["name"], force=True)


@pytest.mark.parametrize("change", [not_ready, graceful_delete, force_delete, evicted, relabelled])
async def test_a_pod_leaving_gets_no_new_requests_within_a_second_and_in_flight_ones_finish(
    rig: Rig, change: Callable[[dict[str, Any], FakeKube], None]
) -> None:
    leaving = await rig.sim("127.0.0.11", itl_base_s=0.02)
    staying = await rig.sim("127.0.0.12")
    p = pod("w-1", "127.0.0.11")
    rig.fake.put(p)
    rig.fake.put(pod("w-2", "127.0.0.12"))
    await rig.converge(lambda: rig.urls() == {leaving.url, staying.url}, SETUP)
    # and both model lists read: until then a request for the model goes to the one known
    await rig.converge(lambda: rig.router.app.models.unknown() == [], SETUP)
    ledger = rig.router.ledger
    (ep,) = [e for e in rig.router.app.fleet.endpoints() if e.url == leaving.url]
    async with trio.open_nursery() as nursery:
        streams: list[str] = []

        async def stream() -> None:  # round robin: one of the two lands on the leaving pod
            async with rig.client.stream(
                "POST",
                rig.router.url + "/v1/completions",
                json={"model": "sim-model", "prompt": "x", "max_tokens": 40, "stream": True},
            ) as resp:
                assert resp.status_code == 200
                streams.append((await resp.aread()).decode())

        for _ in range(2):
            nursery.start_soon(stream)
        await rig.converge(lambda: ledger.load(ep) == 1, SETUP)
        await rig.converge(lambda: leaving.state.engines[0].counters.requests == 1, SETUP)
        change(p, rig.fake)
        await rig.converge(lambda: rig.urls(routable=False) == {staying.url})
        assert ledger.load(ep) == 1  # still running, still counted
        served = leaving.state.engines[0].counters.requests
        for _ in range(4):
            assert (await rig.complete()).status_code == 200
        assert leaving.state.engines[0].counters.requests == served
    assert len(streams) == 2 and all(s.rstrip().endswith("data: [DONE]") for s in streams)
    assert ledger.load(ep) == 0 and ep.key not in str(ledger.snapshot())


async def test_a_pod_deleted_while_the_watch_is_silent_goes_at_the_next_list(rig: Rig) -> None:
    await rig.sim("127.0.0.11")
    rig.fake.put(pod("w-1", "127.0.0.11"))
    await rig.converge(lambda: len(rig.urls()) == 1, SETUP)
    rig.fake.stall = True  # new watches send nothing, not even a bookmark
    rig.fake.break_watches()
    await rig.converge(lambda: rig.fake.stalled == 1, SETUP)
    rig.fake.delete("default", "w-1", force=True)
    elapsed = await rig.converge(lambda: not rig.urls(routable=False), RESYNC + CONVERGE)
    assert elapsed > 0.1  # the delete itself was never delivered: the list found it gone


def watches(fake: FakeKube) -> int:
    return sum(1 for _, q, _ in fake.requests if q.get("watch"))


async def test_a_410_is_recovered_by_a_new_list_and_a_missed_delete_is_applied(
    rig: Rig,
) -> None:
    for ip in ("127.0.0.11", "127.0.0.12"):
        await rig.sim(ip)
    rig.fake.put(pod("w-1", "127.0.0.11"))
    await rig.converge(lambda: len(rig.urls()) == 1, SETUP)
    rig.fake.max_watch_seconds = 0.3  # the server ends watches early: the router resumes them
    before = watches(rig.fake)
    rig.fake.break_watches()
    await rig.converge(lambda: watches(rig.fake) > before and rig.fake.watches_open == 1, SETUP)
    # One step: the delete, a new pod, and the history compacted before any stream sends them.
    rig.fake.delete("default", "w-1", force=True)
    rig.fake.put(pod("w-2", "127.0.0.12"))
    rig.fake.compact()
    # The resumed watch is told 410 (too old), and the list that follows has the truth.
    await rig.converge(lambda: rig.urls() == {url("127.0.0.12", rig.port)}, 2 * CONVERGE)
    metrics = (await rig.client.get(rig.router.url + "/metrics")).text
    assert 'trio_pdrouter_discovery_watch_restarts_total{reason="expired",role="regular"}' in (
        metrics
    )


async def test_a_restart_with_a_new_ip_takes_the_old_address_out_and_the_new_in(
    rig: Rig,
) -> None:
    old, new = await rig.sim("127.0.0.11"), await rig.sim("127.0.0.12")
    rig.fake.put(pod("s-0", "127.0.0.11", uid="u1"))
    await rig.converge(lambda: rig.urls() == {old.url}, SETUP)
    rig.fake.delete("default", "s-0")
    rig.fake.put(pod("s-0", "127.0.0.12", uid="u2"))
    await rig.converge(lambda: rig.urls() == {new.url})
    assert (await rig.complete()).status_code == 200
    assert new.state.engines[0].counters.requests == 1


async def test_churn_under_load_sends_nothing_to_a_removed_pod_and_loses_nothing(
    rig: Rig,
) -> None:
    ips = [f"127.0.0.{11 + i}" for i in range(8)]
    for ip in ips:
        await rig.sim(ip, itl_base_s=0.002)
    for i, ip in enumerate(ips[:3]):
        rig.fake.put(pod(f"w-{i}", ip))
    await rig.converge(lambda: len(rig.urls()) == 3, SETUP)
    statuses: list[int] = []
    done = trio.Event()

    async def client_loop() -> None:
        while not done.is_set():
            resp = await rig.complete(max_tokens=5, stream=True)
            statuses.append(resp.status_code)

    async with trio.open_nursery() as nursery:
        for _ in range(8):
            nursery.start_soon(client_loop)
        # Each step: the oldest pod goes (alternately graceful, forced), a new one comes.
        live = list(range(3))
        await rig.converge(lambda: len(statuses) >= 8, SETUP)
        for step, i in enumerate(range(3, 8)):
            gone = live.pop(0)
            rig.fake.delete("default", f"w-{gone}", force=step % 2 == 1)
            rig.fake.put(pod(f"w-{i}", ips[i]))
            live.append(i)
            await rig.converge(lambda: rig.urls() == {url(ips[j], rig.port) for j in live})
            await rig.converge(lambda n=8 * (step + 1): len(statuses) > n, SETUP)
        done.set()
    assert statuses and set(statuses) == {200}
    assert len(rig.withdrawn) == 5
    for removed, at in rig.withdrawn.items():
        assert any(u == removed for u, t in rig.charged), "each removed pod had served"
        assert [t for u, t in rig.charged if u == removed and t >= at] == []
    assert rig.router.ledger.total() == 0

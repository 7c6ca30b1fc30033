"""``--workers N`` end to end: a supervisor, N worker processes, one machine ledger, simulators."""

from __future__ import annotations

import os
import signal
import sys
import uuid
from typing import Any

import httpx
import pytest
import trio

from tests.cluster import eventually
from tests.workers_harness import (
    get_loads_from_many_connections,
    start_supervisor,
    stop_supervisor,
)
from trio_pdrouter.config import RouterConfig, ServerSettings
from trio_pdrouter.workers import WorkersKeepDying, supervise
from trio_pdrouter_sim.config import SimConfig
from trio_pdrouter_sim.server import SimServer


async def start_sims(nursery: trio.Nursery, *, dp: int = 1, itl: float = 0.01) -> list[SimServer]:
    prefill = SimServer(SimConfig.fast(port=0, role="prefill", dp_size=dp))
    decode = SimServer(SimConfig.fast(port=0, role="decode", dp_size=dp, itl_base_s=itl))
    await nursery.start(prefill.run)
    await nursery.start(decode.run)
    return [prefill, decode]


def pd_args(sims: list[SimServer], *extra: str) -> list[str]:
    prefill, decode = sims
    return [
        "--vllm-pd-disaggregation",
        "--prefill",
        prefill.url,
        "--decode",
        decode.url,
        "--admin-from-loopback",
        *extra,
    ]


def engine_load(sim: SimServer) -> int:
    totals = sim.state.stats()["totals"]
    return int(totals["running"] + totals["waiting"])


def body(max_tokens: int) -> dict[str, Any]:
    # distinct random prompts: cache_aware finds no prefix and places by load alone
    return {"prompt": uuid.uuid4().hex, "max_tokens": max_tokens, "stream": True}


async def hold_streams(
    nursery: trio.Nursery, url: str, n: int, max_tokens: int, release: trio.Event
) -> None:
    """Start ``n`` streams on their own connections; return once each has its first byte; each
    then stays open, unread, until ``release`` is set."""
    started = trio.Semaphore(0)

    async def one() -> None:
        async with (
            httpx.AsyncClient(timeout=60) as client,
            client.stream("POST", url + "/v1/completions", json=body(max_tokens)) as resp,
        ):
            assert resp.status_code == 200
            chunks = resp.aiter_raw()
            await chunks.__anext__()
            started.release()
            await release.wait()

    for _ in range(n):
        nursery.start_soon(one)
    with trio.fail_after(60):
        for _ in range(n):
            await started.acquire()


@pytest.mark.parametrize(
    "streams",
    [
        # itl 50 ms: 48 held streams make ~1,000 events/s, light enough beside the whole suite
        48,
        # the load the machine ledger was built for: ~4,000 events/s, for `make bench` (pytest -m slow)
        pytest.param(200, marks=pytest.mark.slow),
    ],
)
async def test_four_workers_each_report_the_engines_load_then_zero(streams: int) -> None:
    async with trio.open_nursery() as nursery:
        sims = await start_sims(nursery, itl=0.05)
        sup = await start_supervisor(nursery, 4, pd_args(sims, "--policy", "round_robin"))
        release = trio.Event()
        async with trio.open_nursery() as clients:
            await hold_streams(clients, sup.url, streams, max_tokens=20_000, release=release)
            for _ in range(10):  # a sample every 100 ms, each from whichever worker accepts it
                (loads,) = await get_loads_from_many_connections(sup.url, 1)
                engine = engine_load(sims[1])
                assert abs(sum(loads["decode"].values()) - engine) <= 1, (loads, engine)
                assert sum(loads["prefill"].values()) == engine_load(sims[0]) == 0
                await trio.sleep(0.1)
            release.set()

        async def engines_idle() -> bool:  # the engines see the aborts over their sockets
            return not any(engine_load(s) for s in sims)

        await eventually(engines_idle)
        for loads in await get_loads_from_many_connections(sup.url, 8):
            assert all(n == 0 for role in ("prefill", "decode") for n in loads[role].values())
        assert await stop_supervisor(sup) == 0
        nursery.cancel_scope.cancel()


async def test_a_herd_through_four_workers_never_puts_more_than_its_share_on_an_endpoint() -> None:
    async with trio.open_nursery() as nursery:
        sims = await start_sims(nursery, dp=8, itl=0.01)
        args = pd_args(sims, "--intra-node-data-parallel-size", "8", "--policy", "cache_aware")
        sup = await start_supervisor(nursery, 4, args)
        release = trio.Event()
        async with trio.open_nursery() as clients:
            await hold_streams(clients, sup.url, 64, max_tokens=20_000, release=release)
            engines = sims[1].state.stats()["engines"]
            running = [e["running"] + e["waiting"] for e in engines]
            assert running == [8] * 8, running  # exactly the even share
            release.set()
        assert await stop_supervisor(sup) == 0
        nursery.cancel_scope.cancel()


async def test_a_killed_worker_loses_its_charges_and_is_replaced_others_untouched() -> None:
    async with trio.open_nursery() as nursery:
        sims = await start_sims(nursery, itl=0.05)
        # The shared socket (the default): with one reuseport socket per worker, connections
        # the kernel hashes to the dead worker's socket wait for its replacement.
        sup = await start_supervisor(nursery, 2, pd_args(sims, "--policy", "round_robin"))
        await sup.wait_for(lambda: len(sup.pids) == 2, 30)
        outcomes: list[str] = []
        started = trio.Semaphore(0)

        async def one() -> None:
            text = b""
            try:
                async with (
                    httpx.AsyncClient(timeout=60) as client,
                    client.stream("POST", sup.url + "/v1/completions", json=body(60)) as resp,
                ):
                    chunks = resp.aiter_raw()
                    text = await chunks.__anext__()
                    started.release()
                    async for chunk in chunks:
                        text += chunk
            except httpx.HTTPError:
                outcomes.append("cut")
                return
            ok = text.endswith(b"data: [DONE]\n\n") and text.count(b'"text"') == 60
            outcomes.append("ok" if ok else "broken")

        n = 24
        async with trio.open_nursery() as clients:
            for _ in range(n):
                clients.start_soon(one)
            with trio.fail_after(30):
                for _ in range(n):
                    await started.acquire()
            # The shared socket lets whichever worker is awake accept, so one worker may hold
            # every stream: the victim is the one holding most, and its streams are the ones cut.
            port = int(sup.url.rsplit(":", 1)[1])
            held = {slot: client_connections(pid, port) for slot, pid in sup.pids.items()}
            assert sum(held.values()) == n, held
            slot = max(held, key=held.__getitem__)
            victim = sup.pids[slot]
            os.kill(victim, signal.SIGKILL)
            killed_at = trio.current_time()
            with trio.fail_after(0.5):  # its charges gone: the ledger equals the live streams
                while True:
                    (loads,) = await get_loads_from_many_connections(sup.url, 1)
                    live = n - len(outcomes)
                    if sum(loads["decode"].values()) == live == engine_load(sims[1]):
                        break
                    await trio.sleep(0.01)
            await sup.wait_for(
                lambda: sup.pids[slot] != victim, 2 - (trio.current_time() - killed_at)
            )
        assert "broken" not in outcomes
        assert outcomes.count("cut") == held[slot], (outcomes, held)
        async with httpx.AsyncClient(timeout=10) as client:  # the replacement serves
            for _ in range(4):
                resp = await client.post(sup.url + "/v1/completions", json={"prompt": "x"})
                assert resp.status_code == 200
                # the machine's restart count, whichever worker answers
                text = (await client.get(sup.url + "/metrics")).text
                assert "\ntrio_pdrouter_worker_restarts_total 1.0\n" in text
        assert await stop_supervisor(sup) == 0
        nursery.cancel_scope.cancel()


def client_connections(pid: int, port: int) -> int:
    """Established TCP connections process ``pid`` holds on its listening ``port`` (Linux: its
    socket inodes in ``/proc/<pid>/fd`` found in ``/proc/net/tcp``)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            next(lines)  # the header
            for line in lines:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                established = state == "01"
                if established and int(local.rsplit(":", 1)[1], 16) == port and inode in inodes:
                    count += 1
    return count


async def test_workers_that_die_at_start_make_the_supervisor_give_up() -> None:
    config = RouterConfig(
        worker_urls=("http://127.0.0.1:9",),
        server=ServerSettings(host="127.0.0.1", port=0, workers=8),
    )

    def dies(*args: object) -> list[str]:
        return [sys.executable, "-c", "raise SystemExit(3)"]

    with pytest.RaisesGroup(WorkersKeepDying, flatten_subgroups=True), trio.fail_after(60):
        await supervise(config, [], trio.sleep_forever, command=dies)


async def test_runtime_server_changes_reach_every_worker_and_every_replacement() -> None:
    async with trio.open_nursery() as nursery:
        sims = await start_sims(nursery)
        extra = SimServer(SimConfig.fast(port=0, role="decode"))
        await nursery.start(extra.run)
        sup = await start_supervisor(nursery, 3, pd_args(sims, "--policy", "round_robin"))
        await sup.wait_for(lambda: len(sup.pids) == 3, 30)

        async def every_answer_lists(present: bool) -> bool:
            for _ in range(9):  # fresh connections: the kernel spreads them over the workers
                async with httpx.AsyncClient(timeout=10) as client:
                    urls = [
                        w["url"] for w in (await client.get(sup.url + "/workers")).json()["workers"]
                    ]
                if (extra.url in urls) != present:
                    return False
            return True

        async with httpx.AsyncClient(timeout=10) as client:
            resp = await client.post(
                sup.url + "/workers", json={"url": extra.url, "role": "decode"}
            )
            assert resp.status_code == 201
            again = await client.post(
                sup.url + "/workers", json={"url": extra.url, "role": "decode"}
            )
            assert again.status_code == 409  # whichever worker got it, it knows
        await eventually(lambda: every_answer_lists(True))
        victim = sup.pids[1]
        os.kill(victim, signal.SIGKILL)
        await sup.wait_for(lambda: sup.pids[1] != victim, 30)
        await eventually(lambda: every_answer_lists(True))  # the replacement replayed the log
        async with httpx.AsyncClient(timeout=10) as client:
            resp = await client.delete(sup.url + "/workers/" + extra.url)
            assert resp.status_code == 200
        await eventually(lambda: every_answer_lists(False))
        assert await stop_supervisor(sup) == 0
        nursery.cancel_scope.cancel()


def _exited(pid: int) -> bool:
    """The process is gone or a zombie (its new parent may not reap it at once)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


async def test_workers_stop_when_their_supervisor_is_killed() -> None:
    async with trio.open_nursery() as nursery:
        sims = await start_sims(nursery)
        sup = await start_supervisor(nursery, 2, pd_args(sims, "--policy", "round_robin"))
        await sup.wait_for(lambda: len(sup.pids) == 2, 30)
        workers = list(sup.pids.values())
        sup.proc.send_signal(signal.SIGKILL)
        await sup.proc.wait()

        async def all_exited() -> bool:
            return all(_exited(pid) for pid in workers)

        await eventually(all_exited, timeout=15)  # each drains (nothing in flight) and exits
        nursery.cancel_scope.cancel()


async def test_two_thousand_servers_added_and_removed_leave_every_worker_serving_the_same() -> None:
    """Pod churn through the admin routes: each cycle a new address, as Kubernetes gives each new
    pod. Slots and the change log are reclaimed: no add is refused, no worker dies."""
    async with trio.open_nursery() as nursery:
        sims = await start_sims(nursery)
        sup = await start_supervisor(nursery, 2, pd_args(sims, "--policy", "round_robin"))
        await sup.wait_for(lambda: len(sup.pids) == 2, 30)
        pids = dict(sup.pids)
        clients = [httpx.AsyncClient(timeout=30) for _ in range(4)]  # spread over the workers
        try:
            for i in range(2000):
                client = clients[i % len(clients)]
                url = f"http://127.0.0.2:{20000 + i}"
                role = "decode" if i % 2 else "prefill"
                added = await client.post(sup.url + "/workers", json={"url": url, "role": role})
                assert added.status_code == 201, (i, added.text)
                removed = await client.delete(f"{sup.url}/workers/{url}")
                assert removed.status_code == 200, (i, removed.text)
        finally:
            for client in clients:
                await client.aclose()

        async def every_worker_lists_the_command_lines_servers() -> bool:
            for _ in range(12):  # fresh connections: the kernel spreads them over the workers
                async with httpx.AsyncClient(timeout=10) as client:
                    workers = (await client.get(sup.url + "/workers")).json()["workers"]
                if sorted(w["url"] for w in workers) != sorted(s.url for s in sims):
                    return False
            return True

        await eventually(every_worker_lists_the_command_lines_servers)
        async with httpx.AsyncClient(timeout=30) as client:
            for _ in range(4):
                resp = await client.post(
                    sup.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}
                )
                assert resp.status_code == 200, resp.text
        assert sup.pids == pids, "no worker died"
        assert b"Traceback" not in sup.log
        assert await stop_supervisor(sup) == 0
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("workers", [1, 2])
async def test_during_the_drain_a_new_connection_is_refused(workers: int) -> None:
    async with trio.open_nursery() as nursery:
        sims = await start_sims(nursery, itl=0.05)
        sup = await start_supervisor(nursery, workers, pd_args(sims, "--policy", "round_robin"))
        if workers > 1:
            await sup.wait_for(lambda: len(sup.pids) == workers, 30)
        release = trio.Event()
        await hold_streams(nursery, sup.url, 4, 2000, release)  # the workers drain these
        host, port = sup.url.removeprefix("http://").rsplit(":", 1)
        sup.proc.send_signal(signal.SIGTERM)

        async def refused() -> bool:
            try:
                stream = await trio.open_tcp_stream(host, int(port))
            except OSError:
                return True
            await stream.aclose()
            return False

        await eventually(refused)
        assert sup.proc.returncode is None, "still draining its streams"
        release.set()
        with trio.fail_after(30):
            assert await sup.proc.wait() == 0
        nursery.cancel_scope.cancel()


async def test_sticky_sessions_keep_their_endpoints_through_two_workers() -> None:
    """Each worker keeps its own session map (docs/routing.md): a session that keeps one
    connection stays on one worker, so on one endpoint of each stage."""
    async with trio.open_nursery() as nursery:
        sims = await start_sims(nursery, dp=4)
        args = pd_args(
            sims,
            "--intra-node-data-parallel-size",
            "4",
            "--policy",
            "sticky_least_loaded",
            "--expose-routing-headers",
        )
        sup = await start_supervisor(nursery, 2, args)
        homes: dict[str, set[tuple[str, str]]] = {}

        async def session(name: str) -> None:
            async with httpx.AsyncClient(timeout=60) as client:  # one connection: one worker
                for turn in range(4):
                    resp = await client.post(
                        sup.url + "/v1/completions",
                        json={"prompt": f"turn {turn}", "max_tokens": 2},
                        headers={"X-Session-ID": name},
                    )
                    assert resp.status_code == 200, resp.text
                    served = (
                        resp.headers["x-trio-pdrouter-prefill"],
                        resp.headers["x-trio-pdrouter-decode"],
                    )
                    homes.setdefault(name, set()).add(served)

        async with trio.open_nursery() as clients:
            for i in range(8):
                clients.start_soon(session, f"s{i}")
        assert len(homes) == 8
        assert all(len(served) == 1 for served in homes.values()), homes
        assert await stop_supervisor(sup) == 0
        nursery.cancel_scope.cancel()

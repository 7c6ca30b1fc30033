"""Two replicas of two workers each on one real Redis.

* Every worker of a replica publishes the machine's ledger under the replica's id: a peer sees
  the replica's whole count once (not once per worker, not one worker's share).
* Under steady load the cluster view from any worker follows the engines within 2 per endpoint
  at the p99 of 100 ms samples. The view compared is the visible one (``"cluster"``'s
  ``"visible"``): a decode slot charged while its prefill runs is in the counts peers route on
  but not yet on an engine, in this replica's numbers and in the peers' alike.
* A whole replica SIGKILLed (its supervisor and its workers) is gone from the other replica's
  view within the expiry plus one interval, with no negative counts and no phantoms.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import trio

from tests.cluster import eventually
from tests.redis_server import RedisServer
from tests.serve.test_integration_pd import COMPLETION
from tests.workers_harness import Supervised, start_supervisor
from trio_pdrouter_sim.config import SimConfig
from trio_pdrouter_sim.server import SimServer

SYNC_MS = 50


@asynccontextmanager
async def two_replicas(redis: RedisServer) -> AsyncIterator[tuple[list[SimServer], list[Any]]]:
    async with trio.open_nursery() as nursery:
        prefill = SimServer(SimConfig(port=0, role="prefill", prefill_base_s=0.002))
        # 50 ms a token whatever runs; a short series window keeps /sim/stats small.
        config = SimConfig(
            port=0, role="decode", itl_base_s=0.05, itl_per_running_s=0.0, series_window_s=1.0
        )
        decode = [SimServer(config) for _ in range(2)]
        for sim in [prefill, *decode]:
            await nursery.start(sim.run)
        replicas: list[Supervised] = []
        for name in ("r1", "r2"):
            args = ["--host", "127.0.0.1", "--vllm-pd-disaggregation", "--prefill", prefill.url]
            for sim in decode:
                args += ["--decode", sim.url]
            args += ["--policy", "power_of_two", "--engine-metrics-interval", "0"]
            args += ["--cluster-url", redis.url, "--cluster-sync-ms", str(SYNC_MS)]
            args += ["--replica-id", name]
            sup = await start_supervisor(nursery, 2, args)
            await sup.wait_for(lambda s=sup: len(s.pids) == 2, 60)  # type: ignore[misc]
            replicas.append(sup)
        yield decode, replicas
        nursery.cancel_scope.cancel()


def truth(decode: list[SimServer]) -> dict[str, int]:
    out = {}
    for sim in decode:
        totals = sim.state.stats()["totals"]
        out[sim.url] = int(totals["running"] + totals["waiting"])
    return out


async def get_loads(url: str) -> dict[str, Any]:
    """``/get_loads`` on a fresh connection: the kernel picks the worker."""
    async with httpx.AsyncClient(timeout=10) as client:
        resp = await client.get(url + "/get_loads")
        resp.raise_for_status()
        result: dict[str, Any] = resp.json()
        return result


def decode_view(loads: dict[str, Any], of: str = "total") -> dict[str, int]:
    """The cluster's decode counts: ``"total"`` (what routing sees) or ``"visible"``."""
    decode: dict[str, int] = loads["cluster"][of].get("decode", {})
    return decode


async def stream(url: str, max_tokens: int) -> None:
    body = {**COMPLETION, "stream": True, "max_tokens": max_tokens}
    async with (
        httpx.AsyncClient(timeout=60) as client,
        client.stream("POST", url + "/v1/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        async for _ in resp.aiter_raw():
            pass


async def test_two_replicas_of_two_workers_follow_the_engines_under_steady_load(
    redis_server: RedisServer,
) -> None:
    """Compared with the engines, the cluster view leaves out every replica's PENDING decode
    slots (see the module doc). Compared by the routing counts, one run in four failed on a
    loaded machine; measured, the routing counts' excess was the PENDING slots of the moment
    (samples 6 over the engines where the visible part was 1 off, 0 when nothing was PENDING)."""
    async with two_replicas(redis_server) as (decode, (r1, r2)):
        # Steady load through both replicas: each stream on its own connection, so the
        # kernel spreads them over the workers.
        errors: list[int] = []
        done = trio.Event()
        # 60 tokens at 50 ms: 3 s each.
        streams, tokens = 12, 60

        async def client(url: str, start: float) -> None:
            await trio.sleep(start)  # staggered starts keep the load steady
            for _ in range(2):
                await stream(url, tokens)

        async def sample() -> None:
            while not done.is_set():
                before = truth(decode)
                loads = await get_loads(r1.url)
                after = truth(decode)
                view = decode_view(loads, "visible")
                assert all(n >= 0 for n in [*view.values(), *decode_view(loads).values()])
                # The engines' counts just before and just after: the view is right if it lies
                # between them (streams start and end while the three reads travel).
                errors.append(
                    max(
                        max(0, min(t, after[u]) - view.get(u, 0), view.get(u, 0) - max(t, after[u]))
                        for u, t in before.items()
                    )
                )
                await trio.sleep(0.1)  # the sampling period itself, not a synchronisation

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sample)
            async with trio.open_nursery() as load:
                for i in range(streams):
                    url = (r1, r2)[i % 2].url
                    load.start_soon(client, url, i / streams * tokens * 0.05)
            done.set()
        assert len(errors) >= 10
        errors.sort()
        assert errors[int(0.99 * (len(errors) - 1))] <= 2, errors


async def test_two_replicas_of_two_workers_see_each_other_once_and_drop_a_killed_replica(
    redis_server: RedisServer,
) -> None:
    async with two_replicas(redis_server) as (decode, (r1, r2)):
        # Long streams through r2 only: r1's workers see r2's whole count, once.
        async with trio.open_nursery() as clients:
            for _ in range(4):
                clients.start_soon(_stream_until_cut, r2.url)

            async def r1_sees_them() -> bool:
                # Whichever worker answers, the same view: six reads in a row. Each worker
                # reads the cluster on its own, so the first to see r2's streams may answer
                # before the other has; a double count or one worker's share never passes.
                for _ in range(6):
                    loads = await get_loads(r1.url)
                    if sum(decode_view(loads).values()) != 4:
                        return False
                    if set(loads["cluster"]["replicas"]) != {"r1", "r2"}:
                        return False
                return True

            await eventually(r1_sees_them, timeout=10)
            # The whole replica at once: workers first, then their supervisor, no await between.
            for pid in r2.pids.values():
                os.kill(pid, signal.SIGKILL)
            r2.proc.send_signal(signal.SIGKILL)
            killed = trio.current_time()

            async def dropped() -> bool:
                for _ in range(4):  # most likely both workers of r1
                    loads = await get_loads(r1.url)
                    view = decode_view(loads)
                    assert all(n >= 0 for n in view.values())
                    if any(view.values()) or set(loads["cluster"]["replicas"]) != {"r1"}:
                        return False
                return True

            await eventually(dropped, timeout=5)
            assert trio.current_time() - killed <= 1.0  # expiry (0.2 s) + one interval, slack

        async def engines_idle() -> bool:
            return not any(truth(decode).values())

        await eventually(engines_idle, timeout=10)
        for _ in range(4):  # no phantom in any worker
            assert not any(decode_view(await get_loads(r1.url)).values())


async def _stream_until_cut(url: str) -> None:
    with contextlib.suppress(httpx.HTTPError):  # the replica is killed under it
        await stream(url, max_tokens=2000)

"""Two router replicas on one real Redis in front of shared simulators.

* Under steady, bounded load the cluster view (``/get_loads``' ``"cluster"``, its visible
  part: what the engines can see) follows the engines' own counts within 2 per endpoint at the
  p99 of 100 ms samples.
* A replica SIGKILLed mid-stream (a real process) is gone from its peer's view within the
  expiry plus one interval, with no negative counts and no phantoms.
* With Redis stopped, replicas keep serving on local counts; when it returns they reconverge.
* Prefill's token metric (its default) sees the peers' token weights: a replica avoids the
  prefill engine another replica has loaded with a long prompt.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx
import trio

from tests.cluster import eventually
from tests.redis_server import RedisServer, free_port
from tests.serve.test_integration_pd import COMPLETION
from trio_pdrouter.config import ClusterSettings, RouterConfig, ServerSettings
from trio_pdrouter.endpoints import Role
from trio_pdrouter.ledger import MAX_BACKOFF
from trio_pdrouter.server import RunningRouter, run_router
from trio_pdrouter_sim.config import SimConfig
from trio_pdrouter_sim.server import SimServer

SYNC_MS = 50


@attrs.define
class Replicas:
    prefill: list[SimServer]
    decode: list[SimServer]
    routers: list[RunningRouter]
    client: httpx.AsyncClient

    async def loads(self, url: str) -> dict[str, Any]:
        resp = await self.client.get(url + "/get_loads")
        resp.raise_for_status()
        result: dict[str, Any] = resp.json()
        return result

    async def stats_of(self, sim: SimServer) -> dict[str, Any]:
        resp = await self.client.get(sim.url + "/sim/stats")
        resp.raise_for_status()
        result: dict[str, Any] = resp.json()
        return result

    async def truth(self) -> dict[str, int]:
        """Each decode engine's running + waiting, from the simulators."""
        out: dict[str, int] = {}
        for sim in self.decode:
            resp = await self.client.get(sim.url + "/sim/stats")
            totals = resp.json()["totals"]
            out[sim.url] = int(totals["running"] + totals["waiting"])
        return out


def router_config(sims: Replicas, redis: RedisServer, replica: str, port: int = 0) -> RouterConfig:
    return RouterConfig(
        pd=True,
        server=ServerSettings(host="127.0.0.1", port=port),
        prefill_urls=tuple(s.url for s in sims.prefill),
        decode_urls=tuple(s.url for s in sims.decode),
        policy="power_of_two",
        engine_metrics_interval=0,
        cluster=ClusterSettings(url=redis.url, sync_ms=SYNC_MS, replica_id=replica),
        prometheus_listener=False,
    )


@asynccontextmanager
async def replicas(
    redis: RedisServer, n_routers: int, decode: SimConfig, n_decode: int = 2
) -> AsyncIterator[Replicas]:
    async with (
        httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=200)) as client,
        trio.open_nursery() as nursery,
    ):
        # A short series window keeps /sim/stats small: the test reads it 10 times a second.
        prefill = [SimServer(SimConfig(port=0, role="prefill", prefill_base_s=0.002))]
        decode = attrs.evolve(decode, role="decode", series_window_s=1.0)
        decoders = [SimServer(decode) for _ in range(n_decode)]
        for sim in [*prefill, *decoders]:
            await nursery.start(sim.run)
        sims = Replicas(prefill, decoders, [], client)
        for i in range(n_routers):
            running = await nursery.start(run_router, router_config(sims, redis, f"r{i + 1}"))
            sims.routers.append(running)
        yield sims
        nursery.cancel_scope.cancel()


async def stream(client: httpx.AsyncClient, url: str, max_tokens: int) -> None:
    body = {**COMPLETION, "stream": True, "max_tokens": max_tokens}
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for _ in resp.aiter_raw():
            pass


def decode_view(loads: dict[str, Any], of: str = "total") -> dict[str, int]:
    """The cluster's decode counts: ``"total"`` (what routing sees) or ``"visible"`` (what the
    engines can see: PENDING decode slots left out)."""
    decode: dict[str, int] = loads["cluster"][of].get("decode", {})
    return decode


async def test_cluster_view_follows_engine_truth_under_steady_load(
    redis_server: RedisServer,
) -> None:
    decode = SimConfig(port=0, itl_base_s=0.05, itl_per_running_s=0.0)
    async with replicas(redis_server, 2, decode) as sims:
        errors: list[int] = []
        done = trio.Event()

        streams, tokens = 12, 30  # 6 per replica, each 30 tokens at 50 ms: 1.5 s

        async def client(url: str, start: float) -> None:
            # Staggered starts keep the load steady (no wave of streams ending at once).
            await trio.sleep(start)
            for _ in range(4):
                await stream(sims.client, url, max_tokens=tokens)

        async def sample() -> None:
            r1 = sims.routers[0].url
            while not done.is_set():
                # The engines' counts just before and just after the view: the view is
                # compared with the nearer of the two (reads over HTTP are not instantaneous).
                before = await sims.truth()
                view = decode_view(await sims.loads(r1), "visible")
                after = await sims.truth()
                assert all(n >= 0 for n in view.values())
                errors.append(
                    max(
                        min(abs(view.get(u, 0) - t), abs(view.get(u, 0) - after[u]))
                        for u, t in before.items()
                    )
                )
                await trio.sleep(0.1)  # the sampling period itself, not a synchronisation

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sample)
            async with trio.open_nursery() as load:
                for i in range(streams):
                    url = sims.routers[i % 2].url
                    load.start_soon(client, url, i / streams * tokens * 0.05)
            done.set()
        assert len(errors) >= 10
        errors.sort()
        p99 = errors[int(0.99 * (len(errors) - 1))]
        assert p99 <= 2, errors
        # All zeros after: own counts and the peer's latest snapshot alike.
        for router in sims.routers:
            await eventually(
                lambda url=router.url: _all_zero(sims, url),
                timeout=2,  # type: ignore[misc]
            )


async def _all_zero(sims: Replicas, url: str) -> bool:
    view = decode_view(await sims.loads(url))
    return not any(view.values())


@asynccontextmanager
async def router_process(config: RouterConfig) -> AsyncIterator[trio.Process]:
    """``python -m trio_pdrouter`` with ``config``'s flags, ready once ``/health`` answers."""
    c = config.cluster
    argv = [sys.executable, "-m", "trio_pdrouter", "--host", "127.0.0.1"]
    argv += ["--port", str(config.server.port), "--no-prometheus-listener"]
    argv += ["--vllm-pd-disaggregation"]
    for url in config.prefill_urls:
        argv += ["--prefill", url]
    for url in config.decode_urls:
        argv += ["--decode", url]
    argv += ["--policy", config.policy, "--engine-metrics-interval", "0", "--log-level", "warning"]
    argv += ["--cluster-url", str(c.url), "--cluster-sync-ms", str(c.sync_ms)]
    argv += ["--replica-id", str(c.replica_id)]
    process = await trio.lowlevel.open_process(argv, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{config.server.port}"
        async with httpx.AsyncClient() as client:

            async def healthy() -> bool:
                try:
                    return (await client.get(url + "/health")).status_code == 200
                except httpx.TransportError:
                    return False

            await eventually(healthy, timeout=30)
        yield process
    finally:
        with trio.CancelScope(shield=True):
            process.kill()  # a no-op on a process already dead
            await process.wait()


async def test_a_sigkilled_replica_is_dropped_within_expiry_plus_one_interval(
    redis_server: RedisServer,
) -> None:
    decode = SimConfig(port=0, itl_base_s=0.05, itl_per_running_s=0.0)
    async with replicas(redis_server, 1, decode) as sims:
        r1 = sims.routers[0].url
        config = router_config(sims, redis_server, "r2", port=free_port())
        async with router_process(config) as r2, trio.open_nursery() as clients:
            r2_url = f"http://127.0.0.1:{config.server.port}"
            for _ in range(4):  # long streams through the replica about to die
                clients.start_soon(_stream_until_cut, sims.client, r2_url)

            async def peer_sees_them() -> bool:
                return sum(decode_view(await sims.loads(r1)).values()) == 4

            await eventually(peer_sees_them, timeout=10)
            assert (await sims.loads(r1))["cluster"]["replicas"].keys() == {"r1", "r2"}
            r2.send_signal(signal.SIGKILL)
            killed = trio.current_time()

            async def dropped() -> bool:
                loads = await sims.loads(r1)
                view = decode_view(loads)
                assert all(n >= 0 for n in view.values())
                return not any(view.values()) and set(loads["cluster"]["replicas"]) == {"r1"}

            await eventually(dropped, timeout=5)
            assert trio.current_time() - killed <= 1.0  # expiry (0.2 s) + interval, with slack
        # No phantom later: the engines saw the streams end, the view stays at zero.
        await eventually(lambda: _engines_idle(sims), timeout=10)
        assert not any(decode_view(await sims.loads(r1)).values())


async def _stream_until_cut(client: httpx.AsyncClient, url: str) -> None:
    with contextlib.suppress(httpx.HTTPError):  # the replica is killed under it
        await stream(client, url, max_tokens=2000)


async def _engines_idle(sims: Replicas) -> bool:
    return not any((await sims.truth()).values())


async def test_redis_down_keeps_serving_on_local_counts_and_reconverges(
    redis_server: RedisServer,
) -> None:
    decode = SimConfig(port=0, itl_base_s=0.05, itl_per_running_s=0.0)
    async with replicas(redis_server, 2, decode) as sims:
        r1, r2 = (r.url for r in sims.routers)
        async with trio.open_nursery() as held:
            for _ in range(3):
                held.start_soon(stream, sims.client, r2, 80)  # ~4 s each

            async def r1_sees(n: int) -> bool:
                return sum(decode_view(await sims.loads(r1)).values()) == n

            await eventually(lambda: r1_sees(3), timeout=5)
            await redis_server.stop()
            await eventually(lambda: r1_sees(0), timeout=2)  # the peer's stale counts expire
            # Serving continues: a request through r1 while the store is down.
            await stream(sims.client, r1, max_tokens=2)
            metrics = (await sims.client.get(r1 + "/metrics")).text
            assert "trio_pdrouter_cluster_store_up 0.0" in metrics
            assert "trio_pdrouter_cluster_sync_errors_total 0.0" not in metrics
            await redis_server.start()
            back = trio.current_time()
            await eventually(lambda: r1_sees(3), timeout=5)
            assert trio.current_time() - back <= MAX_BACKOFF + SYNC_MS / 1000 + 0.5
            metrics = (await sims.client.get(r1 + "/metrics")).text
            assert "trio_pdrouter_cluster_store_up 1.0" in metrics
            assert "trio_pdrouter_cluster_peers 1.0" in metrics


async def test_a_prefill_token_choice_sees_the_other_replicas_token_weights(
    redis_server: RedisServer,
) -> None:
    # 5 ms a prompt token: the held prompts stay in prefill for seconds.
    prefill_sim = SimConfig(port=0, role="prefill", prefill_base_s=0.0, prefill_per_token_s=0.005)
    decode_sim = SimConfig.fast(port=0, role="decode")
    async with (
        httpx.AsyncClient(timeout=30) as client,
        trio.open_nursery() as nursery,
    ):
        prefill = [SimServer(prefill_sim) for _ in range(2)]
        decode = [SimServer(decode_sim)]
        for sim in [*prefill, *decode]:
            await nursery.start(sim.run)
        sims = Replicas(prefill, decode, [], client)
        b: RunningRouter = await nursery.start(run_router, router_config(sims, redis_server, "b"))

        async def complete(router: RunningRouter, text: str) -> None:
            body = {"model": "sim-model", "prompt": text, "max_tokens": 1}
            with contextlib.suppress(httpx.HTTPError):  # cancelled when the test ends
                await client.post(router.url + "/v1/completions", json=body)

        # b holds a 1000-token prompt (5 s of prefill) on one prefill engine, "near" ...
        charged = trio.Event()
        b.ledger.observe(lambda ep, n: charged.set() if ep.role is Role.PREFILL and n else None)
        nursery.start_soon(complete, b, "a " * 2000)
        await charged.wait()
        held = b.ledger.token_snapshot()["prefill"]
        near = next(url for url, tokens in held.items() if tokens)
        far = next(url for url in held if url != near)
        # ... and replica a, whose only prefill engine is the other one, a 2000-token prompt.
        only_far = attrs.evolve(router_config(sims, redis_server, "a"), prefill_urls=(far,))
        a: RunningRouter = await nursery.start(run_router, only_far)
        nursery.start_soon(complete, a, "b " * 4000)

        async def b_sees_a() -> bool:
            tokens = (await sims.loads(b.url))["cluster"]["tokens"]["prefill"]
            return bool(tokens.get(far, 0) >= 2000 and tokens.get(near, 0) >= 1000)

        await eventually(b_sees_a, timeout=5)
        # By its own tokens b would choose far (0 against 1000); with a's it chooses near.
        for _ in range(3):
            nursery.start_soon(complete, b, "c " * 100)

        async def requests() -> dict[str, int]:
            return {
                sim.url: int((await sims.stats_of(sim))["totals"]["requests"]) for sim in prefill
            }

        async def all_routed() -> bool:
            return sum((await requests()).values()) == 5

        await eventually(all_routed, timeout=5)
        assert await requests() == {near: 4, far: 1}
        nursery.cancel_scope.cancel()

"""Tenants across two router replicas on one real Redis: a tenant's concurrency limit counts
the requests it holds at the other replica (within one sync interval), and the replicas publish
each tenant's numbers to each other."""

from __future__ import annotations

from pathlib import Path

import attrs
import httpx
import trio

from tests.cluster import eventually
from tests.ledger.test_cluster_e2e import Replicas, router_config
from tests.redis_server import RedisServer
from tests.serve.test_integration_pd import COMPLETION
from trio_pdrouter.config import AdmissionSettings
from trio_pdrouter.server import run_router
from trio_pdrouter_sim.config import SimConfig
from trio_pdrouter_sim.server import SimServer

FILE = """
[tenants.alice]
keys = ["sk-alice"]
max_concurrent_requests = 2

[tenants.bob]
keys = ["sk-bob"]
"""


async def test_a_tenants_limit_holds_across_replicas(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(FILE)
    async with (
        httpx.AsyncClient(timeout=30) as client,
        trio.open_nursery() as nursery,
    ):
        prefill = SimServer(SimConfig(port=0, role="prefill", prefill_base_s=0.002))
        decode = SimServer(SimConfig(port=0, role="decode", itl_base_s=0.05))
        for sim in (prefill, decode):
            await nursery.start(sim.run)
        sims = Replicas([prefill], [decode], [], client)
        routers = []
        for name in ("r1", "r2"):
            config = router_config(sims, redis_server, name)
            config = attrs.evolve(config, admission=AdmissionSettings(tenants_file=str(tenants)))
            routers.append(await nursery.start(run_router, config))
        r1, r2 = routers
        release = trio.Event()
        started = 0
        both = trio.Event()

        async def hold(key: str) -> None:
            nonlocal started
            body = {**COMPLETION, "stream": True, "max_tokens": 10_000}
            headers = {"authorization": f"Bearer {key}"}
            async with client.stream(
                "POST", r1.url + "/v1/completions", json=body, headers=headers
            ) as resp:
                assert resp.status_code == 200
                chunks = resp.aiter_raw()  # kept: a collected iterator would close the stream
                await chunks.__anext__()
                started += 1
                if started == 2:
                    both.set()
                await release.wait()

        async def ask(url: str, key: str) -> httpx.Response:
            body = {**COMPLETION, "max_tokens": 2}
            headers = {"authorization": f"Bearer {key}"}
            return await client.post(url + "/v1/completions", json=body, headers=headers)

        async with trio.open_nursery() as streams:
            for _ in range(2):
                streams.start_soon(hold, "sk-alice")
            await both.wait()
            assert r1.app.tenants.in_flight("alice") == 2

            async def r2_sees_alice() -> bool:
                return r2.app.tenants.in_flight("alice") == 2

            await eventually(r2_sees_alice, timeout=5)
            refused = await ask(r2.url, "sk-alice")
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert (await ask(r2.url, "sk-bob")).status_code == 200
            release.set()
            streams.cancel_scope.cancel()

        async def r2_admits_alice() -> bool:
            return (await ask(r2.url, "sk-alice")).status_code == 200

        await eventually(r2_admits_alice, timeout=5)
        assert r1.app.tenants.own("alice", 0) == 0
        nursery.cancel_scope.cancel()

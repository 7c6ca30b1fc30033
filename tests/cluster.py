"""Real servers on 127.0.0.1 for integration tests: simulators plus a router in front."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
import httpx
import trio

from trio_pdrouter.config import RouterConfig, ServerSettings
from trio_pdrouter.server import RunningRouter, run_router
from trio_pdrouter_sim.config import SimConfig
from trio_pdrouter_sim.server import SimServer


@attrs.define
class Cluster:
    router: RunningRouter
    prefill: list[SimServer]
    decode: list[SimServer]
    client: httpx.AsyncClient

    @property
    def url(self) -> str:
        return self.router.url

    async def stats(self, sim: SimServer) -> dict[str, Any]:
        resp = await self.client.get(sim.url + "/sim/stats")
        resp.raise_for_status()
        result: dict[str, Any] = resp.json()
        return result

    async def get_loads(self) -> dict[str, dict[str, int]]:
        resp = await self.client.get(self.url + "/get_loads")
        result: dict[str, dict[str, int]] = resp.json()
        return result

    async def all_idle(self) -> bool:
        """Router ledger all zero and no simulator running or waiting anything."""
        if self.router.ledger.total():
            return False
        for sim in [*self.prefill, *self.decode]:
            totals = (await self.stats(sim))["totals"]
            if totals["running"] or totals["waiting"]:
                return False
        return True


@contextlib.asynccontextmanager
async def held_streams(c: Cluster, n: int, body: dict[str, Any]) -> AsyncIterator[None]:
    """Start ``n`` streaming requests, enter once every one has its first byte, and keep them
    open, unread, until the block ends."""
    started = 0
    all_started = trio.Event()
    release = trio.Event()

    async def one() -> None:
        nonlocal started
        async with c.client.stream("POST", c.url + "/v1/completions", json=body) as resp:
            # Keep the iterator referenced: a dropped httpx body iterator is finalised, which
            # closes the connection, and the router (rightly) sees a disconnect.
            chunks = resp.aiter_raw()
            await chunks.__anext__()
            started += 1
            if started == n:
                all_started.set()
            await release.wait()

    async with trio.open_nursery() as clients:
        for _ in range(n):
            clients.start_soon(one)
        await all_started.wait()
        try:
            yield
        finally:
            release.set()


async def eventually(predicate: Callable[[], Any], timeout: float = 10.0) -> None:  # noqa: ASYNC109
    """Poll an external effect (another server's state) until it holds, within ``timeout``.

    Only for effects no event of ours can observe (a simulator's counters over HTTP, a socket
    closing in another server); in-process state is awaited with events instead.
    """
    with trio.fail_after(timeout):
        while not await predicate():  # noqa: ASYNC110 - polling a remote server's state
            await trio.sleep(0.01)


async def start_cluster(
    nursery: trio.Nursery,
    *,
    sim: SimConfig | None = None,
    prefill_sim: SimConfig | None = None,
    decode_sim: SimConfig | None = None,
    n_prefill: int = 1,
    n_decode: int = 1,
    pd: bool = True,
    client_connections: int = 100,
    listening: dict[str, Any] | None = None,
    **router: Any,
) -> Cluster:
    """Start simulators and a router in ``nursery``; the router gets the sims' URLs."""
    base = sim or SimConfig.fast(port=0)
    dp = router.get("dp_size", 1)
    prefill: list[SimServer] = []
    decode: list[SimServer] = []
    if pd:
        p_cfg = prefill_sim or attrs.evolve(base, role="prefill", dp_size=dp)
        d_cfg = decode_sim or attrs.evolve(base, role="decode", dp_size=dp)
        prefill = [SimServer(p_cfg) for _ in range(n_prefill)]
        decode = [SimServer(d_cfg) for _ in range(n_decode)]
    else:
        decode = [SimServer(attrs.evolve(base, role="both", dp_size=dp)) for _ in range(n_decode)]
    for server in [*prefill, *decode]:
        await nursery.start(server.run)
    if pd:
        router.setdefault("prefill_urls", tuple(s.url for s in prefill))
        router.setdefault("decode_urls", tuple(s.url for s in decode))
    else:
        router.setdefault("worker_urls", tuple(s.url for s in decode))
    router.setdefault("policy", "round_robin")
    # vllm-router's default metrics port is the machine's: a test opens one only when asked.
    router.setdefault("prometheus_listener", "prometheus_port" in router)
    settings = ServerSettings(host="127.0.0.1", port=0, **(listening or {}))
    config = RouterConfig(pd=pd, server=settings, **router)
    running: RunningRouter = await nursery.start(run_router, config)
    client = httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=client_connections))
    nursery.start_soon(_close_when_cancelled, client)
    return Cluster(running, prefill, decode, client)


async def _close_when_cancelled(client: httpx.AsyncClient) -> None:
    """Tests end by cancelling the cluster's nursery: close the client's sockets then, rather
    than leave them to the garbage collector (later fd counts would see them vanish)."""
    try:
        await trio.sleep_forever()
    finally:
        with trio.CancelScope(shield=True):
            await client.aclose()

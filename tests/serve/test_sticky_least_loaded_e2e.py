"""``--policy sticky_least_loaded`` through the router against real simulators over 127.0.0.1 (PD:
two prefill and two decode servers): each stage keeps a session on its endpoint, whatever the
load; a new session goes to the least loaded; ``/finish_session`` and a removed server free it."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import trio

from tests.cluster import Cluster, start_cluster
from trio_pdrouter_sim.config import SimConfig

#: Slow tokens, so a held stream keeps its decode busy; short requests finish at once.
SLOW = SimConfig(port=0, itl_base_s=0.02, prefill_base_s=0.0, prefill_per_token_s=0.0)


async def send(c: Cluster, session: str, prompt: str = "hello") -> tuple[str, str]:
    """One short request of ``session``: the (prefill, decode) endpoints that served it."""
    body: dict[str, Any] = {"model": "sim-model", "prompt": prompt, "max_tokens": 2}
    resp = await c.client.post(
        c.url + "/v1/completions", json=body, headers={"X-Session-ID": session}
    )
    assert resp.status_code == 200, resp.text
    return resp.headers["x-trio-pdrouter-prefill"], resp.headers["x-trio-pdrouter-decode"]


@contextlib.asynccontextmanager
async def held(c: Cluster, session: str) -> AsyncIterator[str]:
    """A long stream of ``session``, open (unread) while the block runs: its decode endpoint."""
    body = {"model": "sim-model", "prompt": "held " * 8, "max_tokens": 5000, "stream": True}
    headers = {"X-Session-ID": session}
    async with c.client.stream(
        "POST", c.url + "/v1/completions", json=body, headers=headers
    ) as resp:
        assert resp.status_code == 200
        chunks = resp.aiter_raw()  # kept referenced: a dropped iterator closes the connection
        await chunks.__anext__()
        yield resp.headers["x-trio-pdrouter-decode"]


async def sticky_cluster(nursery: trio.Nursery) -> Cluster:
    return await start_cluster(
        nursery,
        sim=SLOW,
        n_prefill=2,
        n_decode=2,
        policy="sticky_least_loaded",
        expose_routing_headers=True,
        admin_from_loopback=True,  # DELETE /workers
    )


async def test_each_session_keeps_its_endpoints_and_new_sessions_spread() -> None:
    async with trio.open_nursery() as nursery:
        c = await sticky_cluster(nursery)
        homes = {f"s{i}": await send(c, f"s{i}") for i in range(4)}
        for turn in range(3):
            for name, home in homes.items():
                assert await send(c, name, f"turn {turn} of {name}") == home
        # Idle servers: the sessions spread by sessions bound, two on each server of each stage.
        assert Counter(p for p, _ in homes.values()) == {s.url: 2 for s in c.prefill}
        assert Counter(d for _, d in homes.values()) == {s.url: 2 for s in c.decode}
        metrics = (await c.client.get(c.url + "/metrics")).text
        for stage in ("prefill", "decode"):
            for reason, n in (("session_placed", 4), ("session_kept", 12)):
                line = f'policy_decisions_total{{reason="{reason}",stage="{stage}"}} {n}.0'
                assert line in metrics, line
        nursery.cancel_scope.cancel()


async def test_a_new_session_goes_to_the_least_loaded_and_a_bound_one_stays_loaded() -> None:
    async with trio.open_nursery() as nursery:
        c = await sticky_cluster(nursery)
        async with held(c, "a") as busy:
            other = next(s.url for s in c.decode if s.url != busy)
            assert (await c.get_loads())["decode"] == {busy: 1, other: 0}
            assert (await send(c, "b"))[1] == other  # new: the least loaded
            assert (await send(c, "a"))[1] == busy  # bound: stays, loaded or not
        nursery.cancel_scope.cancel()


async def test_finish_session_forgets_it_so_it_is_placed_again() -> None:
    async with trio.open_nursery() as nursery:
        c = await sticky_cluster(nursery)
        async with held(c, "a") as busy:
            other = next(s.url for s in c.decode if s.url != busy)
            resp = await c.client.post(c.url + "/finish_session", params={"session_id": "a"})
            assert resp.status_code == 200
            assert resp.json() == {"status": "ok", "session_id": "a"}
            assert (await send(c, "a"))[1] == other  # a new session again: the least loaded
            missing = await c.client.post(c.url + "/finish_session")
            assert missing.status_code == 400
        nursery.cancel_scope.cancel()


async def test_a_removed_server_hands_its_sessions_to_the_others() -> None:
    async with trio.open_nursery() as nursery:
        c = await sticky_cluster(nursery)
        _, home = await send(c, "a")
        other = next(s.url for s in c.decode if s.url != home)
        gone = await c.client.delete(f"{c.url}/workers/{quote(home, safe='')}?role=decode")
        assert gone.status_code == 200, gone.text
        assert (await send(c, "a"))[1] == other
        nursery.cancel_scope.cancel()

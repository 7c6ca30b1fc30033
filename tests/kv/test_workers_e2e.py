"""``--workers 2`` with KV events: the supervisor subscribes once per source and fans the frames
out; every worker's index equals each engine's blocks, a replacement worker converges by replay.

One simulator's engine binds its PUB (the router connects); the other's connects to an endpoint
the router binds (``bind:tcp://127.0.0.1:P``): two workers subscribing on their own could not
both bind it. ``GET /debug/kv-index`` names the process that answered (``pid``); with one
reuseport socket per worker, fresh connections reach both.
"""

from __future__ import annotations

import os
import signal
import socket
from typing import Any

import httpx
import trio

from tests.workers_harness import Supervised, start_supervisor, stop_supervisor
from trio_pdrouter_sim import SimConfig, SimServer

DOC = "A shared document for the KV events of a machine with two workers. " * 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def truth(client: httpx.AsyncClient, sims: list[SimServer]) -> dict[str, int]:
    out = {}
    for sim in sims:
        ranks = (await client.get(sim.url + "/sim/kv/events")).json()["ranks"]
        out[sim.url] = int(ranks[0]["blocks"])
    return out


async def converged(sup: Supervised, sims: list[SimServer]) -> dict[int, dict[str, Any]]:
    """Poll fresh connections (bounded) until every live worker's index is known and holds
    what each engine holds; the rows of each worker, by pid."""
    matched: dict[int, dict[str, Any]] = {}
    async with httpx.AsyncClient(timeout=10) as sims_client:
        for _ in range(600):
            held = await truth(sims_client, sims)
            async with httpx.AsyncClient(timeout=10) as client:  # a fresh connection each time
                answer = (await client.get(sup.url + "/debug/kv-index")).json()
            rows = {row["url"]: row for row in answer["engines"]}
            if all(rows[url]["known"] and rows[url]["blocks"] == n for url, n in held.items()):
                matched[answer["pid"]] = rows
            else:
                matched.pop(answer["pid"], None)
            if set(sup.pids.values()) <= set(matched):
                return matched
            await trio.sleep(0.05)  # a bound on the poll, not a synchronisation
    raise AssertionError(f"workers never converged: {matched.keys()} of {sup.pids}")


async def traffic(urls: list[str], n: int, tag: str) -> None:
    """``n`` prompts to each of ``urls`` (the router's, and the engines' own: traffic that
    reaches an engine another way is in its events too)."""
    async with httpx.AsyncClient(timeout=30) as client:
        for url in urls:
            for i in range(n):
                body = {"prompt": f"{url} {tag} " + DOC + f"question {i}", "max_tokens": 1}
                resp = await client.post(url + "/v1/completions", json=body)
                assert resp.status_code == 200, resp.text


async def test_each_worker_follows_a_bound_and_a_connected_source_a_replacement_too() -> None:
    async with trio.open_nursery() as nursery:
        port = free_port()  # the router binds it on 127.0.0.1; the first engine connects to it
        cache = {"prefix_cache_blocks": 64, "kv_replay_port": 0}
        connecting = SimServer(
            SimConfig.fast(port=0, kv_events_connect=f"tcp://127.0.0.1:{port}", **cache)
        )
        binding = SimServer(SimConfig.fast(port=0, kv_events_port=0, **cache))
        sims = [connecting, binding]
        for sim in sims:
            await nursery.start(sim.run)
        journals = [sim.state.kv_events for sim in sims]
        assert journals[0] is not None and journals[1] is not None
        args = [
            "--worker-urls",
            connecting.url,
            binding.url,
            "--policy",
            "kv_aware",
            "--worker-sockets",
            "reuseport",
            "--admin-from-loopback",  # /debug/kv-index
            "--kv-event-source",
            f"{connecting.url}=bind:tcp://127.0.0.1:{port}",
            "--kv-event-replay-source",
            f"{connecting.url}={journals[0].replay_endpoints[0]}",
            "--kv-event-source",
            f"{binding.url}={journals[1].endpoints[0]}",
            "--kv-event-replay-source",
            f"{binding.url}={journals[1].replay_endpoints[0]}",
        ]
        sup = await start_supervisor(nursery, 2, args)
        await sup.wait_for(lambda: len(sup.pids) == 2, 60)
        await traffic([sup.url, *(s.url for s in sims)], 6, "first")
        async with httpx.AsyncClient(timeout=10) as client:
            assert all(n > 0 for n in (await truth(client, sims)).values())
        before = await converged(sup, sims)
        assert len(before) == 2

        victim = sup.pids[0]
        os.kill(victim, signal.SIGKILL)
        await sup.wait_for(lambda: sup.pids[0] != victim, 60)
        # Live batches go on while the replacement replays.
        await traffic([sup.url, *(s.url for s in sims)], 3, "after")
        after = await converged(sup, sims)
        assert sup.pids[0] in after and victim not in after
        assert b"cannot attach" not in sup.log  # the bound endpoint: bound once, by the supervisor
        assert await stop_supervisor(sup) == 0
        nursery.cancel_scope.cancel()

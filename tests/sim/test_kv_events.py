"""The simulator publishes faithful KV events: per DP rank, replayable, consistent with
``/tokenize``; the router's index built from them equals the simulator's caches."""

from __future__ import annotations

from collections.abc import Callable

import trio

from tests.sim.test_http import running_sim
from trio_pdrouter.kv import EventSource, KvEvents, block_keys

BS = 16


async def until(check: Callable[[], bool]) -> None:
    for _ in range(500):
        if check():
            return
        await trio.sleep(0.01)
    raise AssertionError("condition never held")


def subscriber(rows: list[dict[str, object]], url: str) -> KvEvents:
    sources = [
        EventSource(url, int(str(r["rank"])), str(r["endpoint"]), str(r["replay_endpoint"]))
        for r in rows
    ]
    return KvEvents(
        sources, block_size=BS, weights={"GPU": 1.0}, budget=100_000, probe_interval_s=0.05
    )


async def test_the_index_equals_every_ranks_cache_and_tokenize_agrees() -> None:
    async with running_sim(
        dp_size=2, kv_events_port=0, kv_replay_port=0, prefix_cache_blocks=20
    ) as (sim, client):
        rows = (await client.get("/sim/kv/events")).json()["ranks"]
        events = subscriber(rows, sim.url)
        chat = [{"role": "user", "content": "tell me about prefix caches " * 8}]
        async with trio.open_nursery() as nursery:
            await nursery.start(events.run)
            for i in range(12):
                body = {"prompt": f"document {i % 5} " * 40, "max_tokens": 1}
                assert (await client.post("/v1/completions", json=body)).status_code == 200
            await client.post("/v1/chat/completions", json={"messages": chat, "max_tokens": 1})

            async def idle_equal() -> bool:
                truth = (await client.get("/sim/kv/events")).json()["ranks"]
                index = {r["rank"]: r for r in events.snapshot()}
                return all(
                    index[t["rank"]]["known"] and index[t["rank"]]["blocks"] == t["blocks"]
                    for t in truth
                )

            for _ in range(300):
                if await idle_equal():
                    break
                await trio.sleep(0.01)
            assert await idle_equal()
            tokens = (await client.post("/tokenize", json={"messages": chat})).json()["tokens"]
            keys = block_keys(tokens, BS)
            held = [events.feeds[(sim.url, r)].index.match(keys)[0] for r in (0, 1)]
            assert max(held) == len(keys) and min(held) == 0  # one rank holds the chat
            nursery.cancel_scope.cancel()


async def test_restart_and_drop_knobs() -> None:
    async with running_sim(kv_events_port=0, kv_replay_port=0) as (sim, client):
        rows = (await client.get("/sim/kv/events")).json()["ranks"]
        events = subscriber(rows, sim.url)
        async with trio.open_nursery() as nursery:
            await nursery.start(events.run)
            feed = events.feeds[(sim.url, 0)]
            await until(lambda: feed.known)
            await client.post("/v1/completions", json={"prompt": "a" * 200, "max_tokens": 1})
            await until(lambda: feed.last_seq == 0)
            await client.post("/sim/kv/events", json={"drop": 1})
            await client.post("/v1/completions", json={"prompt": "b" * 200, "max_tokens": 1})
            await client.post("/v1/completions", json={"prompt": "c" * 200, "max_tokens": 1})
            await until(lambda: feed.last_seq == 2 and feed.replays >= 1)
            assert feed.known and len(feed.index) == 3 * (200 // 4 // BS)
            await client.post("/sim/kv/events", json={"restart": True})
            await client.post("/v1/completions", json={"prompt": "d" * 200, "max_tokens": 1})
            await until(lambda: feed.restarts == 1 and feed.last_seq == 0)
            assert feed.known and len(feed.index) == 200 // 4 // BS
            nursery.cancel_scope.cancel()

"""``kv_aware`` end to end over 127.0.0.1: simulators publishing KV events, a router following
them, text and chat prompts credited through ``/tokenize``, loss falling back to the estimate."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio
from tokenizers import Tokenizer

from tests.cluster import eventually
from trio_pdrouter.config import KvEventSettings, RouterConfig, ServerSettings
from trio_pdrouter.server import RunningRouter, run_router
from trio_pdrouter_sim import SimConfig, SimServer
from trio_pdrouter_sim.tokenizer_files import write_model_dir

SIM = SimConfig.fast(port=0, kv_events_port=0, kv_replay_port=0, prefix_cache_blocks=64)


@attrs.frozen
class Rig:
    router: RunningRouter
    sims: list[SimServer]
    client: httpx.AsyncClient

    async def index(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = (
            await self.client.get(self.router.url + "/debug/kv-index")
        ).json()["engines"]
        return rows


@asynccontextmanager
async def rig(n: int = 2, sim: SimConfig = SIM, **router: Any) -> AsyncIterator[Rig]:
    async with trio.open_nursery() as nursery:
        sims = [SimServer(sim) for _ in range(n)]
        for sim in sims:
            await nursery.start(sim.run)
        sources, replays = [], []
        for sim in sims:
            assert sim.state.kv_events is not None
            sources.append(f"{sim.url}={sim.state.kv_events.endpoints[0]}")
            replays.append(f"{sim.url}={sim.state.kv_events.replay_endpoints[0]}")
        config = RouterConfig(
            worker_urls=tuple(s.url for s in sims),
            server=ServerSettings(host="127.0.0.1", port=0),
            prometheus_listener=False,
            policy="kv_aware",
            admin_from_loopback=True,  # /debug/kv-index
            expose_routing_headers=True,  # the tests read which engine served and its kv note
            kv_events=KvEventSettings(
                sources=tuple(sources),
                replay_sources=tuple(replays),
                block_size=16,
                tokenizer_path=router.pop("tokenizer_path", None),
                tokenize_cut_chars=router.pop("tokenize_cut_chars", 0),
            ),
            **router,
        )
        running: RunningRouter = await nursery.start(run_router, config)
        async with httpx.AsyncClient(timeout=10) as client:
            yield Rig(running, sims, client)
        nursery.cancel_scope.cancel()


async def served_by(r: Rig, path: str, body: dict[str, Any]) -> str:
    resp = await r.client.post(r.router.url + path, json={**body, "max_tokens": 1})
    assert resp.status_code == 200, resp.text
    return resp.headers["x-trio-pdrouter-worker"]


DOC = "A long shared document about prefix caching and routing. " * 20
CHAT = [{"role": "system", "content": DOC}, {"role": "user", "content": "q"}]


async def test_text_and_chat_prompts_follow_the_engine_that_holds_them() -> None:
    async with rig() as r:
        await eventually(lambda: _all_known(r))
        first = await served_by(r, "/v1/completions", {"prompt": DOC + "first"})
        await eventually(lambda: _blocks_somewhere(r))
        for i in range(6):
            assert await served_by(r, "/v1/completions", {"prompt": DOC + f"q{i}"}) == first
        chat_first = await served_by(r, "/v1/chat/completions", {"messages": CHAT})
        await eventually(lambda: _blocks_somewhere(r))
        for i in range(4):
            again = [*CHAT[:1], {"role": "user", "content": f"q{i}"}]
            assert await served_by(r, "/v1/chat/completions", {"messages": again}) == chat_first
        resp = await r.client.post(
            r.router.url + "/v1/completions", json={"prompt": DOC + "last", "max_tokens": 1}
        )
        matched, total = resp.headers["x-trio-pdrouter-kv"].removesuffix(";known").split("/")
        assert int(total) == len(DOC + "last") // 4 // 16 and int(matched) >= int(total) - 1
        metrics = (await r.client.get(r.router.url + "/metrics")).text
        hits = [line for line in metrics.splitlines() if 'reason="kv_hit"' in line]
        assert hits and float(hits[0].rsplit(" ", 1)[1]) >= 10  # credited from the events
        # The forecast of the engine that served them: complete (the router sent all it
        # computed), holding at least the blocks credited.
        rows = {row["url"]: row for row in await r.index()}
        forecast = rows[first]["forecast"]["regular"]
        assert forecast["complete"] and forecast["foreign_share"] == 0.0
        assert forecast["held"] >= int(matched) and not forecast["learnt"]


async def test_a_local_tokenizer_credits_text_and_chat_without_tokenize_calls(
    tmp_path: Path,
) -> None:
    model = write_model_dir(tmp_path / "model", [DOC, "q0 q1 q2 q3 first last"])
    sim = attrs.evolve(SIM, tokenizer=str(model / "tokenizer.json"))
    async with rig(sim=sim, tokenizer_path=str(model)) as r:
        await eventually(lambda: _all_known(r))
        first = await served_by(r, "/v1/completions", {"prompt": DOC + "first"})
        await eventually(lambda: _blocks_somewhere(r))
        for i in range(4):
            assert await served_by(r, "/v1/completions", {"prompt": DOC + f"q{i}"}) == first
        resp = await r.client.post(
            r.router.url + "/v1/completions", json={"prompt": DOC + "last", "max_tokens": 1}
        )
        matched, total = resp.headers["x-trio-pdrouter-kv"].removesuffix(";known").split("/")
        assert int(total) > 0 and int(matched) >= int(total) - 1
        chat_first = await served_by(r, "/v1/chat/completions", {"messages": CHAT})
        await eventually(lambda: _blocks_somewhere(r))
        for i in range(3):
            again = [*CHAT[:1], {"role": "user", "content": f"q{i}"}]
            assert await served_by(r, "/v1/chat/completions", {"messages": again}) == chat_first
        for s in r.sims:
            stats = (await r.client.get(s.url + "/sim/stats")).json()
            assert stats["received"].get("/tokenize", 0) == 0


async def test_a_local_tokenizer_stitches_shared_starts_and_credits_every_block(
    tmp_path: Path,
) -> None:
    model = write_model_dir(tmp_path / "model", [DOC, "q0 q1 q2 q3 first last"])
    sim = attrs.evolve(SIM, tokenizer=str(model / "tokenizer.json"))
    engine = Tokenizer.from_file(str(model / "tokenizer.json"))
    async with rig(sim=sim, tokenizer_path=str(model), tokenize_cut_chars=32) as r:
        await eventually(lambda: _all_known(r))
        first = await served_by(r, "/v1/completions", {"prompt": DOC + "first"})
        await eventually(lambda: _blocks_somewhere(r))
        for i in range(4):
            prompt = DOC + f"q{i} and the rest of a question"
            resp = await r.client.post(
                r.router.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}
            )
            assert resp.headers["x-trio-pdrouter-worker"] == first
            # Every block of the whole prompt counted (the engine's own ids), the document's
            # all credited.
            matched, total = resp.headers["x-trio-pdrouter-kv"].removesuffix(";known").split("/")
            assert int(total) == len(engine.encode(prompt).ids) // 16
            assert int(matched) >= len(engine.encode(DOC).ids) // 16 - 1
        metrics = (await r.client.get(r.router.url + "/metrics")).text
        assert 'trio_pdrouter_kv_tokenize_total{outcome="local"} 1.0' in metrics
        assert 'trio_pdrouter_kv_tokenize_total{outcome="stitched"} 4.0' in metrics
        for s in r.sims:
            stats = (await r.client.get(s.url + "/sim/stats")).json()
            assert stats["received"].get("/tokenize", 0) == 0


async def test_token_id_prompts_need_no_tokenize_call() -> None:
    async with rig() as r:
        await eventually(lambda: _all_known(r))
        prompt = list(range(1000, 1200))
        first = await served_by(r, "/v1/completions", {"prompt": prompt})
        await eventually(lambda: _blocks_somewhere(r))
        for _ in range(4):
            assert await served_by(r, "/v1/completions", {"prompt": prompt}) == first


async def test_a_restarted_engine_loses_its_credit_and_idle_counts_match() -> None:
    async with rig() as r:
        await eventually(lambda: _all_known(r))
        first = await served_by(r, "/v1/completions", {"prompt": DOC})
        holder = next(s for s in r.sims if s.url == first)
        await r.client.post(holder.url + "/sim/kv/events", json={"restart": True})
        # The next batch from the restarted engine (seq 0 again) clears its index.
        await r.client.post(holder.url + "/v1/completions", json={"prompt": "x" * 100})

        async def cleared() -> bool:
            rows = {row["url"]: row for row in await r.index()}
            return bool(rows[first]["restarts"] == 1 and rows[first]["blocks"] == 1)

        await eventually(cleared)
        for sim in r.sims:  # idle: the index holds what each engine holds
            truth = (await r.client.get(sim.url + "/sim/kv/events")).json()["ranks"][0]
            row = next(row for row in await r.index() if row["url"] == sim.url)
            assert row["known"] and row["blocks"] == truth["blocks"]


async def _all_known(r: Rig) -> bool:
    return all(row["known"] for row in await r.index())


async def _blocks_somewhere(r: Rig) -> bool:
    return any(row["blocks"] > 0 for row in await r.index())


async def test_prompts_sharing_a_long_start_ask_for_its_ids_once() -> None:
    async with rig(tokenize_cut_chars=32) as r:
        await eventually(lambda: _all_known(r))
        first = await served_by(r, "/v1/completions", {"prompt": DOC + "first"})
        await eventually(lambda: _blocks_somewhere(r))
        notes = []
        for i in range(6):
            resp = await r.client.post(
                r.router.url + "/v1/completions", json={"prompt": DOC + f"q{i}", "max_tokens": 1}
            )
            assert resp.headers["x-trio-pdrouter-worker"] == first
            notes.append(resp.headers["x-trio-pdrouter-kv"])
        # The first prompt whole; then the document, once, for all that follow.
        asked = 0
        for s in r.sims:
            asked += (await r.client.get(s.url + "/sim/stats")).json()["received"]["/tokenize"]
        assert asked == 2
        metrics = (await r.client.get(r.router.url + "/metrics")).text
        assert 'trio_pdrouter_kv_tokenize_total{outcome="engine"} 2.0' in metrics
        assert 'trio_pdrouter_kv_tokenize_total{outcome="cached"} 5.0' in metrics
        # Credited from the index all the same: all but the blocks past the cut's margin.
        total = (len(DOC) + 2) // 4 // 16
        assert all(n.endswith(";known") and n.split("/")[1] == f"{total};known" for n in notes)
        assert all(int(n.split("/")[0]) >= total - 1 for n in notes)

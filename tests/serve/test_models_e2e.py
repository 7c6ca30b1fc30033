"""Several models and LoRA adapters behind one router, against real simulators on 127.0.0.1:
each request goes only to servers that serve its model (in PD mode both legs), a model nobody
serves is answered 404 by the router, adapters are loaded and unloaded through the router."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import httpx
import trio

from tests.cluster import eventually
from tests.workers_harness import start_supervisor, stop_supervisor
from trio_pdrouter.config import HealthSettings, RouterConfig, ServerSettings
from trio_pdrouter.server import RunningRouter, run_router
from trio_pdrouter_sim.config import SimConfig
from trio_pdrouter_sim.server import SimServer

FAST = SimConfig.fast(port=0)
GENERATION = ("/v1/completions", "/v1/chat/completions")


@attrs.define
class Fleet:
    """The router and its simulators, by model."""

    router: RunningRouter
    sims: dict[str, list[SimServer]]
    client: httpx.AsyncClient

    async def received(self, sim: SimServer) -> dict[str, int]:
        """Requests the simulator received per path (whatever it answered)."""
        stats = (await self.client.get(sim.url + "/sim/stats")).json()
        received: dict[str, int] = stats["received"]
        return received

    async def generations(self, sim: SimServer) -> int:
        received = await self.received(sim)
        return sum(received.get(path, 0) for path in GENERATION)


async def start(
    nursery: trio.Nursery,
    servers: Sequence[tuple[str, str, tuple[str, ...]]],
    **router: Any,
) -> Fleet:
    """Simulators given as (model, role, adapters) and a router over them (PD when any role is
    prefill); waits until the router has read every server's model list."""
    sims: dict[str, list[SimServer]] = {}
    roles: dict[str, list[str]] = {}
    for model, role, adapters in servers:
        sim = SimServer(attrs.evolve(FAST, model=model, role=role, lora_modules=adapters))
        await nursery.start(sim.run)
        sims.setdefault(model, []).append(sim)
        roles.setdefault(role, []).append(sim.url)
    pd = "prefill" in roles
    if pd:
        router.setdefault("prefill_urls", tuple(roles["prefill"]))
        router.setdefault("decode_urls", tuple(roles["decode"]))
    else:
        router.setdefault("worker_urls", tuple(roles["both"]))
    router.setdefault("policy", "round_robin")
    router.setdefault("prometheus_listener", False)
    router.setdefault("admin_from_loopback", True)
    config = RouterConfig(pd=pd, server=ServerSettings(host="127.0.0.1", port=0), **router)
    running: RunningRouter = await nursery.start(run_router, config)
    await running.app.models.learn_due()  # what its loop does first; done here to know it is done
    assert running.app.models.unknown() == []
    client = httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=64))
    return Fleet(running, sims, client)


async def generate_many(f: Fleet, bodies: Sequence[dict[str, Any]], route: str) -> list[int]:
    """POST every body (16 at a time); their statuses."""
    statuses: list[int] = []
    limit = trio.CapacityLimiter(16)

    async def one(body: dict[str, Any]) -> None:
        async with limit:
            resp = await f.client.post(f.router.url + route, json=body)
            statuses.append(resp.status_code)

    async with trio.open_nursery() as nursery:
        for body in bodies:
            nursery.start_soon(one, body)
    return statuses


def completion(model: str, i: int = 0, **more: Any) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": f"Request {i}: tell me a story. " * 4,
        "max_tokens": 4,
        **more,
    }


TWO_MODELS_PD = [
    ("alpha", "prefill", ()),
    ("alpha", "decode", ()),
    ("beta", "prefill", ()),
    ("beta", "decode", ()),
]


async def test_two_models_in_pd_mode_every_stream_succeeds_on_its_own_servers() -> None:
    async with trio.open_nursery() as nursery:
        f = await start(nursery, TWO_MODELS_PD)
        bodies = [
            completion("alpha" if i % 2 else "beta", i, stream=True, priority=0) for i in range(200)
        ]
        statuses = await generate_many(f, bodies, "/v1/completions")
        assert statuses == [200] * 200
        for model in ("alpha", "beta"):
            prefill, decode = f.sims[model]
            # both legs of each of its 100 requests on its own servers, none elsewhere
            assert await f.generations(prefill) == 100
            assert await f.generations(decode) == 100
        assert f.router.ledger.total() == 0
        nursery.cancel_scope.cancel()


async def test_two_models_and_an_adapter_in_regular_mode() -> None:
    servers = [("alpha", "both", ("sql-lora=/adapters/sql",)), ("beta", "both", ())]
    async with trio.open_nursery() as nursery:
        f = await start(nursery, servers)
        names = ["alpha", "beta", "sql-lora"]
        bodies = [completion(names[i % 3], i) for i in range(60)]
        chats = [
            {"model": names[i % 3], "messages": [{"role": "user", "content": f"hi {i}"}]}
            for i in range(30)
        ]
        assert await generate_many(f, bodies, "/v1/completions") == [200] * 60
        assert await generate_many(f, chats, "/v1/chat/completions") == [200] * 30
        (alpha,), (beta,) = f.sims["alpha"], f.sims["beta"]
        assert await f.generations(alpha) == 60  # alpha and its adapter
        assert await f.generations(beta) == 30
        resp = await f.client.post(f.router.url + "/v1/completions", json=completion("sql-lora"))
        assert resp.json()["model"] == "sql-lora"  # the engine answers for the adapter
        nursery.cancel_scope.cancel()


async def test_a_model_no_server_serves_is_answered_404_by_the_router() -> None:
    async with trio.open_nursery() as nursery:
        f = await start(nursery, TWO_MODELS_PD)
        for route in GENERATION:
            body = (
                completion("gamma")
                if route == "/v1/completions"
                else {"model": "gamma", "messages": [{"role": "user", "content": "hi"}]}
            )
            resp = await f.client.post(f.router.url + route, json=body)
            assert resp.status_code == 404
            assert resp.json() == {
                "error": {
                    "message": "The model `gamma` does not exist.",
                    "type": "NotFoundError",
                    "param": "model",
                    "code": 404,
                }
            }
        for sims in f.sims.values():
            for sim in sims:
                assert await f.generations(sim) == 0  # no engine touched
        assert f.router.ledger.total() == 0
        # a request naming no model still goes anywhere (the behaviour without models)
        body = {"prompt": "no model named", "max_tokens": 2}
        resp = await f.client.post(f.router.url + "/v1/completions", json=body)
        assert resp.status_code == 200
        metrics = (await f.client.get(f.router.url + "/metrics")).text
        assert (
            'trio_pdrouter_model_requests_total{model="unknown",outcome="unknown_model"} 2.0'
            in (metrics)
        )
        assert 'trio_pdrouter_model_requests_total{model="none",outcome="ok"} 1.0' in metrics
        assert "trio_pdrouter_servers_models_unknown 0.0" in metrics
        nursery.cancel_scope.cancel()


async def test_the_model_list_is_the_union_and_workers_show_what_each_serves() -> None:
    servers = [("alpha", "both", ("sql-lora=/adapters/sql",)), ("beta", "both", ())]
    async with trio.open_nursery() as nursery:
        f = await start(nursery, servers)
        listed = (await f.client.get(f.router.url + "/v1/models")).json()
        assert listed["object"] == "list"
        cards = {card["id"]: card for card in listed["data"]}
        assert set(cards) == {"alpha", "beta", "sql-lora"}
        assert cards["sql-lora"]["parent"] == "alpha" and cards["sql-lora"]["root"] == (
            "/adapters/sql"
        )
        assert cards["beta"]["max_model_len"] == FAST.max_model_len
        workers = (await f.client.get(f.router.url + "/workers")).json()["workers"]
        shown = {w["url"]: (w["models"], w["adapters"]) for w in workers}
        assert shown == {
            f.sims["alpha"][0].url: (["alpha"], {"sql-lora": "alpha"}),
            f.sims["beta"][0].url: (["beta"], {}),
        }
        # per-model metrics: a request of each, counted under its model
        for model in ("alpha", "sql-lora"):
            resp = await f.client.post(f.router.url + "/v1/completions", json=completion(model))
            assert resp.status_code == 200
        metrics = (await f.client.get(f.router.url + "/metrics")).text
        assert 'trio_pdrouter_model_requests_total{model="sql-lora",outcome="ok"} 1.0' in metrics
        assert 'trio_pdrouter_model_tokens_total{kind="completion",model="alpha"} 4.0' in metrics
        nursery.cancel_scope.cancel()


async def test_adapters_loaded_and_unloaded_through_the_router_are_routed_to_and_away() -> None:
    servers = [("alpha", "prefill", ()), ("alpha", "decode", ()), ("beta", "prefill", ())]
    servers += [("beta", "decode", ())]
    async with trio.open_nursery() as nursery:
        f = await start(nursery, servers, models_refresh_interval=0)
        url = f.router.url
        before = await f.client.post(url + "/v1/completions", json=completion("sql-lora"))
        assert before.status_code == 404
        load = {"lora_name": "sql-lora", "lora_path": "/adapters/sql", "base_model": "alpha"}
        resp = await f.client.post(url + "/v1/load_lora_adapter", json=load)
        assert resp.status_code == 200
        assert resp.text == "Success: LoRA adapter 'sql-lora' added successfully."
        for sim in f.sims["alpha"]:  # both legs' servers of its base model, and only those
            assert (await f.received(sim)).get("/v1/load_lora_adapter") == 1
        for sim in f.sims["beta"]:
            assert (await f.received(sim)).get("/v1/load_lora_adapter") is None
        # routed to at once: the router relearnt before it answered
        bodies = [completion("sql-lora", i, stream=True) for i in range(20)]
        assert await generate_many(f, bodies, "/v1/completions") == [200] * 20
        assert [await f.generations(sim) for sim in f.sims["alpha"]] == [20, 20]
        assert [await f.generations(sim) for sim in f.sims["beta"]] == [0, 0]
        unknown_base = {**load, "base_model": "gamma"}
        resp = await f.client.post(url + "/v1/load_lora_adapter", json=unknown_base)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "base_model"
        again = await f.client.post(url + "/v1/load_lora_adapter", json=load)
        assert again.status_code == 400  # the engine's answer: already loaded
        assert "has already been loaded" in again.json()["error"]["message"]

        resp = await f.client.post(url + "/v1/unload_lora_adapter", json={"lora_name": "sql-lora"})
        assert resp.status_code == 200
        assert resp.text == "Success: LoRA adapter 'sql-lora' removed successfully."
        after = await f.client.post(url + "/v1/completions", json=completion("sql-lora"))
        assert after.status_code == 404
        assert after.json()["error"]["message"] == "The model `sql-lora` does not exist."
        assert [await f.generations(sim) for sim in f.sims["alpha"]] == [20, 20]  # not reached
        nursery.cancel_scope.cancel()


async def test_the_adapter_routes_are_admin_routes() -> None:
    async with trio.open_nursery() as nursery:
        f = await start(nursery, [("alpha", "both", ())], admin_from_loopback=False)
        load = {"lora_name": "x", "lora_path": "/x"}
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            resp = await f.client.post(f.router.url + path, json=load)
            assert resp.status_code == 403
        assert (await f.received(f.sims["alpha"][0])).get("/v1/load_lora_adapter") is None
        nursery.cancel_scope.cancel()


async def test_a_server_is_asked_again_when_it_recovers() -> None:
    health = HealthSettings(
        interval_secs=0.05, timeout_secs=2.0, failure_threshold=1, success_threshold=1
    )
    async with trio.open_nursery() as nursery:
        f = await start(nursery, [("alpha", "both", ())], models_refresh_interval=0, health=health)
        (sim,) = f.sims["alpha"]
        # loaded behind the router's back: it does not know until it asks again
        load = {"lora_name": "late-lora", "lora_path": "/late"}
        assert (await f.client.post(sim.url + "/v1/load_lora_adapter", json=load)).is_success
        models = f.router.app.models
        assert "late-lora" not in models.served_ids()
        sim.down()
        await sim.wait_down()

        async def unhealthy() -> bool:
            return f.router.app.fleet.health(sim.url) == "unhealthy"

        await eventually(unhealthy)
        assert "late-lora" not in models.served_ids()  # not asked while down
        sim.up()

        async def learnt() -> bool:
            return "late-lora" in models.served_ids()

        await eventually(learnt)
        resp = await f.client.post(f.router.url + "/v1/completions", json=completion("late-lora"))
        assert resp.status_code == 200
        nursery.cancel_scope.cancel()


async def test_with_workers_an_adapter_loaded_through_one_worker_is_served_by_all() -> None:
    """The worker that passed the load relearnt at once; the others ask again before they
    would answer 404 (their schedule is 30 s away)."""
    async with trio.open_nursery() as nursery:
        sims = [SimServer(attrs.evolve(FAST, model="alpha")) for _ in range(2)]
        for sim in sims:
            await nursery.start(sim.run)
        urls = [sim.url for sim in sims]
        args = ["--worker-urls", *urls, "--policy", "round_robin", "--admin-from-loopback"]
        sup = await start_supervisor(nursery, 2, args)
        await sup.wait_for(lambda: len(sup.pids) == 2, 60)
        knowing: set[int] = set()
        with trio.fail_after(30):
            while len(knowing) < 2:  # fresh connections until both workers have read the lists
                async with httpx.AsyncClient(timeout=10) as fresh:
                    pid = (await fresh.get(sup.url + "/debug/kv-index")).json()["pid"]
                    workers = (await fresh.get(sup.url + "/workers")).json()["workers"]
                    if all(w["models"] == ["alpha"] for w in workers):
                        knowing.add(pid)
                    else:
                        await trio.sleep(0.05)  # polling another process: no event to wait on
        async with httpx.AsyncClient(timeout=10) as client:
            load = {"lora_name": "sql-lora", "lora_path": "/adapters/sql"}
            resp = await client.post(sup.url + "/v1/load_lora_adapter", json=load)
            assert resp.status_code == 200
        pids: set[int] = set()
        for i in range(24):  # fresh connections: the kernel spreads them over the workers
            async with httpx.AsyncClient(timeout=10) as fresh:
                resp = await fresh.get(sup.url + "/debug/kv-index")
                pids.add(resp.json()["pid"])
                resp = await fresh.post(sup.url + "/v1/completions", json=completion("sql-lora", i))
                assert resp.status_code == 200, resp.text
        assert len(pids) == 2  # both workers answered
        assert await stop_supervisor(sup) == 0
        nursery.cancel_scope.cancel()

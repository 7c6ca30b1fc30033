"""Each fault kind, through each entrance (flag, header, POST /sim/faults), and server down."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio

from trio_pdrouter_sim import SimConfig, SimServer

PREFILL_KV = {"do_remote_decode": True, "do_remote_prefill": False}
CLIENT_ERRORS = (httpx.RemoteProtocolError, httpx.ReadError)


@asynccontextmanager
async def running_sim(**overrides: Any) -> AsyncIterator[tuple[SimServer, httpx.AsyncClient]]:
    overrides.setdefault("port", 0)
    sim = SimServer(SimConfig.fast(**overrides))
    async with trio.open_nursery() as nursery:
        url = await nursery.start(sim.run)
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            yield sim, client
        nursery.cancel_scope.cancel()


async def totals(url: str) -> dict[str, Any]:
    # A fresh client: the test's client may hold a connection the fault just broke.
    async with httpx.AsyncClient(base_url=url) as c:
        result: dict[str, Any] = (await c.get("/sim/stats")).json()["totals"]
        return result


async def wait_totals(url: str, cond: Callable[[dict[str, Any]], bool]) -> None:
    with trio.fail_after(5):
        while True:
            if cond(await totals(url)):
                return
            await trio.sleep(0.01)


@pytest.mark.parametrize("status", [500, 503, 429])
async def test_error_status_via_header(status: int) -> None:
    async with running_sim() as (_sim, client):
        resp = await client.post(
            "/v1/completions", json={"prompt": "x"}, headers={"x-sim-fault": f"error:{status}"}
        )
        assert resp.status_code == status
        err = resp.json()["error"]
        assert err["code"] == status and set(err) == {"message", "type", "param", "code"}


async def test_error_restricted_to_role_via_flag() -> None:
    async with running_sim(faults=("error:503@prefill",)) as (_sim, client):
        ok = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert ok.status_code == 200
        bad = await client.post(
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 1, "kv_transfer_params": PREFILL_KV},
        )
        assert bad.status_code == 503


async def test_armed_faults_count_and_delete() -> None:
    async with running_sim() as (_sim, client):
        resp = await client.post("/sim/faults", json={"spec": "error:429", "count": 2})
        assert resp.status_code == 200
        codes = [
            (
                await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
            ).status_code
            for _ in range(3)
        ]
        assert codes == [429, 429, 200]
        await client.post("/sim/faults", json={"spec": "error:500", "count": None})
        assert (await client.post("/v1/completions", json={"prompt": "x"})).status_code == 500
        assert (await client.get("/sim/faults")).json()["armed"] == "error:500"
        await client.delete("/sim/faults")
        assert (await client.post("/v1/completions", json={"prompt": "x"})).status_code == 200
        assert (await client.post("/sim/faults", json={"spec": "nope"})).status_code == 400


async def test_reset_on_arrival_gives_no_response() -> None:
    async with running_sim() as (sim, client):
        for stream in (False, True):
            with pytest.raises(CLIENT_ERRORS):
                await client.post(
                    "/v1/completions",
                    json={"prompt": "x", "stream": stream},
                    headers={"x-sim-fault": "reset"},
                )
        assert (await totals(sim.url))["requests"] == 0


async def test_reset_mid_stream_truncates() -> None:
    async with running_sim() as (sim, client):
        events: list[str] = []
        with pytest.raises(CLIENT_ERRORS):
            async with client.stream(
                "POST",
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 10,
                    "stream": True,
                },
                headers={"x-sim-fault": "reset:3"},
            ) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line:
                        events.append(line)
        # the role delta and three tokens arrived; no [DONE]
        assert len(events) == 4 and "[DONE]" not in events[-1]
        await wait_totals(sim.url, lambda t: t["aborted"] == 1 and t["running"] == 0)


async def test_reset_after_last_token_drops_done() -> None:
    async with running_sim() as (_sim, client):
        with pytest.raises(CLIENT_ERRORS):
            await client.post(
                "/v1/completions",
                json={"prompt": "x", "max_tokens": 2, "stream": True},
                headers={"x-sim-fault": "reset:2"},
            )


async def test_reset_non_stream_after_tokens() -> None:
    async with running_sim() as (sim, client):
        with pytest.raises(CLIENT_ERRORS):
            await client.post(
                "/v1/completions",
                json={"prompt": "x", "max_tokens": 5},
                headers={"x-sim-fault": "reset:2"},
            )
        await wait_totals(sim.url, lambda t: t["aborted"] == 1 and t["running"] == 0)
        assert (await totals(sim.url))["generation_tokens"] == 2


async def test_reset_prefill_leg_via_armed_fault() -> None:
    async with running_sim() as (_sim, client):
        await client.post("/sim/faults", json={"spec": "reset@prefill", "count": 1})
        with pytest.raises(CLIENT_ERRORS):
            await client.post(
                "/v1/completions", json={"prompt": "x", "kv_transfer_params": PREFILL_KV}
            )
        ok = await client.post(
            "/v1/completions", json={"prompt": "x", "kv_transfer_params": PREFILL_KV}
        )
        assert ok.json()["kv_transfer_params"]["do_remote_prefill"] is True


async def test_stall_mid_stream_until_disconnect() -> None:
    async with running_sim() as (sim, client):
        async with client.stream(
            "POST",
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 5, "stream": True},
            headers={"x-sim-fault": "stall:2"},
        ) as resp:
            seen = 0
            async for line in resp.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 2:
                    break
            t = await totals(sim.url)
            assert t["running"] == 1 and t["generation_tokens"] == 2
        await wait_totals(sim.url, lambda t: t["aborted"] == 1 and t["running"] == 0)


async def test_stall_before_first_token_for_a_while() -> None:
    async with running_sim() as (_sim, client):
        start = trio.current_time()
        resp = await client.post(
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 2},
            headers={"x-sim-fault": "stall:0:0.2"},
        )
        assert resp.status_code == 200 and trio.current_time() - start >= 0.2


async def test_slow_prefill() -> None:
    async with running_sim() as (_sim, client):
        start = trio.current_time()
        resp = await client.post(
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 1},
            headers={"x-sim-fault": "slow-prefill:0.2"},
        )
        assert resp.status_code == 200 and trio.current_time() - start >= 0.2
        start = trio.current_time()
        await client.post(
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 1},
            headers={"x-sim-fault": "slow-prefill:0.2~0"},
        )
        assert trio.current_time() - start < 0.2


async def test_down_refuses_connections_until_up() -> None:
    async with running_sim() as (sim, client):
        assert (await client.post("/sim/down", json={})).json()["ok"] is True
        with trio.fail_after(5):
            await sim.wait_down()
        async with httpx.AsyncClient(base_url=sim.url) as fresh:
            with pytest.raises(httpx.ConnectError):
                await fresh.get("/health")
            sim.up()
            with trio.fail_after(5):
                await sim.wait_up()
            assert (await fresh.get("/health")).status_code == 200


async def test_down_cuts_in_flight_and_comes_back_after_seconds() -> None:
    async with running_sim() as (sim, client):
        async with trio.open_nursery() as nursery:

            async def stalled_stream() -> None:
                with pytest.raises(CLIENT_ERRORS):
                    await client.post(
                        "/v1/completions",
                        json={"prompt": "x", "stream": True},
                        headers={"x-sim-fault": "stall"},
                    )

            nursery.start_soon(stalled_stream)
            await wait_totals(sim.url, lambda t: t["running"] == 1)
            async with httpx.AsyncClient(base_url=sim.url) as other:
                await other.post("/sim/down", json={"seconds": 0.05})
            with trio.fail_after(5):
                await sim.wait_down()
        # the in-flight stream was cut, as a crashed server would cut it
        assert sim.state.stats()["totals"]["aborted"] == 1
        with trio.fail_after(5):
            await sim.wait_up()
        async with httpx.AsyncClient(base_url=sim.url) as fresh:
            assert (await fresh.get("/health")).status_code == 200

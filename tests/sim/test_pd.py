"""NIXL prefill/decode between two simulators: pull, missing params, leaks, stop tokens."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import trio

from trio_pdrouter_sim import SimConfig, SimServer, serve_sim

PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
PROMPT = "Tell me a story about a simulator. " * 4


@asynccontextmanager
async def pd_pair(
    prefill: dict[str, Any] | None = None, decode: dict[str, Any] | None = None
) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    """A prefill and a decode simulator (fast timings) with a client each."""
    async with trio.open_nursery() as nursery:
        p_url = await nursery.start(
            serve_sim, SimConfig.fast(port=0, role="prefill", **(prefill or {}))
        )
        d_url = await nursery.start(
            serve_sim, SimConfig.fast(port=0, role="decode", **(decode or {}))
        )
        async with (
            httpx.AsyncClient(base_url=p_url, timeout=10) as p,
            httpx.AsyncClient(base_url=d_url, timeout=10) as d,
        ):
            yield p, d
        nursery.cancel_scope.cancel()


async def totals(client: httpx.AsyncClient) -> dict[str, Any]:
    result: dict[str, Any] = (await client.get("/sim/stats")).json()["totals"]
    return result


async def wait_totals(client: httpx.AsyncClient, cond: Callable[[dict[str, Any]], bool]) -> None:
    with trio.fail_after(5):
        while True:
            if cond(await totals(client)):
                return
            await trio.sleep(0.01)


async def prefill_leg(p: httpx.AsyncClient, path: str = "/v1/completions") -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_PARAMS}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    resp = await p.post(path, json=body)
    assert resp.status_code == 200
    doc: dict[str, Any] = resp.json()
    return doc


async def test_prefill_then_decode_pulls_kv() -> None:
    async with pd_pair() as (p, d):
        doc = await prefill_leg(p)
        assert doc["usage"]["completion_tokens"] == 1
        assert doc["choices"][0]["finish_reason"] == "length"
        kv = doc["kv_transfer_params"]
        assert set(kv) == {
            "do_remote_prefill",
            "do_remote_decode",
            "remote_engine_id",
            "remote_block_ids",
            "remote_host",
            "remote_port",
            "remote_request_id",
            "tp_size",
        }
        assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
        assert f"http://{kv['remote_host']}:{kv['remote_port']}" == str(p.base_url).rstrip("/")
        n_blocks = len(kv["remote_block_ids"])
        assert n_blocks == -(-doc["usage"]["prompt_tokens"] // 16)
        assert (await totals(p))["kv_blocks_held"] == n_blocks

        resp = await d.post(
            "/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 5, "stream": True, "kv_transfer_params": kv},
        )
        assert resp.text.endswith("data: [DONE]\n\n")
        dt = await totals(d)
        assert (dt["pd_ok"], dt["pd_missing"], dt["completed"]) == (1, 0, 1)
        pt = await totals(p)
        assert (pt["kv_blocks_held"], pt["kv_blocks_leaked"], pt["completed"]) == (0, 0, 1)

        # The same params again: the blocks are gone, so decode prefills itself, and the
        # prefill counts a second pull of blocks it let go of.
        await d.post("/v1/completions", json={"prompt": PROMPT, "kv_transfer_params": kv})
        assert (await totals(d))["pd_missing"] == 1
        pt = await totals(p)
        assert (pt["kv_second_pulls"], pt["kv_blocks_freed"]) == (1, 0)


async def decode_stream_until_head(
    d: httpx.AsyncClient, kv: dict[str, Any], headers: dict[str, str] | None = None
) -> None:
    """Send a streaming decode leg and leave as soon as its head arrived (the connection is
    closed: the simulator aborts the request)."""
    body = {"prompt": PROMPT, "max_tokens": 5, "stream": True, "kv_transfer_params": kv}
    async with d.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
        assert resp.status_code == 200


async def test_a_decode_aborted_before_it_is_scheduled_frees_the_prefill_blocks() -> None:
    # One slot, taken by a long request: the decode leg waits to be scheduled, gets its head
    # (vLLM sends it before the engine has the request) and is aborted there.
    async with pd_pair(decode={"max_num_seqs": 1, "itl_base_s": 0.05}) as (p, d):
        kv = (await prefill_leg(p))["kv_transfer_params"]
        async with trio.open_nursery() as nursery:
            long = {"prompt": PROMPT, "max_tokens": 40, "stream": False}
            nursery.start_soon(partial(d.post, "/v1/completions", json=long))
            await wait_totals(d, lambda t: t["running"] == 1)
            await decode_stream_until_head(d, kv)
            await wait_totals(p, lambda t: t["kv_blocks_held"] == 0)
            nursery.cancel_scope.cancel()
        pt = await totals(p)
        assert pt["kv_blocks_freed"] == len(kv["remote_block_ids"])
        assert (pt["kv_blocks_leaked"], pt["kv_second_pulls"]) == (0, 0)
        # A reclaim now, as a router that thought it still owned the blocks would send, is a
        # second pull.
        await d.post("/v1/completions", json={"prompt": PROMPT, "kv_transfer_params": kv})
        assert (await totals(p))["kv_second_pulls"] == 1


async def test_a_decode_aborted_while_reading_lets_the_read_free_the_blocks() -> None:
    async with pd_pair(decode={"kv_transfer_s": 5}) as (p, d):
        kv = (await prefill_leg(p))["kv_transfer_params"]
        body = {"prompt": PROMPT, "max_tokens": 5, "stream": True, "kv_transfer_params": kv}
        async with d.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            await wait_totals(d, lambda t: t["pd_ok"] == 1)  # the read is under way: leave
        await wait_totals(d, lambda t: t["aborted"] == 1)
        pt = await totals(p)
        assert (pt["kv_blocks_held"], pt["kv_blocks_freed"], pt["kv_second_pulls"]) == (0, 0, 0)
        assert (await totals(d))["pd_ok"] == 1


async def test_the_first_output_comes_a_kv_transfer_after_the_head() -> None:
    async with pd_pair(decode={"kv_transfer_s": 0.2}) as (p, d):
        kv = (await prefill_leg(p))["kv_transfer_params"]
        body = {"prompt": PROMPT, "max_tokens": 2, "stream": True, "kv_transfer_params": kv}
        async with d.stream("POST", "/v1/completions", json=body) as resp:
            head_at = trio.current_time()
            async for _chunk in resp.aiter_bytes():
                break
            assert trio.current_time() - head_at >= 0.2


async def test_chat_prefill_leg_has_kv_params() -> None:
    async with pd_pair() as (p, d):
        doc = await prefill_leg(p, "/v1/chat/completions")
        assert doc["object"] == "chat.completion"
        kv = doc["kv_transfer_params"]
        resp = await d.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": PROMPT}], "kv_transfer_params": kv},
        )
        assert resp.status_code == 200
        assert (await totals(d))["pd_ok"] == 1


async def test_decode_without_params_is_pd_missing() -> None:
    async with pd_pair() as (_p, d):
        await d.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        bad = {"do_remote_prefill": True, "remote_host": None}
        await d.post(
            "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": bad}
        )
        t = await totals(d)
        assert (t["pd_ok"], t["pd_missing"], t["completed"]) == (0, 2, 2)


async def test_pull_from_dead_prefill_falls_back() -> None:
    async with pd_pair(decode={"kv_pull_timeout_s": 2.0}) as (p, d):
        kv = (await prefill_leg(p))["kv_transfer_params"]
        kv = {**kv, "remote_port": 1}  # nothing listens there
        resp = await d.post("/v1/completions", json={"prompt": PROMPT, "kv_transfer_params": kv})
        assert resp.status_code == 200
        assert (await totals(d))["pd_missing"] == 1


async def test_unpulled_blocks_leak_after_timeout() -> None:
    async with pd_pair(prefill={"kv_timeout_s": 0.05}) as (p, _d):
        kv = (await prefill_leg(p))["kv_transfer_params"]
        await wait_totals(p, lambda t: t["kv_blocks_leaked"] > 0)
        t = await totals(p)
        assert t["kv_blocks_leaked"] == len(kv["remote_block_ids"]) and t["kv_blocks_held"] == 0


async def test_stop_token_means_no_kv_params() -> None:
    async with pd_pair(prefill={"stop_rate": 1.0}) as (p, _d):
        doc = await prefill_leg(p)
        assert doc["kv_transfer_params"] is None
        assert doc["choices"][0]["finish_reason"] == "stop"
        assert (await totals(p))["kv_blocks_held"] == 0


async def test_dp_ranks_advertise_their_engine() -> None:
    sim = SimServer(SimConfig.fast(port=0, role="both", dp_size=2))
    async with trio.open_nursery() as nursery:
        url = await nursery.start(sim.run)
        async with httpx.AsyncClient(base_url=url) as c:
            ids = set()
            for rank in (0, 1):
                resp = await c.post(
                    "/v1/completions",
                    json={"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS},
                    headers={"X-data-parallel-rank": str(rank)},
                )
                kv = resp.json()["kv_transfer_params"]
                ids.add(kv["remote_engine_id"])
                # role=both pulls from itself over HTTP, pinned to the other rank.
                resp = await c.post(
                    "/v1/completions",
                    json={"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": kv},
                    headers={"X-data-parallel-rank": str(1 - rank)},
                )
            assert len(ids) == 2
            engines = (await c.get("/sim/stats")).json()["engines"]
            assert [e["pd_ok"] for e in engines] == [1, 1]
            assert [e["kv_blocks_held"] for e in engines] == [0, 0]
        nursery.cancel_scope.cancel()

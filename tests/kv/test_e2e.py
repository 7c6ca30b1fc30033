"""Prefill KV is never stranded, and never reclaimed after decode took it: router + simulators.

The simulator's decode pulls a prefill's blocks when it schedules the request (after a stream's
head, before its first event), as vLLM does; ``/sim/stats`` counts the blocks a prefill engine
holds, those that expired unpulled (leaked), and the prompt tokens each engine computed. After
each path: the prefill holds nothing within a second, nothing leaked, and decode computed no
prompt twice (``pd_missing`` 0: every decode request found its blocks).
"""

from __future__ import annotations

from typing import Any

import attrs
import trio

from tests.cluster import Cluster, eventually, start_cluster
from trio_pdrouter.config import RetrySettings
from trio_pdrouter_sim.config import SimConfig

PROMPT = "The quick brown fox jumps over the lazy dog. " * 40
#: Slow enough that a client can leave between decode's head and its first event.
SLOW_DECODE = SimConfig(port=0, prefill_base_s=0.0, prefill_per_token_s=0.0, itl_base_s=0.3)


async def totals(c: Cluster, role: str) -> dict[str, Any]:
    sims = c.prefill if role == "prefill" else c.decode
    out: dict[str, Any] = (await c.stats(sims[0]))["totals"]
    return out


async def kv_settled(c: Cluster) -> None:
    """The prefill holds no blocks, and the router no load: at once, long before the
    simulators' KV timeout (30 s) would have freed them as leaked (a bound on the poll of a
    loaded machine, not a timing claim)."""

    async def settled() -> bool:
        return (await totals(c, "prefill"))["kv_blocks_held"] == 0 and not c.router.ledger.total()

    await eventually(settled, timeout=10.0)
    assert (await totals(c, "prefill"))["kv_blocks_leaked"] == 0


async def arm(c: Cluster, spec: str, count: int) -> None:
    resp = await c.client.post(c.decode[0].url + "/sim/faults", json={"spec": spec, "count": count})
    resp.raise_for_status()


async def test_decode_refusing_after_prefill_frees_the_blocks() -> None:
    async with trio.open_nursery() as nursery:
        # 450 prompt tokens fit a 1000-token model; 450 + 600 to generate do not: decode
        # refuses what prefill (asked for one token) accepted. (The router's own check would
        # refuse it first: off, so that the engine's refusal is what is tested.)
        c = await start_cluster(
            nursery, sim=SimConfig.fast(port=0, max_model_len=1000), check_context_length=False
        )
        for _ in range(5):
            body = {"prompt": PROMPT, "max_tokens": 600}
            resp = await c.client.post(c.url + "/v1/completions", json=body)
            assert resp.status_code == 400
            assert "maximum context length" in resp.json()["error"]["message"]
        await kv_settled(c)
        decode = await totals(c, "decode")
        # Each reclaim (one token) pulled its blocks: nothing was prefilled twice.
        assert (decode["pd_ok"], decode["pd_missing"]) == (5, 0), decode
        nursery.cancel_scope.cancel()


async def test_decode_failing_before_its_head_is_retried_with_the_same_blocks() -> None:
    async with trio.open_nursery() as nursery:
        c = await start_cluster(
            nursery,
            sim=SimConfig.fast(port=0),
            retry=RetrySettings(max_retries=5, initial_backoff_ms=1),
        )
        await arm(c, "error:503@decode", 4)
        body = {"prompt": PROMPT, "max_tokens": 4, "stream": True}
        async with c.client.stream("POST", c.url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            text = b"".join([chunk async for chunk in resp.aiter_raw()])
        assert text.endswith(b"data: [DONE]\n\n")
        prefill = await totals(c, "prefill")
        assert prefill["completed"] == 1, "one prefill, not five"
        decode = await totals(c, "decode")
        assert (decode["pd_ok"], decode["pd_missing"]) == (1, 0)
        await kv_settled(c)
        nursery.cancel_scope.cancel()


async def test_a_stream_left_while_decode_waits_is_freed_by_decode_not_reclaimed() -> None:
    """vLLM's connector frees a prefill's blocks when the decode that received them is aborted
    before it read them: the router, which sent decode the whole request, reclaims nothing
    (a reclaim would be a second pull)."""
    async with trio.open_nursery() as nursery:
        c = await start_cluster(
            nursery,
            prefill_sim=attrs.evolve(SLOW_DECODE, role="prefill"),
            # One engine slot, taken: the request waits in decode's queue after its head.
            decode_sim=attrs.evolve(SLOW_DECODE, role="decode", max_num_seqs=1),
        )
        blocker = {"prompt": "x", "max_tokens": 50, "stream": True}
        body = {"prompt": PROMPT, "max_tokens": 4, "stream": True}
        async with c.client.stream("POST", c.url + "/v1/completions", json=blocker) as first:
            chunks = first.aiter_raw()
            await chunks.__anext__()  # the blocker runs
            async with c.client.stream("POST", c.url + "/v1/completions", json=body) as resp:
                assert resp.status_code == 200  # the head: decode has not scheduled it
            # The client left: decode aborts the waiting request, which frees the blocks.
        await kv_settled(c)
        decode, prefill = await totals(c, "decode"), await totals(c, "prefill")
        # The blocker pulled its blocks; the stream that left never read them, nor did a reclaim.
        assert (decode["pd_ok"], decode["pd_missing"]) == (1, 0), decode
        assert prefill["kv_blocks_freed"] > 0 and prefill["kv_second_pulls"] == 0, prefill
        nursery.cancel_scope.cancel()


async def test_a_non_streaming_client_leaving_mid_decode_costs_no_second_prefill() -> None:
    async with trio.open_nursery() as nursery:
        c = await start_cluster(nursery, sim=SLOW_DECODE)
        body = {"prompt": PROMPT, "max_tokens": 20}

        async def leaves_mid_decode() -> None:
            with trio.move_on_after(1.0):  # decode is generating by then (0.3 s a token)
                await c.client.post(c.url + "/v1/completions", json=body)

        async def running() -> bool:
            return (await totals(c, "decode"))["running"] == 1

        async with trio.open_nursery() as clients:
            clients.start_soon(leaves_mid_decode)
            await eventually(running, timeout=5.0)
        await kv_settled(c)
        decode = await totals(c, "decode")
        assert (decode["pd_ok"], decode["pd_missing"]) == (1, 0), decode
        nursery.cancel_scope.cancel()


async def test_a_router_refusal_reaches_no_engine() -> None:
    async with trio.open_nursery() as nursery:
        c = await start_cluster(nursery, sim=SimConfig.fast(port=0))
        resp = await c.client.post(
            c.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 0}
        )
        assert resp.status_code == 400 and resp.json()["error"]["type"] == "BadRequestError"
        assert (await totals(c, "prefill"))["prompt_tokens"] == 0
        nursery.cancel_scope.cancel()

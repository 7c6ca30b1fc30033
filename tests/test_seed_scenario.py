"""The seed scenario: cache_aware with the seed flags (the vllm-router launch command in
docs/migrate.md) keeps every decode engine busy.

200 streams that share a long prefix, through one decode server with 4 DP ranks. With exact
load (decode counted until the stream's last byte) the balance check fires and spreads the
streams; with the historic bug (decode released at headers) the router sees idle engines and
piles everything onto the one holding the prefix — the same test, run with the bug switched on,
shows it, so this test can fail.
"""

from __future__ import annotations

import logging
import statistics

import httpx
import pytest
import trio

from tests.cluster import eventually, start_cluster
from trio_pdrouter.routing import PolicySettings
from trio_pdrouter_sim.config import SimConfig

PREFIX = "You are a helpful assistant for the seed scenario. " * 40
STREAMS = 200


async def run_seed_scenario(release_decode_at_headers: bool) -> list[int]:
    """Run the scenario; return each decode engine's peak running count."""
    # Slow tokens keep the event rate low enough for one test process; streams (~4 s) outlast
    # the 2 s over which they arrive, so all of them overlap.
    sim = SimConfig.fast(port=0, itl_base_s=0.2)
    async with trio.open_nursery() as nursery:
        c = await start_cluster(
            nursery,
            sim=sim,
            dp_size=4,
            policy="cache_aware",
            policy_settings=PolicySettings(
                cache_threshold=0.5, balance_abs_threshold=32, balance_rel_threshold=1.1
            ),
            release_decode_at_headers=release_decode_at_headers,
        )
        limits = httpx.Limits(max_connections=STREAMS + 10)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:

            async def one(i: int) -> None:
                body = {"prompt": PREFIX + f"question {i}", "max_tokens": 20, "stream": True}
                resp = await client.post(c.url + "/v1/completions", json=body)
                assert resp.status_code == 200
                assert resp.content.endswith(b"data: [DONE]\n\n")

            async with trio.open_nursery() as clients:
                for i in range(STREAMS):
                    clients.start_soon(one, i)
                    await trio.sleep(0.01)  # arrivals paced over 2 s: a load shape, not a sync
        await eventually(c.all_idle)
        engines = (await c.stats(c.decode[0]))["engines"]
        nursery.cancel_scope.cancel()
    return [e["peak_running"] for e in engines]


async def test_exact_load_spreads_the_streams(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="trio_pdrouter.policy")
    peaks = await run_seed_scenario(release_decode_at_headers=False)
    decisions = [r.getMessage() for r in caplog.records if r.name == "trio_pdrouter.policy"]
    assert any("stage=decode" in d and "is_unbalanced=true" in d for d in decisions)
    mean = statistics.mean(peaks)
    assert max(peaks) <= 2 * mean, peaks


async def test_releasing_decode_at_headers_piles_up_on_one_engine() -> None:
    peaks = await run_seed_scenario(release_decode_at_headers=True)
    mean = statistics.mean(peaks)
    assert max(peaks) > 2 * mean, peaks

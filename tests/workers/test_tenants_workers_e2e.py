"""Tenants with ``--workers 2`` (real processes): a tenant's concurrency limit counts its
requests in every worker, whichever worker accepts the next one."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import trio

from tests.workers.test_workers_e2e import pd_args, start_sims
from tests.workers_harness import start_supervisor, stop_supervisor

FILE = """
[tenants.alice]
keys = ["sk-alice"]
max_concurrent_requests = 4

[tenants.bob]
keys = ["sk-bob"]
"""


def ask(stream: bool) -> dict[str, object]:
    return {"prompt": uuid.uuid4().hex, "max_tokens": 20_000 if stream else 2, "stream": stream}


async def test_a_tenants_limit_is_exact_across_workers(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(FILE)
    async with trio.open_nursery() as nursery:
        sims = await start_sims(nursery, itl=0.05)
        args = pd_args(sims, "--policy", "round_robin", "--tenants-file", str(tenants))
        sup = await start_supervisor(nursery, 2, args)
        await sup.wait_for(lambda: len(sup.pids) == 2, 60)
        release = trio.Event()
        started = trio.Semaphore(0)

        async def hold() -> None:
            headers = {"authorization": "Bearer sk-alice"}
            async with (
                httpx.AsyncClient(timeout=60) as client,
                client.stream(
                    "POST", sup.url + "/v1/completions", json=ask(True), headers=headers
                ) as resp,
            ):
                assert resp.status_code == 200
                chunks = resp.aiter_raw()  # kept: a collected iterator would close the stream
                await chunks.__anext__()
                started.release()
                await release.wait()

        async def one(key: str) -> httpx.Response:
            # A fresh connection each: the kernel spreads them over the workers.
            async with httpx.AsyncClient(timeout=60) as client:
                headers = {"authorization": f"Bearer {key}"}
                return await client.post(
                    sup.url + "/v1/completions", json=ask(False), headers=headers
                )

        async with trio.open_nursery() as streams:
            for _ in range(4):
                streams.start_soon(hold)
            with trio.fail_after(60):
                for _ in range(4):
                    await started.acquire()
            for _ in range(8):
                refused = await one("sk-alice")
                assert refused.status_code == 429, refused.text
                assert refused.headers["retry-after"] == "1"
            assert (await one("sk-bob")).status_code == 200
            release.set()
        for _ in range(4):  # the streams ended: alice has room in every worker again
            assert (await one("sk-alice")).status_code == 200
        assert await stop_supervisor(sup) == 0
        nursery.cancel_scope.cancel()

"""SIGTERM: stop accepting, let in-flight streams finish within the grace period, exit 0."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import trio

from trio_pdrouter_sim.config import SimConfig
from trio_pdrouter_sim.server import SimServer

from .cluster import eventually


async def start_router_process(
    nursery: trio.Nursery, prefill: str, decode: str, grace: float
) -> tuple[trio.Process, str]:
    cmd = [
        sys.executable,
        "-m",
        "trio_pdrouter",
        "--vllm-pd-disaggregation",
        "--prefill",
        prefill,
        "--decode",
        decode,
        "--port",
        "0",
        "--policy",
        "round_robin",
        "--graceful-timeout-secs",
        str(grace),
        "--log-level",
        "info",
    ]
    proc = await trio.lowlevel.open_process(cmd, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    buffered = b""
    with trio.fail_after(30):
        while b"listening=" not in buffered:
            chunk = await proc.stderr.receive_some()
            assert chunk, f"router exited early: {buffered.decode()}"
            buffered += chunk
    url = buffered.split(b"listening=", 1)[1].split()[0].decode()

    async def drain() -> None:  # keep the pipe from filling up
        async for _ in proc.stderr:  # type: ignore[union-attr]
            pass

    nursery.start_soon(drain)
    return proc, url


async def start_sims(nursery: trio.Nursery, itl: float) -> tuple[SimServer, SimServer]:
    prefill = SimServer(SimConfig.fast(port=0, role="prefill"))
    decode = SimServer(SimConfig.fast(port=0, role="decode", itl_base_s=itl))
    await nursery.start(prefill.run)
    await nursery.start(decode.run)
    return prefill, decode


async def test_sigterm_lets_a_stream_finish_then_exits_0() -> None:
    async with trio.open_nursery() as nursery:
        prefill, decode = await start_sims(nursery, itl=0.01)
        proc, url = await start_router_process(nursery, prefill.url, decode.url, grace=30)
        body = {"prompt": "x", "max_tokens": 60, "stream": True}
        async with httpx.AsyncClient(timeout=30) as client:
            async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                chunks = resp.aiter_raw()
                received = await chunks.__anext__()
                proc.send_signal(signal.SIGTERM)
                async for chunk in chunks:
                    received += chunk
            assert received.endswith(b"data: [DONE]\n\n")
            assert received.count(b'"text"') == 60
        with trio.fail_after(30):
            assert await proc.wait() == 0
        nursery.cancel_scope.cancel()


async def test_grace_period_over_cancels_streams_cleanly_and_exits_0() -> None:
    async with trio.open_nursery() as nursery:
        prefill, decode = await start_sims(nursery, itl=0.02)
        proc, url = await start_router_process(nursery, prefill.url, decode.url, grace=0.5)
        body = {"prompt": "x", "max_tokens": 5000, "stream": True}
        async with (
            httpx.AsyncClient(timeout=30) as client,
            client.stream("POST", url + "/v1/completions", json=body) as resp,
        ):
            chunks = resp.aiter_raw()
            await chunks.__anext__()
            proc.send_signal(signal.SIGTERM)
            try:
                async for _ in chunks:
                    pass
            except httpx.HTTPError:
                pass  # the router closed the connection when the grace period ended
        with trio.fail_after(30):
            assert await proc.wait() == 0

        async def engine_idle() -> bool:
            stats = decode.state.stats()  # in-process: read directly
            return bool(stats["totals"]["running"] == 0 and stats["totals"]["aborted"] == 1)

        await eventually(engine_idle)
        nursery.cancel_scope.cancel()

"""SIGTERM: stop accepting, let in-flight streams finish within the grace period, exit 0."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import orjson
import trio

from tests.cluster import eventually
from trio_pdrouter_sim.config import SimConfig
from trio_pdrouter_sim.server import SimServer


async def start_router_process(
    nursery: trio.Nursery, prefill: str, decode: str, grace: float, log: bytearray | None = None
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
        "--no-prometheus-listener",
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

    collected = bytearray() if log is None else log
    collected += buffered

    async def drain() -> None:  # keep the pipe from filling up
        async for chunk in proc.stderr:  # type: ignore[union-attr]
            collected.extend(chunk)

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


async def test_grace_period_over_ends_streams_with_an_error_event_and_exits_0() -> None:
    async with trio.open_nursery() as nursery:
        prefill, decode = await start_sims(nursery, itl=0.02)
        proc, url = await start_router_process(nursery, prefill.url, decode.url, grace=0.5)
        body = {"prompt": "x", "max_tokens": 5000, "stream": True}
        async with (
            httpx.AsyncClient(timeout=30) as client,
            client.stream("POST", url + "/v1/completions", json=body) as resp,
        ):
            chunks = resp.aiter_raw()
            received = await chunks.__anext__()
            proc.send_signal(signal.SIGTERM)
            async for chunk in chunks:
                received += chunk
        assert received.endswith(b"data: [DONE]\n\n")
        assert b'"the router is shutting down"' in received and b'"code":503' in received
        with trio.fail_after(30):
            assert await proc.wait() == 0

        async def engine_idle() -> bool:
            stats = decode.state.stats()  # in-process: read directly
            return bool(stats["totals"]["running"] == 0 and stats["totals"]["aborted"] == 1)

        await eventually(engine_idle)
        nursery.cancel_scope.cancel()


async def test_at_the_deadline_everyone_is_answered_and_the_process_exits() -> None:
    """Streams get an error event and [DONE], waiting requests a 503, every request an access
    line, and clients that stopped reading do not keep the process alive."""
    grace = 1.0
    log = bytearray()
    async with trio.open_nursery() as nursery:
        # Tokens as fast as the simulator makes them: the client that does not read fills its
        # buffers at once; the others would need seconds to finish.
        prefill, decode = await start_sims(nursery, itl=0.0)
        proc, url = await start_router_process(nursery, prefill.url, decode.url, grace, log)
        host, port = url.removeprefix("http://").rsplit(":", 1)
        stream = {"prompt": "x", "max_tokens": 30_000, "stream": True}
        answers: list[tuple[int, bytes]] = []
        started = trio.Semaphore(0)

        async def client(body: dict[str, object]) -> None:
            async with (
                httpx.AsyncClient(timeout=30) as http,
                http.stream("POST", url + "/v1/completions", json=body) as resp,
            ):
                started.release()
                answers.append((resp.status_code, await resp.aread()))

        # A client that sends its request, then never reads: its receive buffer fills, and
        # the router's send to it blocks.
        sock = trio.socket.socket()
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, 4096)
        await sock.connect((host, int(port)))
        payload = orjson.dumps(stream)
        await sock.send(
            b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        async with trio.open_nursery() as clients:
            for body in (stream, stream, {**stream, "stream": False}):
                clients.start_soon(client, body)
            for _ in range(2):  # the streams have their heads; the third waits for its answer
                await started.acquire()
            await eventually(lambda: _running(decode, 4))
            proc.send_signal(signal.SIGTERM)
            with trio.fail_after(grace + 5):  # a guard against a hang, not a timing check
                assert await proc.wait() == 0
        sock.close()
        streams = sorted(a for a in answers if a[1].startswith(b"data:"))
        assert len(streams) == 2
        for status, text in streams:
            assert status == 200 and text.endswith(b"data: [DONE]\n\n")
            assert b'"the router is shutting down"' in text
        [(status, text)] = [a for a in answers if not a[1].startswith(b"data:")]
        assert (
            status == 503
            and orjson.loads(text)["error"]["message"] == "the router is shutting down"
        )
        lines = [line for line in log.decode().splitlines() if " request_id=" in line]
        assert len(lines) == 4, lines
        assert sum("outcome=shutdown" in line for line in lines) == 4
        nursery.cancel_scope.cancel()


async def _running(sim: SimServer, n: int) -> bool:
    return bool(sim.state.stats()["totals"]["running"] >= n)

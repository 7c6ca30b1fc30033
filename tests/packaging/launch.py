"""Processes for the packaging tests: the installed router and simulator, started as commands,
and the PD request that shows they work together."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence

import attrs
import httpx
import trio

#: What the simulator prints once it listens, and what the router logs (at info).
SIM_LISTENING = re.compile(rb"trio-pdrouter-sim listening on (\S+)")
ROUTER_LISTENING = re.compile(rb"listening=(\S+)")


@attrs.define
class Started:
    """A process, the URL it announced, and what it has written so far on that stream."""

    proc: trio.Process
    url: str
    output: bytearray


async def start(
    nursery: trio.Nursery,
    command: Sequence[str],
    announced: re.Pattern[bytes],
    *,
    stream: str,
    cwd: str,
    env: dict[str, str],
) -> Started:
    """Start ``command`` and return once ``stream`` (stdout or stderr) shows ``announced``; the
    stream is then drained in ``nursery`` (so the pipe never fills), and the process is killed
    when the nursery is cancelled."""
    pipe = {"stdout": subprocess.PIPE} if stream == "stdout" else {"stderr": subprocess.PIPE}
    proc = await trio.lowlevel.open_process(list(command), cwd=cwd, env=env, **pipe)
    receive = proc.stdout if stream == "stdout" else proc.stderr
    assert receive is not None
    output = bytearray()
    with trio.fail_after(60):
        while (found := announced.search(output)) is None:
            chunk = await receive.receive_some()
            assert chunk, f"{command[0]} exited before it listened: {output.decode()}"
            output += chunk

    async def drain() -> None:
        try:
            async for chunk in receive:
                output.extend(chunk)
        finally:
            if proc.returncode is None:
                proc.kill()

    nursery.start_soon(drain)
    return Started(proc, found[1].decode(), output)


async def check_pd_request(router: str, prefill: str, decode: str) -> None:
    """One completion through ``router``: its answer has the tokens asked for, the prefill server
    ran it as a prefill, and the decode server decoded it with the KV it pulled from there."""
    async with httpx.AsyncClient(timeout=30) as client:
        resp = await client.post(
            router + "/v1/completions", json={"prompt": "packaged", "max_tokens": 5}
        )
        assert resp.status_code == 200, resp.text
        answer = resp.json()
        assert answer["object"] == "text_completion"
        assert answer["usage"]["completion_tokens"] == 5
        assert answer["choices"][0]["finish_reason"] == "length"
        prefilled = (await client.get(prefill + "/sim/stats")).json()["totals"]
        decoded = (await client.get(decode + "/sim/stats")).json()["totals"]
    assert prefilled["requests"] == 1 and decoded["requests"] == 1
    assert (decoded["pd_ok"], decoded["pd_missing"]) == (1, 0)

"""A ``--workers N`` router as a real process tree, for the end-to-end tests of the supervisor."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import Sequence

import attrs
import httpx
import trio

_READY = re.compile(rb"worker=(\d+) pid=(\d+) ready")
_LISTENING = re.compile(rb"listening=(\S+) workers=")


@attrs.define
class Supervised:
    """The supervisor process, its URL, and each worker's pid as its log reports them."""

    proc: trio.Process
    url: str = ""
    pids: dict[int, int] = attrs.field(factory=dict)
    log: bytearray = attrs.field(factory=bytearray)
    _changed: trio.Event = attrs.field(factory=trio.Event)

    async def _read_log(self) -> None:
        """Collect the log; when the test ends (its nursery is cancelled), kill the supervisor
        if it still runs: its workers follow it (they get SIGTERM when it dies)."""
        try:
            await self._follow_log()
        finally:
            if self.proc.returncode is None:
                self.proc.kill()

    async def _follow_log(self) -> None:
        assert self.proc.stderr is not None
        pending = b""
        async for chunk in self.proc.stderr:
            self.log += chunk
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if m := _READY.search(line):
                    self.pids[int(m[1])] = int(m[2])
                elif m := _LISTENING.search(line):
                    self.url = m[1].decode()
            self._changed.set()
            self._changed = trio.Event()
        self._changed.set()

    async def wait_for(self, predicate: object, timeout: float) -> None:  # noqa: ASYNC109
        """Wait until ``predicate()`` holds, woken by each new log line."""
        assert callable(predicate)
        with trio.fail_after(timeout):
            while not predicate():
                if self.proc.returncode is not None:
                    raise AssertionError(f"supervisor exited: {self.log.decode()}")
                await self._changed.wait()


async def start_supervisor(nursery: trio.Nursery, workers: int, args: Sequence[str]) -> Supervised:
    cmd = [
        sys.executable,
        "-m",
        "trio_pdrouter",
        "--workers",
        str(workers),
        "--port",
        "0",
        "--no-prometheus-listener",
        "--log-level",
        "info",  # the supervisor's "listening=" and "ready" lines
        *args,
    ]
    proc = await trio.lowlevel.open_process(cmd, stderr=subprocess.PIPE)
    sup = Supervised(proc)
    nursery.start_soon(sup._read_log)
    await sup.wait_for(lambda: sup.url, 60)
    return sup


async def stop_supervisor(sup: Supervised) -> int:
    sup.proc.send_signal(signal.SIGTERM)
    with trio.fail_after(30):
        return await sup.proc.wait()


async def get_loads_from_many_connections(url: str, n: int) -> list[dict[str, dict[str, int]]]:
    """``/get_loads`` over ``n`` fresh connections: the kernel spreads them over the workers."""
    out = []
    for _ in range(n):
        async with httpx.AsyncClient(timeout=10) as client:
            resp = await client.get(url + "/get_loads")
            resp.raise_for_status()
            out.append(resp.json())
    return out

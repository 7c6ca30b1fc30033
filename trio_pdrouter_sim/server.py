"""Serving a :class:`SimState` with hypercorn's trio worker, several per process if wanted.

::

    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_sim, SimConfig.fast(port=0, role="prefill"))
        # url == "http://127.0.0.1:40123"

or, to keep a handle (``down()``/``up()``, the live :class:`SimState`)::

    sim = SimServer(SimConfig(port=0))
    url = await nursery.start(sim.run)
"""

from __future__ import annotations

import logging
from functools import partial

import hypercorn.config
import hypercorn.trio
import trio

from .app import SERIES_INTERVAL_S, SimApp, SimState
from .config import SimConfig

log = logging.getLogger("trio_pdrouter_sim")


class SimServer:
    """One simulated vLLM server: its state, its ASGI app and its listener."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.state = SimState(config)
        self.app = SimApp(self.state)
        self.url = ""
        self.is_up = False
        self._hypercorn: hypercorn.config.Config | None = None
        self._down_event = trio.Event()
        self._up_event = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._changed = trio.Event()

    def _hypercorn_config(self, port: int) -> hypercorn.config.Config:
        hc = hypercorn.config.Config()
        host = self.config.host
        hc.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
        # vLLM's uvicorn keeps a deep accept queue; hypercorn's default of 100 drops SYNs
        # under a benchmark's burst.
        hc.backlog = self.config.backlog
        hc.keep_alive_timeout = self.config.keep_alive_timeout_s
        hc.graceful_timeout = 1.0
        hc.accesslog = None
        # A logger, not a stream: "Running on ..." (info) stays quiet under the usual WARNING
        # level, while an error escaping the app is still reported.
        hc.errorlog = logging.getLogger("trio_pdrouter_sim.hypercorn")
        return hc

    async def run(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; reports the base URL (``http://host:port``) once listening."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self.state.nursery = nursery
            self.state.request_down = self.down
            self.state.started_at = trio.current_time()
            nursery.start_soon(self._sample_forever)
            if self.state.kv_events is not None:
                nursery.start_soon(self.state.kv_events.run)
            port = self.config.port
            started = False
            while True:
                self._hypercorn = self._hypercorn_config(port)
                self._down_event = trio.Event()
                async with trio.open_nursery() as listener:
                    binds: list[str] = await listener.start(
                        partial(
                            hypercorn.trio.serve,
                            self.app,  # type: ignore[arg-type]
                            self._hypercorn,
                            shutdown_trigger=self._down_event.wait,
                        )
                    )
                    self._set_up(True)
                    if not started:
                        started = True
                        self.url = binds[0]
                        port = int(self.url.rsplit(":", 1)[1])
                        self.state.url, self.state.port = self.url, port
                        log.info(
                            "sim listening url=%s role=%s dp_size=%d",
                            self.url,
                            self.config.role,
                            self.config.dp_size,
                        )
                        task_status.started(self.url)
                self._set_up(False)
                await self._up_event.wait()

    def _set_up(self, value: bool) -> None:
        self.is_up = value
        self._changed.set()
        self._changed = trio.Event()

    async def wait_down(self) -> None:
        """Return once the listener is closed (after :meth:`down` or ``POST /sim/down``)."""
        while self.is_up:
            await self._changed.wait()

    async def wait_up(self) -> None:
        """Return once the server listens (again)."""
        while not self.is_up:
            await self._changed.wait()

    def down(self, seconds: float | None = None) -> None:
        """Close the listener (connections refused, in-flight requests cut, as in a crash).

        With ``seconds``, listen again after that long; otherwise wait for :meth:`up`.
        """
        if self._down_event.is_set():
            return
        self._up_event = trio.Event()
        if self._hypercorn is not None:
            self._hypercorn.graceful_timeout = 0.0
        self._down_event.set()
        if seconds is not None and self._nursery is not None:
            self._nursery.start_soon(self._up_after, seconds)

    def up(self) -> None:
        """Listen again on the same port after :meth:`down`."""
        self._up_event.set()

    async def _up_after(self, seconds: float) -> None:
        await trio.sleep(seconds)
        self.up()

    async def _sample_forever(self) -> None:
        while True:
            self.state.sample()
            await trio.sleep(SERIES_INTERVAL_S)


async def serve_sim(
    config: SimConfig, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve one simulator until cancelled; ``task_status`` gets its base URL."""
    await SimServer(config).run(task_status=task_status)

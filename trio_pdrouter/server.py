"""Running the router: hypercorn's trio worker, the upstream client, background housekeeping."""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable
from typing import cast

import attrs
import httpx
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve
from hypercorn.typing import Framework

from .app import RouterApp
from .config import RouterConfig
from .load import LoadLedger
from .proxy import Proxy
from .routing import Routing
from .upstream import make_client

log = logging.getLogger("trio_pdrouter.server")


@attrs.frozen
class RunningRouter:
    """What :func:`run_router` reports once it listens (tests and the demo use it)."""

    url: str
    ledger: LoadLedger
    routing: Routing
    app: RouterApp


def hypercorn_config(config: RouterConfig) -> HypercornConfig:
    s = config.server
    hc = HypercornConfig()
    hc.bind = [f"[{s.host}]:{s.port}" if ":" in s.host else f"{s.host}:{s.port}"]
    hc.backlog = s.backlog
    hc.keep_alive_timeout = s.keep_alive_timeout
    hc.graceful_timeout = s.graceful_timeout
    # Bounds the request line plus headers that hypercorn buffers before it gives up.
    hc.h11_max_incomplete_size = s.max_header_bytes
    hc.accesslog = None  # the router writes its own access line per request
    hc.errorlog = logging.getLogger("hypercorn.error")
    return hc


def build_app(config: RouterConfig, client: httpx.AsyncClient) -> RouterApp:
    """The whole router as an ASGI app over ``client``; tests pass an in-memory transport."""
    routing = Routing(config, LoadLedger())
    return RouterApp(config, routing, Proxy(config, routing, client), client)


async def wait_for_signal() -> None:
    """Return on SIGINT or SIGTERM: the start of a graceful shutdown."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("signal=%s shutting down", signal.Signals(signum).name)
            return


async def run_router(
    config: RouterConfig,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    task_status: trio.TaskStatus[RunningRouter] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until ``shutdown_trigger`` returns (or forever); report a :class:`RunningRouter`."""
    config.validate()
    async with make_client(config) as client, trio.open_nursery() as nursery:
        app = build_app(config, client)
        routing = app.routing
        nursery.start_soon(
            _maintain_policies, routing, config.policy_settings.eviction_interval_secs
        )

        async def _serve(task_status: trio.TaskStatus[list[str]]) -> None:
            await serve(
                cast(Framework, app),
                hypercorn_config(config),
                shutdown_trigger=shutdown_trigger,
                task_status=task_status,
            )
            nursery.cancel_scope.cancel()

        binds: list[str] = await nursery.start(_serve)
        log.info("listening=%s mode=%s", binds[0], "pd" if config.pd else "regular")
        task_status.started(RunningRouter(binds[0], routing.ledger, routing, app))


async def _maintain_policies(routing: Routing, interval: float) -> None:
    while True:
        await trio.sleep(interval)
        routing.maintain()

"""Waiting, at start, for the configured servers to be healthy (vllm-router's
``--worker-startup-timeout-secs`` and ``--worker-startup-check-interval``).

Before the router listens, every server URL given on the command line is probed (``GET
{url}{--health-check-endpoint}``, a 2xx within ``--health-check-timeout-secs`` is healthy) every
check interval until all have answered healthy once. If some have not within the timeout, the
router does not start: :class:`StartupTimeout` names them, and the command line exits 1 with
that message. A timeout of 0 starts at once, without waiting.

Only the start waits: servers added later with ``POST /workers`` take traffic once their first
health probe passes (see :mod:`.health`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import httpx
import trio

from ..config import HealthSettings

log = logging.getLogger("trio_pdrouter.startup")


class StartupTimeout(Exception):
    """Servers that were not healthy within the start-up timeout."""

    def __init__(self, unready: list[str], timeout: float) -> None:
        super().__init__(
            f"{len(unready)} server(s) did not become healthy within {timeout:g}s"
            f" (--worker-startup-timeout-secs): {', '.join(unready)}"
        )
        self.unready = unready


async def wait_until_healthy(
    client: httpx.AsyncClient, urls: Iterable[str], settings: HealthSettings
) -> None:
    """Return once every URL answered its health check; raise :class:`StartupTimeout` if some
    did not within ``settings.startup_timeout_secs`` (0: return at once)."""
    unready = list(dict.fromkeys(urls))
    timeout = settings.startup_timeout_secs
    if timeout <= 0 or not unready:
        return
    with trio.move_on_after(timeout):
        while True:
            healthy = await _probe_all(client, unready, settings)
            unready = [url for url in unready if url not in healthy]
            if not unready:
                return
            log.info("startup waiting_for=%s", ",".join(unready))
            await trio.sleep(settings.startup_check_interval)
    raise StartupTimeout(unready, timeout)


async def _probe_all(
    client: httpx.AsyncClient, urls: list[str], settings: HealthSettings
) -> set[str]:
    healthy: set[str] = set()

    async def probe(url: str) -> None:
        with trio.move_on_after(settings.timeout_secs):
            try:
                resp = await client.get(url + settings.endpoint, timeout=settings.timeout_secs)
            except httpx.HTTPError:
                return
            if resp.is_success:
                healthy.add(url)

    async with trio.open_nursery() as nursery:
        for url in urls:
            nursery.start_soon(probe, url)
    return healthy

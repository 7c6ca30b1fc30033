"""Waiting, at start, for the configured servers to be healthy (vllm-router's
``--worker-startup-timeout-secs`` and ``--worker-startup-check-interval``).

The router listens first, then every server URL given on the command line is probed (``GET
{url}{--health-check-endpoint}``, a 2xx within ``--health-check-timeout-secs`` is healthy) every
check interval until all have answered healthy once. Meanwhile ``/health`` and ``/liveness``
answer 200 and ``/readiness`` 503 naming the servers still awaited (:class:`StartupStatus`); a
server takes traffic from its first healthy answer (here or from the health probes). If some have
not answered within the timeout, the router stops: :class:`StartupTimeout` names them, and the
command line exits 1 with that message. A timeout of 0 does not wait: the servers start
unknown (no traffic) until their first health probe passes, or, with health probes off too,
are taken as healthy.

Only the start waits: servers added later with ``POST /workers`` take traffic once their first
health probe passes (see :mod:`.health`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import attrs
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


@attrs.define
class StartupStatus:
    """Where the start-up wait stands: ``/readiness`` answers 503 while ``waiting``.

    ``waiting_for`` is what the wait has not seen healthy yet; ``on_healthy`` is told of each
    URL it sees healthy (the health board admits it from then on).
    """

    waiting_for: list[str] = attrs.Factory(list)
    waiting: bool = False
    on_healthy: Callable[[str], None] = lambda url: None

    def awaited(self, healthy: Callable[[str], bool]) -> list[str]:
        """The servers still awaited, leaving out those ``healthy`` already admits."""
        return [url for url in self.waiting_for if not healthy(url)] if self.waiting else []

    def done(self) -> None:
        self.waiting, self.waiting_for = False, []


async def wait_until_healthy(
    client: httpx.AsyncClient,
    urls: Iterable[str],
    settings: HealthSettings,
    status: StartupStatus | None = None,
) -> None:
    """Return once every URL answered its health check; raise :class:`StartupTimeout` if some
    did not within ``settings.startup_timeout_secs`` (0: return at once). ``status`` follows
    the wait (and is done once it returns)."""
    status = StartupStatus() if status is None else status
    unready = list(dict.fromkeys(urls))
    timeout = settings.startup_timeout_secs
    if timeout <= 0 or not unready:
        status.done()
        return
    status.waiting, status.waiting_for = True, unready
    with trio.move_on_after(timeout):
        while True:
            healthy = await _probe_all(client, unready, settings)
            for url in healthy:
                status.on_healthy(url)
            unready = status.waiting_for = [url for url in unready if url not in healthy]
            if not unready:
                status.done()
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

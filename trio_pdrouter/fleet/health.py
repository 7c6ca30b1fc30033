"""Background health checks: one probe loop per upstream URL, feeding an admission check.

Every ``interval_secs`` each URL gets ``GET {url}{settings.endpoint}``; a 2xx answer within
``timeout_secs`` is a success, anything else (refused, reset, timed out, other status) a
failure. A healthy URL turns unhealthy after ``failure_threshold`` consecutive failures, an
unhealthy one healthy again after ``success_threshold`` consecutive successes. All DP ranks of a
URL share its probe and its verdict: they share the server, its HTTP listener and ``/health``.

URL states::

    state       event      condition                                  next state
    ---------   --------   ----------------------------------------   ----------
    HEALTHY     success    -                                          HEALTHY
    HEALTHY     failure    consecutive failures < failure_threshold   HEALTHY
    HEALTHY     failure    reach failure_threshold                    UNHEALTHY
    UNHEALTHY   failure    -                                          UNHEALTHY
    UNHEALTHY   success    consecutive successes < success_threshold  UNHEALTHY
    UNHEALTHY   success    reach success_threshold                    HEALTHY
    PENDING     failure    -                                          PENDING
    PENDING     success    -                                          HEALTHY

URLs added at run time (``POST /workers``) begin PENDING: they take no traffic until their
first probe succeeds, and that probe is sent as soon as they are added. So do the URLs given at
start-up when the router runs (:func:`~trio_pdrouter.server.run_router`): unknown is not healthy;
the start-up wait's probes (:meth:`HealthBoard.confirm`) or the first health probe admit them.
Only with neither (health probes off and no start-up wait) do they begin HEALTHY. Only HEALTHY
admits traffic.

Health decides which endpoints routing may choose, nothing else: it never touches the load
ledger, so requests already running on an endpoint that turns unhealthy release their load as
usual.

With ``--workers N`` one worker probes for the machine (worker 0; its replacement takes over if
it dies): its board publishes its verdict after every probe to the machine's :class:`Verdicts`,
and the other workers' boards do not probe but :meth:`HealthBoard.follow` the published
verdicts. A URL with no published verdict yet keeps the state it started in.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable
from typing import Protocol

import httpx
import trio

from ..config import HealthSettings
from ..endpoints import Endpoint

log = logging.getLogger("trio_pdrouter.health")


class Health(enum.Enum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    PENDING = "pending"


#: Called with (url, healthy) whenever a URL starts or stops admitting traffic; used by metrics.
OnChange = Callable[[str, bool], None]


class Verdicts(Protocol):
    """The machine's health verdicts per URL
    (:class:`~trio_pdrouter.fleet.verdicts.MachineVerdicts`)."""

    def hold(self, url: str) -> None: ...
    def let_go(self, url: str) -> None: ...
    def publish(self, url: str, health: Health) -> None: ...
    def read(self, url: str) -> Health | None: ...


class _Probe:
    """One URL's verdict and streaks; its loop runs under ``scope`` once the board runs."""

    __slots__ = ("failures", "health", "scope", "successes")

    def __init__(self, health: Health) -> None:
        self.health = health
        self.failures = 0
        self.successes = 0
        self.scope = trio.CancelScope()


class HealthBoard:
    """The health of every upstream URL, kept current by :meth:`run`.

    ``urls`` are the URLs known at start-up (healthy until probes say otherwise).
    """

    def __init__(
        self,
        settings: HealthSettings,
        urls: Iterable[str] = (),
        on_change: OnChange | None = None,
        verdicts: Verdicts | None = None,
        publish: bool = True,
    ) -> None:
        """``verdicts``: the machine's verdicts (``--workers N``), which this board publishes
        (the machine's prober, ``publish``) or follows; None for a single process."""
        self._settings = settings
        self._verdicts = verdicts
        self._publish = publish
        self._on_change = on_change
        self._probes: dict[str, _Probe] = {}
        for url in urls:
            self._watch(url, Health.HEALTHY)
        self._nursery: trio.Nursery | None = None
        self._client: httpx.AsyncClient | None = None

    def is_healthy(self, endpoint: Endpoint) -> bool:
        """The admission check for routing: False for a URL the board does not know."""
        probe = self._probes.get(endpoint.url)
        return probe is not None and probe.health is Health.HEALTHY

    def health(self, url: str) -> str | None:
        """``"healthy"``, ``"unhealthy"``, ``"pending"``, or None for an unknown URL."""
        probe = self._probes.get(url)
        return None if probe is None else probe.health.value

    @property
    def urls(self) -> list[str]:
        return list(self._probes)

    def add_url(self, url: str, healthy: bool = False) -> None:
        """Start watching ``url`` (probed at once if the board runs); a known URL is kept as is.

        ``healthy=False`` (the default for runtime additions) keeps it out of routing until
        its first successful probe.
        """
        if url in self._probes:
            return
        probe = self._watch(url, Health.HEALTHY if healthy else Health.PENDING)
        if self._nursery is not None and self._client is not None:
            self._nursery.start_soon(self._probe_forever, self._client, url, probe)

    def confirm(self, url: str) -> None:
        """A probe made elsewhere (the start-up wait) found ``url`` healthy: a PENDING URL is
        admitted; any other state follows its own probes."""
        probe = self._probes.get(url)
        if probe is not None and probe.health is Health.PENDING:
            self._record(url, probe, True)

    def remove_url(self, url: str) -> None:
        """Stop watching ``url``; its endpoints are no longer admitted. No callback is made."""
        probe = self._probes.pop(url, None)
        if probe is not None:
            probe.scope.cancel()
            if self._verdicts is not None:
                self._verdicts.let_go(url)

    def _watch(self, url: str, health: Health) -> _Probe:
        if self._verdicts is not None:
            self._verdicts.hold(url)  # first: a full machine table changes nothing here
        probe = self._probes[url] = _Probe(health)
        return probe

    async def run(
        self,
        client: httpx.AsyncClient,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Probe every URL, and every URL added later, until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery, self._client = nursery, client
            try:
                for url, probe in self._probes.items():
                    probe.scope = trio.CancelScope()  # a scope is entered once; run may restart
                    nursery.start_soon(self._probe_forever, client, url, probe)
                task_status.started()
                await trio.sleep_forever()
            finally:
                self._nursery = self._client = None

    async def follow(self, interval: float) -> None:
        """Take the machine prober's verdicts every ``interval`` seconds instead of probing."""
        verdicts = self._verdicts
        if verdicts is None:
            return
        while True:
            for url, probe in list(self._probes.items()):
                health = verdicts.read(url)
                if health is not None and health is not probe.health:
                    self._set(url, probe, health)
            await trio.sleep(interval)

    async def _probe_forever(self, client: httpx.AsyncClient, url: str, probe: _Probe) -> None:
        with probe.scope:
            # Removed (perhaps before this task first ran): stop without another probe.
            while self._probes.get(url) is probe:
                ok = await self._probe_once(client, url)
                self._record(url, probe, ok)
                await trio.sleep(self._settings.interval_secs)

    async def _probe_once(self, client: httpx.AsyncClient, url: str) -> bool:
        s = self._settings
        # httpx's timeout bounds each socket operation; the deadline bounds the probe as a whole.
        with trio.move_on_after(s.timeout_secs):
            try:
                resp = await client.get(url + s.endpoint, timeout=s.timeout_secs)
            except Exception as exc:  # any failure is a failed probe; the loop must not die
                log.debug("health url=%s failed=%s", url, type(exc).__name__)
                return False
            return resp.is_success
        log.debug("health url=%s timed out after %gs", url, s.timeout_secs)
        return False

    def _record(self, url: str, probe: _Probe, ok: bool) -> None:
        self._judge(url, probe, ok)
        if self._verdicts is not None and self._publish:  # every verdict, not only changes: a
            self._verdicts.publish(url, probe.health)  # replacement prober may start elsewhere

    def _judge(self, url: str, probe: _Probe, ok: bool) -> None:
        s = self._settings
        if ok:
            probe.failures = 0
            probe.successes += 1
            if probe.health is Health.PENDING or (
                probe.health is Health.UNHEALTHY and probe.successes >= s.success_threshold
            ):
                self._set(url, probe, Health.HEALTHY)
        else:
            probe.successes = 0
            probe.failures += 1
            if probe.health is Health.HEALTHY and probe.failures >= s.failure_threshold:
                self._set(url, probe, Health.UNHEALTHY)

    def _set(self, url: str, probe: _Probe, health: Health) -> None:
        was_healthy = probe.health is Health.HEALTHY
        probe.health = health
        log.info("health url=%s state=%s", url, health.value)
        if self._on_change is not None and was_healthy != (health is Health.HEALTHY):
            self._on_change(url, health is Health.HEALTHY)

"""The servers the router sends to, and the one place where one is added or removed.

A server is a URL serving one role (prefill, decode, or regular); with
``--intra-node-data-parallel-size N`` it is N endpoints ``url@0..url@N-1``. The same URL may
serve several roles, once each. Everything that keeps per-endpoint or per-URL state learns of a
server from :class:`Fleet` and from nowhere else:

* :meth:`Fleet.add` validates the URL (one validator for the command line and ``POST /workers``:
  :func:`~trio_pdrouter.endpoints.normalize_url`), then, in one synchronous step, gives the
  endpoints to the load ledger and to routing and the URL to the health probes. A server added at
  start-up takes traffic at once; one added at run time waits for its first successful probe.
* :meth:`Fleet.remove` takes the URL out of routing and health at once (no new request goes
  there) and forgets its circuit breakers, waits up to a timeout for its in-flight requests to
  end, then drops its ledger counters — at once if they are zero, else at their last release:
  requests still running keep their leases and release what they took whenever they end.
  :meth:`Fleet.withdraw` is its first half alone, synchronous, for a caller that drains in a
  task of its own (discovery). A server added back while its old self drains keeps counting.
* Every server has an :class:`Origin`: ``static`` (the command line), ``api``
  (``POST /workers``) or ``discovery`` (a Kubernetes pod, named with its UID); ``/workers``
  shows it and discovery removes only servers whose origin is ``discovery``.
* With ``--workers N`` the fleet is given the machine's :class:`ServerLog`: every runtime add
  or remove, in whichever worker, is applied here and appended to the log in one step under the
  machine lock, after replaying what this worker had not seen yet; :meth:`Fleet.follow`
  replays other workers' changes within ``interval`` seconds, and a replacement worker replays
  the whole log at start. Servers from the command line are not logged: every worker starts
  with them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import attrs
import trio

from ..endpoints import Endpoint, Role, expand
from ..ledger import LoadLedger
from ..routing import Routing
from .breakers import Breakers
from .health import HealthBoard


class DuplicateServer(ValueError):
    """The URL already serves that role."""


@attrs.frozen
class Removal:
    """What :meth:`Fleet.remove` did: the endpoints it removed and those still busy."""

    removed: tuple[Endpoint, ...]
    in_flight: int


@attrs.frozen
class PodRef:
    """A pod's identity: a new UID under the same name is another pod."""

    namespace: str
    name: str
    uid: str

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@attrs.frozen
class Origin:
    """Where a server came from: ``source`` is static, api or discovery (then with its pod)."""

    source: str
    pod: PodRef | None = None
    bootstrap_port: int | None = None

    def encode(self) -> str:
        """One word without spaces (for the machine's server log)."""
        if self.pod is None:
            return self.source
        pod, port = self.pod, self.bootstrap_port
        return f"{self.source}:{pod.namespace}:{pod.name}:{pod.uid}:{port or ''}"

    @classmethod
    def decode(cls, word: str) -> Origin:
        source, *pod = word.split(":")
        if len(pod) != 4:
            return cls(source)
        namespace, name, uid, port = pod
        return cls(source, PodRef(namespace, name, uid), int(port) if port else None)

    def describe(self) -> dict[str, Any]:
        """What ``GET /workers`` says of it."""
        if self.pod is None:
            return {"source": self.source}
        pod = {"namespace": self.pod.namespace, "name": self.pod.name, "uid": self.pod.uid}
        if self.bootstrap_port is not None:
            pod["bootstrap_port"] = str(self.bootstrap_port)
        return {"source": self.source, "pod": pod}


STATIC = Origin("static")
API = Origin("api")


class ServerLog(Protocol):
    """The machine's runtime server changes (:class:`~trio_pdrouter.machine.table.MachineTable`)."""

    @property
    def generation(self) -> int: ...
    def locked(self) -> AbstractContextManager[None]: ...
    def append_change(self, change: str) -> int: ...
    def changes(self, since: int) -> list[str]: ...


@attrs.frozen
class MachineServers:
    """What a worker of ``--workers N`` shares its servers through: the machine's log, the
    nursery that drains servers another worker removed, and how long such a drain waits."""

    log: ServerLog
    background: trio.Nursery
    drain_timeout: float


class Fleet:
    """Owns the set of servers (see the module doc); ``machine`` only with ``--workers N``."""

    def __init__(
        self,
        *,
        dp_size: int,
        routing: Routing,
        ledger: LoadLedger,
        health: HealthBoard,
        breakers: Breakers,
        machine: MachineServers | None,
    ) -> None:
        self._dp_size = dp_size
        self._routing = routing
        self._ledger = ledger
        self._health = health
        self._breakers = breakers
        self._machine = machine
        self._log = None if machine is None else machine.log
        self._applied = 0
        self._origins: dict[str, Origin] = {}

    @property
    def roles(self) -> tuple[Role, ...]:
        """The roles of this mode."""
        return self._routing.roles

    def endpoints(self) -> list[Endpoint]:
        """Every endpoint of every role."""
        return [ep for role in self._routing.roles for ep in self._routing.endpoints(role)]

    def endpoints_of(self, url: str) -> list[Endpoint]:
        return [ep for ep in self.endpoints() if ep.url == url]

    def health(self, url: str) -> str | None:
        """The health of the server at ``url`` (see :meth:`HealthBoard.health`)."""
        return self._health.health(url)

    def origin(self, url: str) -> Origin | None:
        """Where the server at ``url`` came from; None if there is none."""
        return self._origins.get(url)

    def origins(self) -> dict[str, Origin]:
        """Every server URL with its origin."""
        return dict(self._origins)

    def add(
        self, url: str, role: Role, *, serving: bool, origin: Origin = API
    ) -> tuple[Endpoint, ...]:
        """Add the server at ``url`` in ``role``; ``serving`` (start-up servers) takes traffic
        at once, else after its first successful health probe.

        Raises :class:`DuplicateServer` if the URL already serves ``role``, ``ValueError`` for a
        bad URL or a role this mode does not have.
        """
        if self._log is None:
            return self._add(url, role, serving, origin)
        with self._log.locked():
            self._catch_up()
            added = self._add(url, role, serving, origin)
            self._publish(f"add {role.value} {added[0].url} {origin.encode()}")
            return added

    async def remove(self, url: str, drain_timeout: float) -> Removal | None:
        """Remove the server at ``url`` from every role; None if there is none."""
        removed = self.withdraw(url)
        if not removed:
            return None
        return await self.drain(removed, drain_timeout)

    def withdraw(self, url: str) -> list[Endpoint]:
        """The first half of :meth:`remove`, synchronous: no new request goes to ``url`` from
        now on; its endpoints (empty if there is no such server), for :meth:`drain`."""
        url = url.rstrip("/")
        if self._log is None:
            return self._withdraw(url)
        with self._log.locked():
            self._catch_up()
            removed = self._withdraw(url)
            if removed:
                self._publish(f"remove - {url}")
            return removed

    async def follow(self, interval: float) -> None:
        """Replay other workers' server changes every ``interval`` seconds (``--workers N``)."""
        log = self._log
        if log is None:
            return
        while True:
            if log.generation != self._applied:
                with log.locked():
                    self._catch_up()
            await trio.sleep(interval)

    def add_at_start(self, url: str, role: Role, *, serving: bool = True) -> tuple[Endpoint, ...]:
        """A server of the command line: every worker starts with it, so it is not logged;
        ``serving=False``: unknown until a probe passes (see :mod:`.health`)."""
        return self._add(url, role, serving, STATIC)

    def catch_up(self) -> None:
        """Replay the machine's server changes this worker has not applied (at start)."""
        if self._log is not None:
            with self._log.locked():
                self._catch_up()

    def _catch_up(self) -> None:
        assert self._log is not None
        for change in self._log.changes(self._applied):
            op, role, url, *origin = change.split(" ")
            self._applied += 1
            if op == "add":
                with contextlib.suppress(ValueError):  # DuplicateServer included: already here
                    self._add(url, Role(role), False, Origin.decode(origin[0]) if origin else API)
            else:
                removed = self._withdraw(url)
                if removed and self._machine is not None:
                    machine = self._machine
                    machine.background.start_soon(self.drain, removed, machine.drain_timeout)

    def _publish(self, change: str) -> None:
        assert self._log is not None
        self._applied = self._log.append_change(change)

    def _add(self, url: str, role: Role, serving: bool, origin: Origin) -> tuple[Endpoint, ...]:
        if role not in self._routing.roles:
            modes = ", ".join(r.value for r in self._routing.roles)
            raise ValueError(f"role {role.value!r} does not exist in this mode (use {modes})")
        added = expand([url], role, self._dp_size)
        current = self._routing.endpoints(role)
        if any(ep.url == added[0].url for ep in current):
            raise DuplicateServer(f"{added[0].url} is already a {role.value} server")
        for ep in added:
            self._ledger.add_endpoint(ep)
        self._routing.set_endpoints(role, [*current, *added])
        self._health.add_url(added[0].url, healthy=serving)
        self._origins.setdefault(added[0].url, origin)
        return added

    def _withdraw(self, url: str) -> list[Endpoint]:
        """Take ``url`` out of routing, health and the breakers at once; its endpoints."""
        removed: list[Endpoint] = []
        for role in self._routing.roles:
            eps = self._routing.endpoints(role)
            gone = [ep for ep in eps if ep.url == url]
            if gone:
                self._routing.set_endpoints(role, [ep for ep in eps if ep.url != url])
                removed.extend(gone)
        if not removed:
            return removed
        self._health.remove_url(url)
        self._origins.pop(url, None)
        for ep in removed:
            self._breakers.forget(ep)
        return removed

    async def drain(self, removed: Sequence[Endpoint], drain_timeout: float) -> Removal:
        """The second half of :meth:`remove`: wait up to ``drain_timeout`` for the requests on
        ``removed`` to end, then let the ledger forget them (at their last release)."""
        with trio.move_on_after(drain_timeout):
            await self._ledger.wait_idle(removed)
        in_flight = sum(self._ledger.load(ep) for ep in removed)
        serving = set(self.endpoints())
        for ep in removed:
            if ep not in serving:  # added back meanwhile: its counter is in use again
                self._ledger.forget_when_idle(ep)
        return Removal(tuple(removed), in_flight)

    def workers(self) -> list[dict[str, Any]]:
        """Every endpoint as ``GET /workers`` shows it."""
        routing, health, breakers, ledger = (
            self._routing,
            self._health,
            self._breakers,
            self._ledger,
        )
        routable = {ep for role in routing.roles for ep in routing.candidates(role)}
        return [
            {
                "url": ep.url,
                "key": ep.key,
                "role": ep.role.value,
                "rank": ep.rank,
                "healthy": health.is_healthy(ep),
                "health": health.health(ep.url),
                "circuit": breakers.state(ep),
                "routable": ep in routable,
                "load": ledger.load(ep),
                **self._origins.get(ep.url, API).describe(),
            }
            for ep in self.endpoints()
        ]

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
* A server is a (role, URL) pair: :meth:`Fleet.remove` and :meth:`Fleet.withdraw` take one
  role of a URL or, by default, all of them. Servers added at run time (``api`` or
  ``discovery``) are capped at ``max_runtime`` per process (``--max-runtime-servers``): past it
  an add raises :class:`FleetFull`, as it does when the machine table has no room; nothing
  changes then. A runtime server's address must also pass the
  :class:`~trio_pdrouter.endpoints.UpstreamPolicy` (``ValueError`` otherwise).
* Every server has an :class:`Origin`: ``static`` (the command line), ``api``
  (``POST /workers``) or ``discovery`` (a Kubernetes pod, named with its UID); ``/workers``
  shows it and discovery removes only servers whose origin is ``discovery``.
* With ``--workers N`` the fleet is given the machine's :class:`ServerLog`: every runtime add
  or remove, in whichever worker, is applied here and appended to the log in one step under the
  machine lock, after catching up with what other workers logged, and only once the log and the
  machine table have room for it. The log's entries (``add ROLE URL ORIGIN``, ``remove ROLE
  URL``) fold into the servers the machine wants (:func:`fold`, starting from the command line's,
  which every worker starts with and which are not logged); catching up is making this worker's
  servers those (:meth:`Fleet._reconcile`), so a worker that fell behind a compaction of the log
  (its snapshot of what is wanted now) converges just as one that read every change.
  :meth:`Fleet.follow` catches up within ``interval`` seconds, a replacement worker at start.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import attrs
import trio

from ..endpoints import Endpoint, Role, UpstreamPolicy, expand
from ..ledger import LoadLedger, slot_key
from ..machine import Changes, TableFull
from ..routing import Routing
from .breakers import Breakers
from .health import HealthBoard
from .verdicts import health_key

log = logging.getLogger("trio_pdrouter.fleet")


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


class FleetFull(RuntimeError):
    """No room for another server (the runtime cap or the machine table): nothing changed."""


#: A server: one role of one URL.
ServerKey = tuple[Role, str]


class ServerLog(Protocol):
    """The machine's runtime server changes (:class:`~trio_pdrouter.machine.table.MachineTable`)."""

    @property
    def generation(self) -> int: ...
    @property
    def room(self) -> int: ...
    def locked(self) -> AbstractContextManager[None]: ...
    def append_change(self, change: str) -> int: ...
    def compact(self, snapshot: Sequence[str]) -> None: ...
    def changes(self, since: int) -> Changes: ...
    def check_room(self, keys: Iterable[str]) -> None: ...


@attrs.frozen
class MachineServers:
    """What a worker of ``--workers N`` shares its servers through: the machine's log, the
    nursery that drains servers another worker removed, and how long such a drain waits."""

    log: ServerLog
    background: trio.Nursery
    drain_timeout: float


def fold(wanted: dict[ServerKey, Origin], entries: Iterable[str]) -> None:
    """Apply logged changes to ``wanted``, the servers the machine wants, in order."""
    for entry in entries:
        op, role, url, *origin = entry.split(" ")
        key = (Role(role), url)
        wanted.pop(key, None)
        if op == "add":
            wanted[key] = Origin.decode(origin[0]) if origin else API


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
        max_runtime: int,
        policy: UpstreamPolicy,
    ) -> None:
        self._dp_size = dp_size
        self._routing = routing
        self._ledger = ledger
        self._health = health
        self._breakers = breakers
        self._machine = machine
        self._max_runtime = max_runtime
        self._policy = policy
        self._log = None if machine is None else machine.log
        self._applied = 0
        self._origins: dict[str, Origin] = {}
        self._static: set[ServerKey] = set()
        #: Whether the command line's servers take traffic before a probe passed.
        self._static_serving = True
        #: With a log: the servers the machine wants as of ``_applied``.
        self._wanted: dict[ServerKey, Origin] = {}

    @property
    def roles(self) -> tuple[Role, ...]:
        """The roles of this mode."""
        return self._routing.roles

    def endpoints(self) -> list[Endpoint]:
        """Every endpoint of every role."""
        return [ep for role in self._routing.roles for ep in self._routing.endpoints(role)]

    def endpoints_of(self, url: str) -> list[Endpoint]:
        return [ep for ep in self.endpoints() if ep.url == url]

    def servers(self) -> list[ServerKey]:
        """Every server, in routing order."""
        return list(dict.fromkeys((ep.role, ep.url) for ep in self.endpoints()))

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
        bad URL, an address the upstream policy refuses or a role this mode does not have,
        :class:`FleetFull` when there is no room.
        """
        if self._log is None:
            added = self._planned(url, role)
            self._policy.check(added[0].url)
            self._check_cap(added[0])
            return self._add(added, serving, origin)
        with self._log.locked():
            self._catch_up()
            added = self._planned(url, role)
            self._policy.check(added[0].url)
            self._check_cap(added[0])
            self._make_room(1)
            self._check_table(added)
            self._add(added, serving, origin)
            self._publish([f"add {role.value} {added[0].url} {origin.encode()}"])
            return added

    async def remove(
        self, url: str, drain_timeout: float, role: Role | None = None
    ) -> Removal | None:
        """Remove the server at ``url`` (in ``role``, or every role); None if there is none."""
        removed = self.withdraw(url, role)
        if not removed:
            return None
        return await self.drain(removed, drain_timeout)

    def withdraw(self, url: str, role: Role | None = None) -> list[Endpoint]:
        """The first half of :meth:`remove`, synchronous: no new request goes to ``url`` (in
        ``role``, or every role) from now on; its endpoints (empty if there is no such server),
        for :meth:`drain`."""
        url = url.rstrip("/")
        if self._log is None:
            return self._withdraw(url, role)
        with self._log.locked():
            self._catch_up()
            roles = [r for r, u in self.servers() if u == url and role in (None, r)]
            if not roles:
                return []
            self._make_room(len(roles))
            removed = self._withdraw(url, role)
            self._publish([f"remove {r.value} {url}" for r in roles])
            return removed

    async def follow(self, interval: float) -> None:
        """Catch up with other workers' server changes every ``interval`` seconds."""
        log = self._log
        if log is None:
            return
        while True:
            if log.generation != self._applied:
                with log.locked():
                    self._catch_up()
            await trio.sleep(interval)

    def add_at_start(self, url: str, role: Role, *, serving: bool = True) -> tuple[Endpoint, ...]:
        """A server of the command line; ``serving=False``: unknown until a probe passes (see
        :mod:`.health`). Every worker of ``--workers N`` starts with them, so they are not
        logged; there :meth:`catch_up` adds them, unless the machine's log says they were
        removed since."""
        planned = self._planned(url, role)
        key = (role, planned[0].url)
        self._static.add(key)
        self._static_serving = serving
        if self._log is None:
            return self._add(planned, serving, STATIC)
        self._wanted[key] = STATIC
        return planned

    def catch_up(self) -> None:
        """Make this worker's servers the machine's (at start)."""
        if self._log is not None:
            with self._log.locked():
                self._catch_up(start=True)

    def _catch_up(self, *, start: bool = False) -> None:
        assert self._log is not None
        changes = self._log.changes(self._applied)
        if changes.reset:  # fell behind a compaction: start again from the command line's
            self._wanted = dict.fromkeys(self._static, STATIC)
        elif not changes.entries and not start:
            return
        fold(self._wanted, changes.entries)
        self._applied = changes.generation
        self._reconcile()

    def _reconcile(self) -> None:
        """Make this worker's servers the ones the machine wants."""
        assert self._machine is not None
        machine, wanted = self._machine, self._wanted
        for role, url in self.servers():
            if (role, url) not in wanted:
                removed = self._withdraw(url, role)
                machine.background.start_soon(self.drain, removed, machine.drain_timeout)
        have = set(self.servers())
        for (role, url), origin in wanted.items():
            if (role, url) in have:
                continue
            added = self._planned(url, role)
            try:
                self._check_table(added)
            except FleetFull as exc:  # only if a dead worker's servers were reclaimed meanwhile
                log.error("server url=%s role=%s not followed: %s", url, role.value, exc)
                continue
            # The command line's start as they would in a single process; others wait for a probe.
            self._add(added, origin == STATIC and self._static_serving, origin)

    def _publish(self, changes: list[str]) -> None:
        assert self._log is not None
        fold(self._wanted, changes)
        for change in changes:
            self._applied = self._log.append_change(change)

    def _make_room(self, changes: int) -> None:
        """Compact the log if ``changes`` more do not fit; FleetFull if they still do not."""
        assert self._log is not None
        log_ = self._log
        if log_.room >= changes:
            return
        snapshot = [
            f"remove {role.value} {url}"
            for role, url in self._static
            if (role, url) not in self._wanted
        ] + [
            f"add {role.value} {url} {origin.encode()}"
            for (role, url), origin in self._wanted.items()
            if (role, url) not in self._static or origin != STATIC
        ]
        try:
            log_.compact(snapshot)
        except TableFull as exc:
            raise FleetFull(str(exc)) from None
        log.info("server_log compacted entries=%d generation=%d", len(snapshot), self._applied)
        if log_.room < changes:
            raise FleetFull(f"the machine's server change log has no room for {changes} changes")

    def _check_table(self, added: Sequence[Endpoint]) -> None:
        """FleetFull unless the machine table has a slot for each of ``added`` (and the URL's
        health verdict): then adding them cannot fail half-way."""
        assert self._log is not None
        url = added[0].url
        keys = [slot_key(ep) for ep in added]
        if url not in self._health.urls:
            keys.append(health_key(url))
        try:
            self._log.check_room(keys)
        except TableFull as exc:
            raise FleetFull(str(exc)) from None

    def _check_cap(self, server: Endpoint) -> None:
        runtime = sum(1 for key in self.servers() if key not in self._static)
        if (server.role, server.url) not in self._static and runtime >= self._max_runtime:
            raise FleetFull(
                f"the router serves {runtime} servers added at run time, its"
                " --max-runtime-servers: remove one first"
            )

    def _planned(self, url: str, role: Role) -> tuple[Endpoint, ...]:
        """The endpoints of ``url`` in ``role``; ValueError (DuplicateServer included) if it
        cannot be added."""
        if role not in self._routing.roles:
            modes = ", ".join(r.value for r in self._routing.roles)
            raise ValueError(f"role {role.value!r} does not exist in this mode (use {modes})")
        added = expand([url], role, self._dp_size)
        if any(ep.url == added[0].url for ep in self._routing.endpoints(role)):
            raise DuplicateServer(f"{added[0].url} is already a {role.value} server")
        return added

    def _add(
        self, added: tuple[Endpoint, ...], serving: bool, origin: Origin
    ) -> tuple[Endpoint, ...]:
        role, url = added[0].role, added[0].url
        for ep in added:
            self._ledger.add_endpoint(ep)
        self._routing.set_endpoints(role, [*self._routing.endpoints(role), *added])
        self._health.add_url(url, healthy=serving)
        self._origins.setdefault(url, origin)
        return added

    def _withdraw(self, url: str, role: Role | None) -> list[Endpoint]:
        """Take ``url`` (in ``role``, or every role) out of routing and the breakers at once,
        and out of health once it serves no role; its endpoints."""
        removed: list[Endpoint] = []
        for r in self._routing.roles:
            if role not in (None, r):
                continue
            eps = self._routing.endpoints(r)
            gone = [ep for ep in eps if ep.url == url]
            if gone:
                self._routing.set_endpoints(r, [ep for ep in eps if ep.url != url])
                removed.extend(gone)
        if not removed:
            return removed
        if not self.endpoints_of(url):
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

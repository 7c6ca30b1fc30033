"""Discovery's reconciler: the servers the pods call for, made real through the fleet only.

Rules of this module:

* It keeps, per role (one watch each), the last known state of every pod that watch sees, keyed
  by namespace/name, as the servers :func:`~.pod_rule.servers_of` gives it (none for a pod
  that is not a worker). An event replaces one pod's entry (DELETED drops it); a full list
  replaces the role's whole table, so a pod deleted while the watch was down, whose DELETED
  event never came, is gone after the next list.
* :meth:`Reconciler.sync` diffs the servers wanted against the fleet's servers whose origin is
  ``discovery`` — the fleet's, not a copy kept here, so a replacement worker 0 of
  ``--workers N`` reconciles against the fleet it inherited — and changes the fleet only through
  :meth:`~trio_pdrouter.fleet.servers.Fleet.withdraw` (at once: no new request goes there) and
  :meth:`~trio_pdrouter.fleet.servers.Fleet.add`. A withdrawn server drains in a task of its own
  (in-flight requests finish, load leaves the ledger at their last release); a new one takes traffic
  after its first good health probe, which runs in the health board's task, never here.
* A discovered server also wanted in another role, or for another pod (a new UID at the same
  address), is withdrawn and added again as what the pods now say.
* Servers from the command line or ``POST /workers`` are never removed by discovery: a pod at
  the address of one of them is left to it (logged once), in any role, and never added.
* The fleet has room for a bounded number of runtime servers (``--max-runtime-servers``, and
  with ``--workers N`` the machine table's slots: :class:`~trio_pdrouter.fleet.FleetFull`): past
  it a change is logged as an error and skipped, and discovery goes on (the next sync tries it
  again).
* One log line per change: ``discovery added|removed url=... role=... pod=ns/name uid=...``,
  with the reason of a removal.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

import trio

from ..config import Selector
from ..endpoints import Role
from ..fleet import Fleet, FleetFull, Origin
from .pod_rule import Pod, PodServer, ineligible, pod_ref, servers_of

log = logging.getLogger("trio_pdrouter.discovery")

DISCOVERY = "discovery"

#: Called with ("added" | "removed", the server, the reason) after every change of the fleet.
OnChange = Callable[[str, PodServer, str], None]


class Reconciler:
    """The pods each role's watch sees, and the fleet made to match them (module doc)."""

    def __init__(
        self,
        fleet: Fleet,
        selectors: Mapping[Role, Selector],
        ports: tuple[int, ...],
        *,
        serving: bool,
        drain_timeout: float,
        background: trio.Nursery,
        on_change: OnChange,
    ) -> None:
        """``serving``: new servers take traffic at once (health checks off); ``background``
        runs the drains of withdrawn servers."""
        self._fleet = fleet
        self._selectors = dict(selectors)
        self._ports = ports
        self._serving = serving
        self._drain_timeout = drain_timeout
        self._background = background
        self._on_change = on_change
        self._pods: dict[Role, dict[str, tuple[PodServer, ...]]] = {r: {} for r in selectors}
        self._why: dict[str, str] = {}  # url -> why its pod no longer wants it
        self._left_to_others: set[tuple[str, Role]] = set()

    @property
    def roles(self) -> tuple[Role, ...]:
        return tuple(self._selectors)

    def replace(self, role: Role, pods: Iterable[Pod]) -> None:
        """A full list of ``role``'s pods: it replaces everything known of them."""
        listed = {pod_ref(pod).key: self._servers(role, pod) for pod in pods}
        for key, servers in self._pods[role].items():
            if key not in listed:
                self._forget(servers, "absent from the pod list")
            else:
                self._forget(servers, "changed", keep=listed[key])
        self._pods[role] = listed

    def apply(self, role: Role, kind: str, pod: Pod) -> None:
        """One watch event (``ADDED``, ``MODIFIED`` or ``DELETED``) of ``role``'s pods."""
        key = pod_ref(pod).key
        old = self._pods[role].get(key, ())
        if kind == "DELETED":
            self._pods[role].pop(key, None)
            self._forget(old, "deleted")
            return
        new = self._servers(role, pod)
        self._pods[role][key] = new
        self._forget(old, ineligible(pod, self._selectors[role]) or "changed", keep=new)

    def wanted(self) -> dict[tuple[str, Role], PodServer]:
        """The servers the pods call for, by (URL, role)."""
        return {
            (server.url, server.role): server
            for pods in self._pods.values()
            for servers in pods.values()
            for server in servers
        }

    def sync(self) -> None:
        """Make the fleet's discovered servers what :meth:`wanted` says (module doc)."""
        wanted = self.wanted()
        fleet = self._fleet
        for url, origin in fleet.origins().items():
            if origin.source != DISCOVERY:
                continue
            have = {(url, ep.role, origin.pod) for ep in fleet.endpoints_of(url)}
            want = {(url, r, s.pod) for (u, r), s in wanted.items() if u == url}
            if have != want:
                self._withdraw(url, origin)
        for (url, role), server in wanted.items():
            current = fleet.origin(url)
            if current is None:
                self._add(server)
            elif current.source != DISCOVERY:
                self._leave(server, current)
            elif all(ep.role is not role for ep in fleet.endpoints_of(url)):
                self._add(server)

    def _servers(self, role: Role, pod: Pod) -> tuple[PodServer, ...]:
        return servers_of(pod, role, self._selectors[role], self._ports)

    def _forget(
        self, servers: Iterable[PodServer], reason: str, keep: tuple[PodServer, ...] = ()
    ) -> None:
        for server in servers:
            if server not in keep:
                self._why[server.url] = reason

    def _withdraw(self, url: str, origin: Origin) -> None:
        roles = [ep.role for ep in self._fleet.endpoints_of(url)]
        try:
            removed = self._fleet.withdraw(url)
        except FleetFull as exc:
            log.error("discovery url=%s not removed on every worker: %s", url, exc)
            return
        if not removed:
            return
        self._background.start_soon(self._fleet.drain, removed, self._drain_timeout)
        reason = self._why.pop(url, "changed")
        assert origin.pod is not None
        for role in dict.fromkeys(roles):
            server = PodServer(url, role, origin.pod, origin.bootstrap_port)
            log.info(
                "discovery removed url=%s role=%s pod=%s uid=%s reason=%s",
                url,
                role.value,
                origin.pod.key,
                origin.pod.uid,
                reason,
            )
            self._on_change("removed", server, reason)

    def _leave(self, server: PodServer, owner: Origin) -> None:
        """``server``'s address is a static or api server's: it stays theirs."""
        if (server.url, server.role) in self._left_to_others:
            return
        self._left_to_others.add((server.url, server.role))
        log.info(
            "discovery url=%s role=%s pod=%s is already a server from %s: left to it",
            server.url,
            server.role.value,
            server.pod.key,
            owner.source,
        )

    def _add(self, server: PodServer) -> None:
        origin = Origin(DISCOVERY, server.pod, server.bootstrap_port)
        try:
            self._fleet.add(server.url, server.role, serving=self._serving, origin=origin)
        except ValueError as exc:  # an address the router cannot use
            log.warning("discovery pod=%s refused: %s", server.pod.key, exc)
            return
        except FleetFull as exc:
            log.error("discovery url=%s not added: %s", server.url, exc)
            return
        self._why.pop(server.url, None)
        log.info(
            "discovery added url=%s role=%s pod=%s uid=%s",
            server.url,
            server.role.value,
            server.pod.key,
            server.pod.uid,
        )
        self._on_change("added", server, "ready")

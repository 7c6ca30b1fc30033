"""The reconciler: the fleet's discovered servers follow the pods, through Fleet only.

The state machine drives it as the watch loop does (events while the watch is up; changes
lost while it is down or after a 410; a full list on reconnect) and checks, after every quiet
moment, that the fleet's discovered servers are exactly the ready, matching pods' servers.
"""

from __future__ import annotations

import random
from typing import Any

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.fleet.test_servers import rig
from tests.pods import pod
from trio_pdrouter.config import Selector
from trio_pdrouter.discovery import PodServer, Reconciler
from trio_pdrouter.endpoints import Role
from trio_pdrouter.fleet import API, Fleet

PD = {Role.PREFILL: Selector.parse(("role=p",)), Role.DECODE: Selector.parse(("role=d",))}


class Drains:
    """Stands in for the nursery the reconciler drains withdrawn servers in."""

    def __init__(self) -> None:
        self.started: list[tuple[Any, ...]] = []

    def start_soon(self, fn: Any, *args: Any) -> None:
        self.started.append((fn, *args))


def reconciler(
    fleet: Fleet, selectors: dict[Role, Selector] = PD, ports: tuple[int, ...] = (80,)
) -> tuple[Reconciler, Drains, list[tuple[str, str, str]]]:
    drains = Drains()
    changes: list[tuple[str, str, str]] = []

    def on_change(kind: str, server: PodServer, reason: str) -> None:
        changes.append((kind, server.url, reason))

    rec = Reconciler(
        fleet,
        selectors,
        ports,
        serving=True,
        drain_timeout=5,
        background=drains,  # type: ignore[arg-type]
        on_change=on_change,
    )
    return rec, drains, changes


def discovered(fleet: Fleet) -> set[tuple[str, Role, str]]:
    return {
        (ep.url, ep.role, origin.pod.uid)
        for ep in fleet.endpoints()
        if (origin := fleet.origin(ep.url)) is not None
        and origin.source == "discovery"
        and origin.pod is not None
    }


def test_an_event_adds_and_a_delete_withdraws_at_once_and_drains_in_the_background() -> None:
    r = rig()
    rec, drains, changes = reconciler(r.fleet)
    p = pod("d-1", "10.0.0.2", labels={"role": "d"}, uid="u1")
    rec.apply(Role.DECODE, "ADDED", p)
    rec.sync()
    assert discovered(r.fleet) == {("http://10.0.0.2:80", Role.DECODE, "u1")}
    assert r.fleet.workers()[0]["pod"] == {"namespace": "default", "name": "d-1", "uid": "u1"}
    rec.apply(Role.DECODE, "DELETED", p)
    rec.sync()
    assert discovered(r.fleet) == set() and not r.routing.endpoints(Role.DECODE)
    assert len(drains.started) == 1 and drains.started[0][0] == r.fleet.drain
    assert changes == [
        ("added", "http://10.0.0.2:80", "ready"),
        ("removed", "http://10.0.0.2:80", "deleted"),
    ]


def test_a_modified_pod_that_stops_qualifying_is_withdrawn_with_the_reason() -> None:
    r = rig()
    rec, _, changes = reconciler(r.fleet)
    rec.apply(Role.DECODE, "ADDED", pod("d", "10.0.0.2", labels={"role": "d"}, uid="u"))
    rec.sync()
    rec.apply(
        Role.DECODE, "MODIFIED", pod("d", "10.0.0.2", labels={"role": "d"}, uid="u", ready=False)
    )
    rec.sync()
    assert discovered(r.fleet) == set()
    assert changes[-1] == ("removed", "http://10.0.0.2:80", "not ready")


def test_a_list_drops_pods_whose_delete_was_missed() -> None:
    r = rig()
    rec, _, changes = reconciler(r.fleet)
    rec.replace(
        Role.DECODE,
        [pod("a", "10.0.0.2", labels={"role": "d"}), pod("b", "10.0.0.3", labels={"role": "d"})],
    )
    rec.sync()
    assert len(discovered(r.fleet)) == 2
    rec.replace(Role.DECODE, [pod("b", "10.0.0.3", labels={"role": "d"})])
    rec.sync()
    assert {url for url, _, _ in discovered(r.fleet)} == {"http://10.0.0.3:80"}
    assert ("removed", "http://10.0.0.2:80", "absent from the pod list") in changes


def test_a_new_uid_or_ip_replaces_the_old_server() -> None:
    r = rig()
    rec, _, _ = reconciler(r.fleet)
    rec.apply(Role.DECODE, "ADDED", pod("s-0", "10.0.0.2", labels={"role": "d"}, uid="u1"))
    rec.sync()
    rec.apply(Role.DECODE, "MODIFIED", pod("s-0", "10.0.0.2", labels={"role": "d"}, uid="u2"))
    rec.sync()
    assert discovered(r.fleet) == {("http://10.0.0.2:80", Role.DECODE, "u2")}
    rec.apply(Role.DECODE, "MODIFIED", pod("s-0", "10.0.0.9", labels={"role": "d"}, uid="u2"))
    rec.sync()
    assert discovered(r.fleet) == {("http://10.0.0.9:80", Role.DECODE, "u2")}


def test_static_and_api_servers_are_never_removed_and_their_address_is_left_to_them() -> None:
    r = rig()
    r.fleet.add_at_start("http://10.0.0.2:80", Role.DECODE)
    r.fleet.add("http://10.0.0.3:80", Role.DECODE, serving=True, origin=API)
    rec, _, changes = reconciler(r.fleet)
    rec.replace(
        Role.DECODE,
        [pod("a", "10.0.0.2", labels={"role": "d"}), pod("b", "10.0.0.3", labels={"role": "d"})],
    )
    rec.replace(Role.PREFILL, [pod("a2", "10.0.0.2", labels={"role": "p"})])
    rec.sync()
    rec.replace(Role.DECODE, [])
    rec.replace(Role.PREFILL, [])
    rec.sync()
    assert changes == []
    assert [w["source"] for w in r.fleet.workers()] == ["static", "api"]


def test_a_pod_in_both_roles_is_both_and_leaving_one_keeps_the_other() -> None:
    r = rig()
    rec, _, _ = reconciler(r.fleet)
    both = pod("x", "10.0.0.4", labels={"role": "p"}, uid="u")
    rec.apply(Role.PREFILL, "ADDED", both)
    rec.apply(Role.DECODE, "ADDED", pod("x", "10.0.0.4", labels={"role": "d"}, uid="u"))
    rec.sync()
    assert {role for _, role, _ in discovered(r.fleet)} == {Role.PREFILL, Role.DECODE}
    rec.apply(Role.DECODE, "DELETED", both)
    rec.sync()
    assert discovered(r.fleet) == {("http://10.0.0.4:80", Role.PREFILL, "u")}


def test_a_reconciler_over_an_inherited_fleet_removes_what_the_pods_no_longer_want() -> None:
    r = rig()
    first, _, _ = reconciler(r.fleet)
    first.replace(Role.DECODE, [pod("a", "10.0.0.2", labels={"role": "d"})])
    first.sync()
    second, _, _ = reconciler(r.fleet)  # a replacement worker 0: knows no pod yet
    second.replace(Role.DECODE, [])
    second.replace(Role.PREFILL, [])
    second.sync()
    assert discovered(r.fleet) == set()


NAMES = [f"pod-{i}" for i in range(4)]
#: Each name has addresses of its own: two live pods never share one (as in a cluster), but a
#: pod recreated under its name may get its old address or a new one.
IPS = {name: [f"10.0.{i}.1", f"10.0.{i}.2", None] for i, name in enumerate(NAMES)}
ROLES = {Role.PREFILL: "p", Role.DECODE: "d"}
BOTH = {Role.PREFILL: Selector.parse(("p=1",)), Role.DECODE: Selector.parse(("d=1",))}
PORTS = (8000, 8001)


def qualifies(p: dict[str, Any], role: Role) -> bool:
    meta, status = p["metadata"], p["status"]
    return bool(
        status["conditions"][1]["status"] == "True"
        and status["phase"] == "Running"
        and status.get("podIP")
        and meta["labels"].get(ROLES[role]) == "1"
        and "deletionTimestamp" not in meta
    )


class DiscoveryMachine(RuleBasedStateMachine):
    """Pods change in a cluster; each role's watch delivers events only while it is up."""

    def __init__(self) -> None:
        super().__init__()
        self.rig = rig()
        self.rec, _, _ = reconciler(self.rig.fleet, BOTH, PORTS)
        self.cluster: dict[str, dict[str, Any]] = {}
        self.up = {Role.PREFILL: True, Role.DECODE: True}
        self.uids = random.Random(0)

    def _deliver(self, kind: str, p: dict[str, Any]) -> None:
        for role, up in self.up.items():
            if up:
                self.rec.apply(role, kind, p)
        self.rec.sync()

    @rule(
        name=st.sampled_from(NAMES),
        ip=st.integers(0, 2),
        ready=st.booleans(),
        phase=st.sampled_from(["Running", "Running", "Pending", "Failed"]),
        roles=st.sampled_from([{"p": "1"}, {"d": "1"}, {"p": "1", "d": "1"}, {"x": "1"}]),
        deleting=st.booleans(),
        new_uid=st.booleans(),
    )
    def put(
        self,
        name: str,
        ip: int,
        ready: bool,
        phase: str,
        roles: dict[str, str],
        deleting: bool,
        new_uid: bool,
    ) -> None:
        old = self.cluster.get(name)
        uid = f"uid-{self.uids.getrandbits(32)}"
        if old is not None and not new_uid:
            uid = old["metadata"]["uid"]
        p = pod(
            name, IPS[name][ip], uid=uid, labels=roles, ready=ready, phase=phase, deleting=deleting
        )
        self.cluster[name] = p
        if old is not None and old["metadata"]["uid"] != uid:  # recreated: the old one went
            self._deliver("DELETED", old)
            self._deliver("ADDED", p)
        else:
            self._deliver("ADDED" if old is None else "MODIFIED", p)

    @rule(name=st.sampled_from(NAMES))
    def delete(self, name: str) -> None:
        old = self.cluster.pop(name, None)
        if old is not None:  # graceful or forced: only DELETED is sure to come
            self._deliver("DELETED", old)

    @rule(role=st.sampled_from([Role.PREFILL, Role.DECODE]))
    def watch_breaks(self, role: Role) -> None:
        """A broken watch, a 410, a silent stall: events are lost until the next list."""
        self.up[role] = False

    @precondition(lambda self: not all(self.up.values()))
    @rule()
    def relist(self) -> None:
        for role, up in self.up.items():
            if not up:  # the server-side selector: the list has the role's pods only
                label = ROLES[role]
                pods = [p for p in self.cluster.values() if p["metadata"]["labels"].get(label)]
                self.rec.replace(role, pods)
                self.up[role] = True
        self.rec.sync()

    @invariant()
    def quiet_means_the_fleet_is_the_ready_matching_pods(self) -> None:
        if not all(self.up.values()):
            return
        want = {
            (f"http://{p['status']['podIP']}:{port}", role, p["metadata"]["uid"])
            for p in self.cluster.values()
            for role in ROLES
            if qualifies(p, role)
            for port in PORTS
        }
        assert discovered(self.rig.fleet) == want
        assert set(self.rig.fleet.origins()) == {url for url, _, _ in want}


TestDiscoveryMachine = DiscoveryMachine.TestCase
TestDiscoveryMachine.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)


def test_a_full_fleet_skips_the_change_and_discovery_tries_again_when_there_is_room() -> None:
    r = rig(max_runtime=1)
    rec, _, changes = reconciler(r.fleet)
    rec.apply(Role.DECODE, "ADDED", pod("d", "10.0.0.2", labels={"role": "d"}))
    rec.apply(Role.DECODE, "ADDED", pod("e", "10.0.0.3", labels={"role": "d"}))
    rec.sync()
    assert [(kind, url) for kind, url, _ in changes] == [("added", "http://10.0.0.2:80")]
    rec.apply(Role.DECODE, "DELETED", pod("d", "10.0.0.2", labels={"role": "d"}))
    rec.sync()
    assert {url for url, _, _ in discovered(r.fleet)} == {"http://10.0.0.3:80"}


def test_a_pod_at_an_address_no_engine_has_is_refused() -> None:
    r = rig()
    rec, _, _ = reconciler(r.fleet)
    rec.apply(Role.DECODE, "ADDED", pod("d", "169.254.169.254", labels={"role": "d"}))
    rec.apply(Role.DECODE, "ADDED", pod("e", "10.0.0.3", labels={"role": "d"}))
    rec.sync()
    assert {url for url, _, _ in discovered(r.fleet)} == {"http://10.0.0.3:80"}

"""The fleet: the one owner of servers (add, validate, remove, drain), and the app's wiring."""

from __future__ import annotations

import inspect
import random

import attrs
import httpx
import pytest
import trio
import trio.testing

from tests.harness import pd_config
from trio_pdrouter.app import RouterApp
from trio_pdrouter.assemble import build_app
from trio_pdrouter.config import AdmissionSettings, BreakerSettings, HealthSettings
from trio_pdrouter.endpoints import Role, UpstreamPolicy
from trio_pdrouter.fleet import Breakers, DuplicateServer, Fleet, FleetFull, HealthBoard
from trio_pdrouter.http import LegClient
from trio_pdrouter.ledger import LoadLedger
from trio_pdrouter.routing import PolicySettings, Routing, make_policy
from trio_pdrouter.serve import (
    Admission,
    BufferBudget,
    BufferedDecode,
    DecodeRelay,
    KvReclaimer,
    PrefillLeg,
    Proxy,
)


@attrs.define
class Rig:
    fleet: Fleet
    routing: Routing
    ledger: LoadLedger
    health: HealthBoard
    breakers: Breakers


def rig(dp_size: int = 1, max_runtime: int = 64) -> Rig:
    ledger = LoadLedger()
    health = HealthBoard(HealthSettings())
    breakers = Breakers(BreakerSettings(failure_threshold=1), in_flight=ledger.load)
    policies = {
        role: make_policy(
            "round_robin",
            stage=role.value,
            settings=PolicySettings(),
            on_decision=lambda stage, reason: None,
            rng=random.Random(0),
        )
        for role in (Role.PREFILL, Role.DECODE)
    }
    routing = Routing(policies, ledger, (health.is_healthy,), None, by_tokens=(), models=None)
    fleet = Fleet(
        dp_size=dp_size,
        routing=routing,
        ledger=ledger,
        health=health,
        breakers=breakers,
        machine=None,
        max_runtime=max_runtime,
        policy=UpstreamPolicy(),
    )
    return Rig(fleet, routing, ledger, health, breakers)


def test_add_registers_every_rank_with_routing_ledger_and_health() -> None:
    r = rig(dp_size=2)
    added = r.fleet.add("http://d:1/", Role.DECODE, serving=True)
    assert [ep.key for ep in added] == ["http://d:1@0", "http://d:1@1"]
    assert r.routing.endpoints(Role.DECODE) == added
    assert r.routing.candidates(Role.DECODE) == list(added)
    assert r.ledger.by_role(Role.DECODE) == {"http://d:1@0": 0, "http://d:1@1": 0}
    assert r.health.health("http://d:1") == "healthy"


def test_a_server_added_at_run_time_waits_for_its_first_probe() -> None:
    r = rig()
    r.fleet.add("http://d:1", Role.DECODE, serving=False)
    assert r.health.health("http://d:1") == "pending"
    assert r.routing.candidates(Role.DECODE) == []


def test_duplicates_bad_urls_and_foreign_roles_are_refused_and_change_nothing() -> None:
    r = rig()
    r.fleet.add("http://d:1", Role.DECODE, serving=True)
    with pytest.raises(DuplicateServer, match="already a decode server"):
        r.fleet.add("http://d:1/", Role.DECODE, serving=True)
    for url, role in [
        ("ftp://d:2", Role.DECODE),
        ("http://d", Role.DECODE),
        ("http://r:1", Role.REGULAR),
    ]:
        with pytest.raises(ValueError):
            r.fleet.add(url, role, serving=True)
    assert [ep.key for ep in r.fleet.endpoints()] == ["http://d:1"]
    # One URL may serve another role once (a server that does both).
    r.fleet.add("http://d:1", Role.PREFILL, serving=True)
    assert {ep.role for ep in r.fleet.endpoints_of("http://d:1")} == {Role.PREFILL, Role.DECODE}


def test_routing_lists_cannot_be_changed_from_outside() -> None:
    r = rig()
    r.fleet.add("http://d:1", Role.DECODE, serving=True)
    endpoints = r.routing.endpoints(Role.DECODE)
    assert isinstance(endpoints, tuple)
    assert not hasattr(r.routing, "endpoints_by_role")


async def test_remove_stops_routing_at_once_and_forgets_the_server_once_idle() -> None:
    r = rig()
    r.fleet.add("http://p:1", Role.PREFILL, serving=True)
    (d,) = r.fleet.add("http://d:1", Role.DECODE, serving=True)
    r.breakers.record_failure(d, 0.0)
    assert r.breakers.state(d) == "open"
    lease = r.ledger.lease(d)
    removal = None

    async def remove() -> None:
        nonlocal removal
        removal = await r.fleet.remove("http://d:1", drain_timeout=60)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(remove)
        await trio.testing.wait_all_tasks_blocked()
        assert r.routing.endpoints(Role.DECODE) == ()
        assert r.health.health("http://d:1") is None
        assert r.breakers.state(d) == "closed", "its breaker is forgotten"
        assert removal is None, "the removal waits for the request in flight"
        lease.release_all()
    assert removal is not None and removal.removed == (d,) and removal.in_flight == 0
    assert r.ledger.by_role(Role.DECODE) == {}
    assert await r.fleet.remove("http://d:1", drain_timeout=1) is None


async def test_remove_after_the_drain_timeout_reports_what_is_still_busy(
    autojump_clock: trio.testing.MockClock,
) -> None:
    r = rig()
    (d,) = r.fleet.add("http://d:1", Role.DECODE, serving=True)
    lease = r.ledger.lease(d)
    removal = await r.fleet.remove("http://d:1", drain_timeout=5)
    assert removal is not None and removal.in_flight == 1
    assert r.ledger.load(d) == 1, "the request in flight keeps its charge"
    lease.release_all()
    assert r.ledger.load(d) == 0


def test_runtime_servers_past_the_cap_are_refused_and_change_nothing() -> None:
    r = rig(max_runtime=2)
    r.fleet.add_at_start("http://p:1", Role.PREFILL)  # the command line's: not counted
    r.fleet.add("http://d:1", Role.DECODE, serving=True)
    r.fleet.add("http://d:2", Role.DECODE, serving=True)
    before = r.fleet.endpoints()
    with pytest.raises(FleetFull, match="--max-runtime-servers"):
        r.fleet.add("http://d:3", Role.DECODE, serving=True)
    assert r.fleet.endpoints() == before and r.health.health("http://d:3") is None
    assert r.ledger.by_role(Role.DECODE) == {"http://d:1": 0, "http://d:2": 0}
    r.fleet.withdraw("http://d:1")
    r.fleet.add("http://d:3", Role.DECODE, serving=True)  # room again


async def test_one_role_of_a_url_can_be_removed_and_the_other_keeps_serving() -> None:
    r = rig()
    (p,) = r.fleet.add("http://x:1", Role.PREFILL, serving=True)
    r.fleet.add("http://x:1", Role.DECODE, serving=True)
    removal = await r.fleet.remove("http://x:1", drain_timeout=1, role=Role.DECODE)
    assert removal is not None and [ep.role for ep in removal.removed] == [Role.DECODE]
    assert r.fleet.endpoints() == [p]
    assert r.health.health("http://x:1") == "healthy", "the URL still serves prefill"
    assert r.fleet.origin("http://x:1") is not None
    assert await r.fleet.remove("http://x:1", drain_timeout=1, role=Role.DECODE) is None
    await r.fleet.remove("http://x:1", drain_timeout=1)
    assert r.fleet.endpoints() == [] and r.health.health("http://x:1") is None


# -- collaborators are given at construction ----------------------------------------------------

#: Parameters that may be left out: values, not collaborators.
OPTIONAL = {"rng", "release_at_headers", "engine_truth", "takeover_after"}


@pytest.mark.parametrize(
    "cls", [Proxy, RouterApp, Fleet, Routing, KvReclaimer, PrefillLeg, BufferedDecode, DecodeRelay]
)
def test_request_path_classes_have_no_optional_collaborators(cls: type) -> None:
    """A collaborator with a default could be left out, silently disabling what it does."""
    params = inspect.signature(cls.__init__).parameters.values()
    defaulted = {p.name for p in params if p.default is not inspect.Parameter.empty}
    assert defaulted <= OPTIONAL, f"{cls.__name__}: {defaulted - OPTIONAL} have defaults"


async def test_the_app_cannot_be_built_without_its_background_nursery() -> None:
    client = LegClient(transport=httpx.MockTransport(lambda r: httpx.Response(200)))
    with pytest.raises(TypeError, match="background"):
        build_app(pd_config(), client)  # type: ignore[call-arg]


def test_the_proxy_cannot_be_built_without_a_reclaimer() -> None:
    client = LegClient(transport=httpx.MockTransport(lambda r: httpx.Response(200)))
    r = rig()
    with pytest.raises(TypeError, match="reclaimer"):
        Proxy(  # type: ignore[call-arg]
            pd_config(),
            routing=r.routing,
            admission=Admission(AdmissionSettings()),
            outcomes=r.breakers,
            prefill=PrefillLeg(client, 1.0, None, 1 << 20, grace=0.0, on_late_answer=lambda: None),
            buffered=BufferedDecode(client, 1.0, 1 << 20),
            relay=DecodeRelay(
                client,
                first_byte_limit=1.0,
                stream_timeout=httpx.Timeout(1.0),
                max_buffered_bytes=1,
                budget=BufferBudget(1),
                pump=None,
            ),
        )

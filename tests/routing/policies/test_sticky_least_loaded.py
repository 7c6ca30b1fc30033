"""``sticky_least_loaded``: a new session goes to the least loaded endpoint (the ledger's load),
then stays there while that endpoint is a candidate; the session map is bounded by TTL and
capacity, and forgets sessions on request and with their removed endpoints."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from trio_pdrouter.endpoints import Endpoint, Role
from trio_pdrouter.routing import PolicySettings, RoutingKey, make_policy
from trio_pdrouter.routing.policies import StickyLeastLoaded, StickySessions

EPS = [Endpoint(f"http://10.0.0.{i}:8000", Role.DECODE) for i in range(3)]
IDLE = dict.fromkeys(EPS, 0)


class Clock:
    """Time the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def policy(
    *, ttl: float = 60.0, capacity: int = 1000, seed: int = 0
) -> tuple[StickyLeastLoaded, Clock]:
    clock = Clock()
    chosen = StickyLeastLoaded(random.Random(seed), StickySessions(ttl, capacity, clock))
    chosen.set_endpoints(EPS)
    return chosen, clock


def session(name: str | None, prompt: str = "hi") -> RoutingKey:
    return RoutingKey(text=prompt, hash_key=name)


def test_a_new_session_goes_to_the_least_loaded_candidate() -> None:
    sticky, _ = policy()
    loads = {EPS[0]: 5, EPS[1]: 2, EPS[2]: 7}
    assert sticky.choose(EPS, loads, session("s1")) == EPS[1]
    assert sticky.sessions.bound(EPS[1]) == 1


def test_a_session_stays_on_its_endpoint_whatever_the_loads_then() -> None:
    sticky, clock = policy()
    home = sticky.choose(EPS, IDLE, session("s1"))
    for step in range(10):
        clock.now += 30  # each request refreshes it: 300 s is far past one 60 s TTL
        loads = {ep: (100 if ep == home else step) for ep in EPS}
        assert sticky.choose(EPS, loads, session("s1", f"turn {step}")) == home
    assert len(sticky.sessions) == 1


def test_new_sessions_on_equal_loads_spread_by_sessions_bound() -> None:
    sticky, _ = policy()
    homes = Counter(sticky.choose(EPS, IDLE, session(f"s{i}")) for i in range(30))
    assert homes == dict.fromkeys(EPS, 10)


def test_ties_are_broken_by_the_session_not_by_the_process() -> None:
    # Two processes (two maps) meeting one new session on equal candidates choose alike.
    first, _ = policy(seed=1)
    second, _ = policy(seed=2)
    for i in range(20):
        assert first.choose(EPS, IDLE, session(f"s{i}")) == second.choose(
            EPS, IDLE, session(f"s{i}")
        )
        first.finish(f"s{i}")
        second.finish(f"s{i}")


def test_a_session_whose_endpoint_is_no_candidate_moves_to_the_least_loaded_and_stays() -> None:
    sticky, _ = policy()
    loads = {EPS[0]: 0, EPS[1]: 3, EPS[2]: 1}
    assert sticky.choose(EPS, loads, session("s1")) == EPS[0]
    survivors = [EPS[1], EPS[2]]  # EPS[0] unhealthy (or its breaker open)
    assert sticky.choose(survivors, loads, session("s1")) == EPS[2]
    assert sticky.sessions.bound(EPS[0]) == 0
    assert sticky.sessions.bound(EPS[2]) == 1
    # Its old endpoint back and idle: the session stays where it went.
    assert sticky.choose(EPS, dict.fromkeys(EPS, 0), session("s1")) == EPS[2]


def test_a_removed_endpoint_takes_its_sessions_with_it() -> None:
    sticky, _ = policy()
    home = sticky.choose(EPS, IDLE, session("s1"))
    others = [ep for ep in EPS if ep != home]
    sticky.set_endpoints(others)
    assert len(sticky.sessions) == 0
    assert sticky.sessions.bound(home) == 0
    assert sticky.choose(others, IDLE, session("s1")) in others


def test_an_idle_session_is_forgotten_after_the_ttl_and_counts_no_more() -> None:
    sticky, clock = policy(ttl=60)
    home = sticky.choose(EPS, IDLE, session("s1"))
    clock.now += 59.9
    assert sticky.sessions.home("s1") == home
    clock.now += 60
    assert sticky.sessions.home("s1") is None
    assert sticky.sessions.bound(home) == 0
    # Now the least loaded wins again, where it would have stayed home.
    loads = {ep: (0 if ep != home else 9) for ep in EPS}
    assert sticky.choose(EPS, loads, session("s1")) != home


def test_maintain_expires_without_a_request() -> None:
    sticky, clock = policy(ttl=10)
    for i in range(5):
        sticky.choose(EPS, IDLE, session(f"s{i}"))
    clock.now += 10
    assert sticky.maintain() is False
    assert len(sticky.sessions) == 0
    assert all(sticky.sessions.bound(ep) == 0 for ep in EPS)


def test_the_map_keeps_at_most_its_capacity_dropping_the_least_recently_used() -> None:
    sticky, clock = policy(capacity=4)
    for i in range(4):
        clock.now += 1
        sticky.choose(EPS, IDLE, session(f"s{i}"))
    clock.now += 1
    sticky.choose(EPS, IDLE, session("s0"))  # s0 used again: s1 is now the oldest
    for i in range(4, 10):
        clock.now += 1
        sticky.choose(EPS, IDLE, session(f"s{i}"))
        assert len(sticky.sessions) == 4
        assert sum(sticky.sessions.bound(ep) for ep in EPS) == 4
    assert sticky.sessions.home("s1") is None
    assert sticky.sessions.home("s9") is not None


def test_finish_forgets_a_session_and_its_count() -> None:
    sticky, _ = policy()
    home = sticky.choose(EPS, IDLE, session("s1"))
    assert sticky.finish("s1") is True
    assert sticky.finish("s1") is False
    assert sticky.sessions.bound(home) == 0
    assert len(sticky.sessions) == 0


def test_a_request_without_a_session_binds_nothing_and_goes_least_loaded() -> None:
    sticky, _ = policy()
    loads = {EPS[0]: 4, EPS[1]: 4, EPS[2]: 1}
    assert sticky.choose(EPS, loads, session(None)) == EPS[2]
    assert len(sticky.sessions) == 0
    chosen = {sticky.choose(EPS, IDLE, session(None, f"p{i}")) for i in range(40)}
    assert chosen == set(EPS)  # ties at random, not always the first


def test_make_policy_builds_it_from_the_flags() -> None:
    built = make_policy(
        "sticky_least_loaded",
        stage="decode",
        settings=PolicySettings(sticky_session_ttl_secs=5.0, sticky_max_sessions=3),
        on_decision=lambda _s, _r: None,
        endpoints=EPS,
    )
    assert isinstance(built, StickyLeastLoaded)
    assert (built.sessions.ttl, built.sessions.capacity) == (5.0, 3)


def test_a_map_needs_a_positive_ttl_and_capacity() -> None:
    with pytest.raises(ValueError, match="positive ttl and capacity"):
        StickySessions(0, 1, Clock())
    with pytest.raises(ValueError, match="positive ttl and capacity"):
        StickySessions(1, 0, Clock())


def test_every_decision_is_told_with_its_reason() -> None:
    told: list[tuple[str, str]] = []
    built = make_policy(
        "sticky_least_loaded",
        stage="decode",
        settings=PolicySettings(),
        on_decision=lambda stage, reason: told.append((stage, reason)),
        endpoints=EPS,
    )
    home = built.choose(EPS, IDLE, session("s1"))
    built.choose(EPS, IDLE, session("s1"))
    built.choose([ep for ep in EPS if ep != home], IDLE, session("s1"))
    built.choose(EPS, IDLE, session(None))
    assert told == [
        ("decode", "session_placed"),
        ("decode", "session_kept"),
        ("decode", "session_moved"),
        ("decode", "no_session"),
    ]

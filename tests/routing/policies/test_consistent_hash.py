from __future__ import annotations

import hashlib
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from trio_pdrouter.endpoints import Endpoint, Role
from trio_pdrouter.routing import RoutingKey
from trio_pdrouter.routing.policies import ConsistentHash

EPS = [Endpoint(f"http://10.0.0.{i}:8000", Role.DECODE) for i in range(1, 6)]


def point(value: str) -> int:
    return int.from_bytes(hashlib.blake2b(value.encode(), digest_size=8).digest(), "big")


def brute_force(endpoints: list[Endpoint], healthy: list[Endpoint], key: str) -> Endpoint:
    """Walk a ring built independently: first point at or after the key's, owner healthy."""
    ring = sorted((point(f"{ep.key}#{i}"), ep.key, ep) for ep in endpoints for i in range(160))
    h = point(key)
    after = [entry for entry in ring if entry[0] >= h] + [entry for entry in ring if entry[0] < h]
    return next(ep for _, _, ep in after if ep in healthy)


def policy_over(endpoints: list[Endpoint]) -> ConsistentHash:
    policy = ConsistentHash(random.Random(0))
    policy.set_endpoints(endpoints)
    return policy


def test_adding_an_endpoint_moves_about_one_nth_of_keys() -> None:
    four, five = policy_over(EPS[:4]), policy_over(EPS)
    keys = [RoutingKey(hash_key=f"session-{i}") for i in range(10_000)]
    moved = [k for k in keys if four.choose(EPS[:4], {}, k) != five.choose(EPS, {}, k)]
    assert 0.10 < len(moved) / len(keys) < 0.30
    # Every moved key moved to the new endpoint, none between old ones.
    assert all(five.choose(EPS, {}, k) == EPS[4] for k in moved)


def test_keys_spread_over_endpoints() -> None:
    policy = policy_over(EPS)
    picks = [policy.choose(EPS, {}, RoutingKey(hash_key=f"u{i}")) for i in range(5000)]
    assert all(500 < picks.count(ep) < 1600 for ep in EPS)


@settings(max_examples=100, deadline=None)
@given(
    healthy=st.lists(st.sampled_from(EPS), min_size=1, unique=True),
    key=st.text(min_size=1, max_size=20),
)
def test_unhealthy_target_goes_to_next_ring_node(healthy: list[Endpoint], key: str) -> None:
    policy = policy_over(EPS)
    chosen = policy.choose(healthy, {}, RoutingKey(hash_key=key))
    assert chosen == brute_force(EPS, healthy, key)


def test_unhealthy_target_keys_spread_over_survivors() -> None:
    # Not "the first healthy endpoint": the dead endpoint's sessions land on several survivors.
    policy = policy_over(EPS)
    dead = EPS[0]
    orphans = [
        k
        for k in (RoutingKey(hash_key=f"s{i}") for i in range(2000))
        if policy.choose(EPS, {}, k) == dead
    ]
    survivors = {policy.choose(EPS[1:], {}, k) for k in orphans}
    assert len(survivors) == 4


def test_stable_across_instances_and_fallbacks() -> None:
    a, b = policy_over(EPS), policy_over(list(reversed(EPS)))
    for i in range(100):
        key = RoutingKey(hash_key=f"user-{i}")
        assert a.choose(EPS, {}, key) == b.choose(EPS, {}, key)
    # No hash key: the routing text decides, so the same prompt lands on the same endpoint.
    prompt = RoutingKey(text="a long shared system prompt")
    assert len({a.choose(EPS, {}, prompt) for _ in range(20)}) == 1
    # Neither: least loaded.
    loads = dict.fromkeys(EPS, 5) | {EPS[3]: 1}
    assert a.choose(EPS, loads, RoutingKey()) == EPS[3]


def test_candidates_unknown_to_the_ring_fall_back_to_least_loaded() -> None:
    policy = policy_over(EPS[:2])
    stranger = Endpoint("http://10.9.9.9:8000", Role.DECODE)
    assert policy.choose([stranger], {}, RoutingKey(hash_key="x")) == stranger

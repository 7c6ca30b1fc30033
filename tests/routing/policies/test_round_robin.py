from __future__ import annotations

import random

from trio_pdrouter.endpoints import Endpoint, Role
from trio_pdrouter.routing import RoutingKey
from trio_pdrouter.routing.policies import RoundRobin

EPS = [Endpoint(f"http://h{i}:8000", Role.PREFILL) for i in range(3)]


def test_cycles_through_candidates_whatever_the_load() -> None:
    policy = RoundRobin(random.Random(1))
    loads = {EPS[0]: 100, EPS[1]: 0, EPS[2]: 0}
    picks = [policy.choose(EPS, loads, RoutingKey()) for _ in range(9)]
    assert sorted(picks[:3], key=EPS.index) == EPS
    assert picks[3:6] == picks[:3] == picks[6:]


def test_start_offset_differs_between_instances() -> None:
    firsts = {RoundRobin(random.Random(s)).choose(EPS, {}, RoutingKey()) for s in range(20)}
    assert len(firsts) > 1

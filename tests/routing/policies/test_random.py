from __future__ import annotations

import random
from collections import Counter

from trio_pdrouter.endpoints import Endpoint, Role
from trio_pdrouter.routing import RoutingKey
from trio_pdrouter.routing.policies import Random

EPS = [Endpoint(f"http://h{i}:8000", Role.DECODE) for i in range(4)]


def test_roughly_uniform_and_reproducible() -> None:
    picks = [Random(random.Random(3)).choose(EPS, {}, RoutingKey()) for _ in range(3)]
    assert len(set(picks)) == 1  # same seed, same first pick
    policy = Random(random.Random(5))
    counts = Counter(policy.choose(EPS, {}, RoutingKey()) for _ in range(4000))
    assert set(counts) == set(EPS)
    assert all(800 < n < 1200 for n in counts.values())

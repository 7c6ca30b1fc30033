from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from trio_pdrouter.endpoints import Endpoint, Role
from trio_pdrouter.routing import RoutingKey
from trio_pdrouter.routing.policies import PowerOfTwo

EPS = [Endpoint(f"http://h{i}:8000", Role.DECODE) for i in range(6)]


@settings(max_examples=200, deadline=None)
@given(
    pair=st.lists(st.sampled_from(EPS), min_size=2, max_size=2, unique=True),
    loads=st.lists(st.integers(0, 1000), min_size=2, max_size=2, unique=True),
    seed=st.integers(0, 2**32),
)
def test_never_the_strictly_more_loaded_of_two(
    pair: list[Endpoint], loads: list[int], seed: int
) -> None:
    policy = PowerOfTwo(random.Random(seed))
    load_map = dict(zip(pair, loads, strict=True))
    for _ in range(5):
        chosen = policy.choose(pair, load_map, RoutingKey())
        assert load_map[chosen] == min(loads)


def test_single_candidate_and_ties() -> None:
    policy = PowerOfTwo(random.Random(0))
    assert policy.choose(EPS[:1], {EPS[0]: 9}, RoutingKey()) == EPS[0]
    counts = Counter(policy.choose(EPS[:2], {}, RoutingKey()) for _ in range(400))
    assert set(counts) == set(EPS[:2])  # a tie is a coin flip, not always the first


def test_never_picks_the_global_maximum_among_many() -> None:
    # The most loaded endpoint can only win if it is sampled with an equally loaded one.
    policy = PowerOfTwo(random.Random(1))
    loads = {ep: i for i, ep in enumerate(EPS)}
    picks = Counter(policy.choose(EPS, loads, RoutingKey()) for _ in range(2000))
    assert EPS[-1] not in picks
    assert picks[EPS[0]] > picks[EPS[4]]

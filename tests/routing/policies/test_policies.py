"""Properties every policy keeps, whatever its name (``make_policy`` and the shared contract)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_pdrouter.endpoints import Endpoint, Role
from trio_pdrouter.routing import POLICIES, POLICY_NAMES, PolicySettings, RoutingKey, make_policy

ENDPOINTS = [Endpoint("http://10.0.0.1:8000", Role.DECODE, rank) for rank in range(4)] + [
    Endpoint(f"http://10.0.0.{i}:8000", Role.DECODE) for i in range(2, 6)
]

requests = st.lists(
    st.tuples(
        st.lists(st.sampled_from(ENDPOINTS), min_size=1, unique=True),  # healthy candidates
        st.lists(st.integers(0, 200), min_size=len(ENDPOINTS), max_size=len(ENDPOINTS)),
        st.text(alphabet="ab", max_size=12),
        st.none() | st.sampled_from(["s1", "s2", "s3"]),
    ),
    min_size=1,
    max_size=25,
)


def ignore(stage: str, reason: str) -> None:
    """Policy decisions are counted in metrics by the router; these tests do not look."""


@pytest.mark.parametrize("name", POLICY_NAMES)
@settings(max_examples=60, deadline=None)
@given(reqs=requests, seed=st.integers(0, 2**32))
def test_never_returns_an_endpoint_outside_the_candidates(
    name: str, reqs: list[tuple[list[Endpoint], list[int], str, str | None]], seed: int
) -> None:
    # Loads around the balance thresholds so cache_aware exercises both branches.
    policy = make_policy(
        name,
        stage="decode",
        settings=PolicySettings(balance_abs_threshold=20, balance_rel_threshold=1.2),
        on_decision=ignore,
        endpoints=ENDPOINTS,
        rng=random.Random(seed),
    )
    for i, (candidates, load_list, text, hash_key) in enumerate(reqs):
        loads = dict(zip(ENDPOINTS, load_list, strict=True))
        chosen = policy.choose(candidates, loads, RoutingKey(text, hash_key))
        assert chosen in candidates
        if i % 7 == 6:
            policy.maintain()


def test_the_factories_are_the_names_the_config_accepts() -> None:
    # In the same order: --help lists the choices, and an unknown name's message lists the table.
    assert tuple(POLICIES) == POLICY_NAMES


def test_make_policy_knows_every_name() -> None:
    assert set(POLICY_NAMES) == {
        "round_robin",
        "random",
        "power_of_two",
        "consistent_hash",
        "cache_aware",
        "kv_aware",
        "sticky_least_loaded",
    }
    for name in POLICY_NAMES:
        policy = make_policy(
            name,
            stage="prefill",
            settings=PolicySettings(),
            on_decision=ignore,
            endpoints=ENDPOINTS,
        )
        assert policy.name == name
    with pytest.raises(ValueError, match="unknown policy 'nope'; choose one of round_robin"):
        make_policy(
            "nope", stage="prefill", settings=PolicySettings(), on_decision=ignore, endpoints=()
        )


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_equal_loads_do_not_always_pick_the_first(name: str) -> None:
    policy = make_policy(
        name,
        stage="decode",
        settings=PolicySettings(),
        on_decision=ignore,
        endpoints=ENDPOINTS,
        rng=random.Random(7),
    )
    loads = dict.fromkeys(ENDPOINTS, 3)
    chosen = {policy.choose(ENDPOINTS, loads, RoutingKey(f"{i}-" * 3, f"u{i}")) for i in range(64)}
    assert len(chosen) > 1

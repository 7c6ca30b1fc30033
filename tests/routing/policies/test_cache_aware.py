from __future__ import annotations

import logging
import random
import re

import pytest

from trio_pdrouter.endpoints import Endpoint, Role
from trio_pdrouter.routing import CacheAware, PolicySettings, RoutingKey
from trio_pdrouter.routing.policies import cache_aware

EPS = [Endpoint("http://10.0.0.1:8000", Role.DECODE, rank) for rank in range(4)]
PREFIX = "You are a helpful assistant. " * 10


def make(**overrides: int) -> CacheAware:
    settings = PolicySettings(
        cache_threshold=0.5, balance_abs_threshold=32, balance_rel_threshold=1.1, **overrides
    )
    policy = CacheAware(
        settings, random.Random(0), stage="decode", on_decision=lambda stage, reason: None
    )
    policy.set_endpoints(EPS)
    return policy


def seeded(endpoint: Endpoint, policy: CacheAware) -> None:
    policy.tree.insert(PREFIX + "first question", endpoint)


def test_balanced_and_good_match_goes_to_the_matched_endpoint() -> None:
    policy = make()
    seeded(EPS[2], policy)
    loads = {EPS[0]: 0, EPS[1]: 3, EPS[2]: 10, EPS[3]: 1}  # spread 10 <= 32: balanced
    assert policy.choose(EPS, loads, RoutingKey(PREFIX + "second question")) == EPS[2]


def test_unbalanced_goes_to_the_least_loaded() -> None:
    policy = make()
    seeded(EPS[2], policy)
    loads = {EPS[0]: 5, EPS[1]: 3, EPS[2]: 40, EPS[3]: 7}  # 37 > 32 and 40 > 3 * 1.1
    assert policy.choose(EPS, loads, RoutingKey(PREFIX + "second question")) == EPS[1]


def test_absolute_spread_alone_is_not_unbalanced() -> None:
    policy = make()
    seeded(EPS[2], policy)
    # Spread 40 > 32, but 440 is not above 400 * 1.1: both conditions are needed.
    loads = {EPS[0]: 400, EPS[1]: 400, EPS[2]: 440, EPS[3]: 400}
    assert policy.choose(EPS, loads, RoutingKey(PREFIX + "again")) == EPS[2]


def test_match_below_threshold_goes_to_the_least_loaded() -> None:
    policy = make()
    policy.tree.insert("You are", EPS[2])
    loads = {EPS[0]: 2, EPS[1]: 1, EPS[2]: 0, EPS[3]: 0}
    chosen = policy.choose(EPS, loads, RoutingKey("You are a pirate. Say hello, matey."))
    assert chosen in (EPS[2], EPS[3])  # least loaded (tie), the 7/35 match does not count


def test_matched_endpoint_must_be_a_candidate_with_the_longest_match() -> None:
    policy = make()
    policy.tree.insert(PREFIX + "aaaa", EPS[0])  # longest, but unhealthy below
    policy.tree.insert(PREFIX + "bb", EPS[1])
    policy.tree.insert(PREFIX[:40], EPS[3])
    loads = dict.fromkeys(EPS, 0)
    assert policy.choose(EPS[1:], loads, RoutingKey(PREFIX + "aaaa")) == EPS[1]


def test_choice_is_inserted_and_followed() -> None:
    policy = make()
    loads = dict.fromkeys(EPS, 0)
    first = policy.choose(EPS, loads, RoutingKey(PREFIX + "one"))
    assert all(policy.choose(EPS, loads, RoutingKey(PREFIX + f"q{i}")) == first for i in range(5))


def test_equal_loads_and_no_match_spread_over_endpoints() -> None:
    policy = make()
    loads = dict.fromkeys(EPS, 0)
    chosen = {policy.choose(EPS, loads, RoutingKey(f"{i}" * 40)) for i in range(40)}
    assert len(chosen) > 1
    empty = {policy.choose(EPS, loads, RoutingKey("")) for _ in range(40)}
    assert len(empty) > 1


def test_log_line_fields(caplog: pytest.LogCaptureFixture) -> None:
    policy = make()
    seeded(EPS[2], policy)
    caplog.set_level(logging.DEBUG, logger="trio_pdrouter.policy")
    text = PREFIX + "second"
    policy.choose(EPS, {EPS[0]: 1, EPS[1]: 2, EPS[2]: 3, EPS[3]: 4}, RoutingKey(text))
    policy.choose(EPS, {EPS[0]: 0, EPS[1]: 50, EPS[2]: 50, EPS[3]: 50}, RoutingKey(text))
    lines = [r.getMessage() for r in caplog.records if r.name == "trio_pdrouter.policy"]
    assert len(lines) == 2
    fields = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in lines]
    expected_rate = f"{len(PREFIX) / len(text):.3f}"
    assert fields[0] == {
        "stage": "decode",
        "max_load": "4",
        "min_load": "1",
        "is_unbalanced": "false",
        "match_rate": expected_rate,
        "chosen": EPS[2].key,
        "reason": "cache_hit",
    }
    assert fields[1]["is_unbalanced"] == "true"
    assert fields[1]["chosen"] == EPS[0].key
    assert fields[1]["reason"] == "unbalanced"
    order = ["stage", "max_load", "min_load", "is_unbalanced", "match_rate", "chosen", "reason"]
    assert list(fields[0]) == order


def test_set_endpoints_forgets_removed_tenants() -> None:
    policy = make()
    seeded(EPS[2], policy)
    policy.set_endpoints([EPS[0], EPS[1], EPS[3]])
    assert policy.tree.tenant_bytes(EPS[2]) == 0
    assert policy.tree.match(PREFIX) == (0, None)


def test_maintain_evicts_to_max_tree_size() -> None:
    policy = make(max_tree_size=100)
    loads = dict.fromkeys(EPS, 0)
    for i in range(50):
        policy.choose(EPS, loads, RoutingKey(f"prompt number {i} " * 10))
    policy.maintain()
    assert all(n <= 100 for n in policy.tree.tenants().values())
    policy.tree._check_invariants()


def test_prefix_state_is_kept_per_model() -> None:
    """Two models' identical prompts do not attract each other: each model has its tree."""
    policy = make()
    even = dict.fromkeys(EPS, 0)
    text = PREFIX + "a question"
    first = policy.choose(EPS, even, RoutingKey(text, model="alpha"))
    # The same prompt under another model: no hit (it goes to the least loaded, away from
    # the first model's endpoint here), and it is remembered in that model's tree only.
    loads = {ep: 0 if ep != first else 1 for ep in EPS}
    other = policy.choose(EPS, loads, RoutingKey(text, model="beta"))
    assert other != first
    assert policy.tree_of("alpha").match(PREFIX) == (len(PREFIX), first)
    assert policy.tree_of("beta").match(PREFIX) == (len(PREFIX), other)
    assert policy.tree.match(PREFIX) == (0, None)  # requests naming no model: their own
    # each model's next request follows its own model's earlier one
    assert policy.choose(EPS, even, RoutingKey(PREFIX + "more", model="alpha")) == first
    assert policy.choose(EPS, even, RoutingKey(PREFIX + "more", model="beta")) == other
    # the token weights too: the prompt is cached where its model sent it, not elsewhere
    held = policy.uncached_tokens(EPS, RoutingKey(text, prompt_tokens=100, model="beta"))
    assert held[other] == 0 and held[first] == 100


def test_trees_are_bounded_in_number(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache_aware, "MAX_TREES", 3)
    policy = make()
    for model in ("a", "b", "c", "d"):
        policy.choose(EPS, dict.fromkeys(EPS, 0), RoutingKey(PREFIX, model=model))
    assert sorted(policy._trees) == ["b", "c", "d"]  # the least recently used went

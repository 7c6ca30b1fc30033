"""Token weights in routing: estimated before choose, charged with the count, compared by policy."""

from __future__ import annotations

import random

import pytest

from trio_pdrouter.endpoints import Endpoint, Role
from trio_pdrouter.ledger import LoadLedger, prompt_tokens, uncached
from trio_pdrouter.routing import PolicySettings, Routing, RoutingKey, make_policy
from trio_pdrouter.routing.policies import RadixTree

P = [Endpoint("http://p:1", Role.PREFILL, r) for r in range(2)]
D = [Endpoint("http://d:1", Role.DECODE, r) for r in range(2)]


def key(text: str, output: int = 100) -> RoutingKey:
    return RoutingKey(text, None, prompt_tokens(text), output)


def routing(policy: str, ledger: LoadLedger, by_tokens: bool, **settings: float) -> Routing:
    s = PolicySettings(load_metric="tokens" if by_tokens else "requests", **settings)  # type: ignore[arg-type]
    policies = {
        role: make_policy(
            policy, stage=role.value, settings=s, on_decision=lambda *_: None, rng=random.Random(1)
        )
        for role in (Role.PREFILL, Role.DECODE)
    }
    r = Routing(policies, ledger, (), None, by_tokens=policies if by_tokens else (), models=None)
    r.set_endpoints(Role.PREFILL, P)
    r.set_endpoints(Role.DECODE, D)
    return r


def test_match_each_gives_every_eligible_tenant_its_own_prefix() -> None:
    tree: RadixTree[str] = RadixTree()
    tree.insert("hello world", "a")
    tree.insert("help me", "b")
    tree.insert("hello wonder", "c")
    assert tree.match_each("hello wor", {"a", "b", "c", "d"}) == {"a": 9, "b": 3, "c": 8, "d": 0}
    assert tree.match_each("zzz", {"a"}) == {"a": 0}


def test_pd_lease_charges_uncached_prompt_on_prefill_and_prompt_plus_output_on_decode() -> None:
    ledger = LoadLedger([*P, *D])
    r = routing("cache_aware", ledger, by_tokens=False)
    system = "s" * 4000  # 1000 tokens
    first, p1, d1 = r.lease_pd(key(system + "a" * 400))
    assert ledger.token_load(p1) == 1100 and ledger.token_load(d1) == 1200
    first.release_all()
    # The tree now expects p1 to hold the first prompt: only the new part is charged there.
    text = system + "a" * 400 + "b" * 400
    weights = r.weights(Role.PREFILL, P, key(text))
    assert weights[p1] == uncached(1200, 4400, 4800) == 100
    other = next(p for p in P if p != p1)
    assert weights[other] == 1200
    second, p2, d2 = r.lease_pd(key(text))
    assert p2 == p1 and ledger.token_load(p1) == 100 and ledger.token_load(d2) == 1300
    second.release_all()
    assert ledger.token_total() == 0 and ledger.total() == 0


def test_power_of_two_by_tokens_avoids_the_endpoint_with_a_long_prompt_queued() -> None:
    ledger = LoadLedger([*P, *D])
    by_count = routing("power_of_two", ledger, by_tokens=False)
    by_tokens = routing("power_of_two", ledger, by_tokens=True)
    # P[0] runs one 16k-token prompt; P[1] runs three short ones.
    ledger.lease(P[0], tokens={P[0]: 16_000})
    for _ in range(3):
        ledger.lease(P[1], tokens={P[1]: 500})
    short = key("x" * 2000)
    assert {by_count.choose(Role.PREFILL, short) for _ in range(20)} == {P[0]}
    assert {by_tokens.choose(Role.PREFILL, short) for _ in range(20)} == {P[1]}


def test_cache_aware_by_tokens_leaves_its_cached_endpoint_when_tokens_are_unbalanced() -> None:
    for by_tokens in (True, False):
        ledger = LoadLedger([*P, *D])
        r = routing("cache_aware", ledger, by_tokens=by_tokens, balance_token_threshold=4000)
        short = "S" * 2000  # 500 tokens
        r.lease_pd(key(short))[0].release_all()
        hot = r.choose(Role.PREFILL, key(short + "more"))
        # A 16k-token prompt of another group lands on `hot`, a short one on the other: the
        # counts are equal, 1 against 1.
        ledger.lease(hot, tokens={hot: 16_000})
        other = next(p for p in P if p != hot)
        ledger.lease(other, tokens={other: 100})
        chosen = r.choose(Role.PREFILL, key(short + "more"))
        # By tokens the short prompt is computed elsewhere rather than queued behind 16k tokens;
        # by requests the loads look balanced and affinity queues it there.
        assert chosen == (other if by_tokens else hot)


def test_default_metrics_are_tokens_on_prefill_and_requests_elsewhere() -> None:
    from trio_pdrouter.cli import parse_config

    pd = ["--vllm-pd-disaggregation", "--prefill", "http://p:1", "--decode", "http://d:1"]
    assert parse_config(pd).token_roles() == [Role.PREFILL]
    both = [Role.PREFILL, Role.DECODE]
    assert parse_config([*pd, "--load-metric", "tokens"]).token_roles() == both
    assert parse_config([*pd, "--load-metric", "requests"]).token_roles() == []
    swapped = [*pd, "--decode-load-metric", "tokens", "--prefill-load-metric", "requests"]
    assert parse_config(swapped).token_roles() == [Role.DECODE]
    assert parse_config(["--worker-urls", "http://w:1"]).token_roles() == []
    # kv_aware too (it counted requests until measured otherwise: README).
    kv = [*pd, "--prefill-policy", "kv_aware"]
    assert parse_config(kv).token_roles() == [Role.PREFILL]
    assert parse_config([*kv, "--prefill-load-metric", "requests"]).token_roles() == []
    with pytest.raises(SystemExit):
        parse_config([*pd, "--load-metric", "bytes"])
